"""Backend selection for ops: ``torch`` (reference, always present) or ``cuda`` (our kernels in
``quamba._C`` when built; for the FP ops, mamba-ssm's and causal-conv1d's kernels when installed).

Resolution order: the environment variable ``QUAMBA_BACKEND`` (torch | cuda | auto), then the
argument, then ``auto``. ``auto`` takes the CUDA kernel for CUDA tensors when one is registered
for the op, else the torch reference. Asking for ``cuda`` where it cannot run is an error, never
a silent fallback. The first use of each (op, backend) pair is logged once.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import torch

from quamba.errors import QuambaError

log = logging.getLogger("quamba")

BACKENDS = ("torch", "cuda", "auto")
_IMPLS: dict[str, dict[str, Callable]] = {}
# op → a function returning None when its cuda implementation can run here, else why not
_REQUIREMENTS: dict[str, Callable[[], str | None]] = {}
# ops whose cuda implementation is an optional accelerator from another package (the FP16
# baseline kernels): asking for cuda where it is missing runs the torch reference instead
_OPTIONAL: set[str] = set()
# op → the quamba._C ops its cuda implementation runs, where they are not the one of its own name
_KERNELS: dict[str, tuple[str, ...]] = {}
_LOGGED: set[tuple[str, str]] = set()


class BackendError(QuambaError):
    """A requested backend cannot run the op here."""


def register(op: str, backend: str, requires: Callable[[], str | None] | None = None,
             kernels: tuple[str, ...] | None = None):
    """Decorator registering ``fn`` as ``backend``'s implementation of ``op``. ``requires`` marks an
    optional cuda implementation from another package (the FP ops on mamba-ssm's kernels) and
    says whether it can run here: None, or why not. Where it cannot, both ``cuda`` and ``auto``
    run the torch reference: only quamba's own kernels make ``cuda`` strict. ``kernels`` names the
    quamba._C ops a cuda implementation runs when it composes others (default: ``op`` itself)."""
    def wrap(fn):
        _IMPLS.setdefault(op, {})[backend] = fn
        if requires is not None:
            _REQUIREMENTS[op] = requires
            _OPTIONAL.add(op)
        if kernels is not None:
            _KERNELS[op] = kernels
        return fn
    return wrap


@functools.lru_cache(maxsize=1)
def cuda_extension_error() -> str | None:
    """None when quamba._C imports, else why not (one line)."""
    try:
        import quamba._C  # noqa: F401
    except ImportError as exc:
        return f"the quamba CUDA extension is not built ({exc})"
    import quamba.ops.cuda_backend  # noqa: F401  registers the kernels
    return None


def requested_backend(argument: str | None = None) -> str:
    choice = os.environ.get("QUAMBA_BACKEND") or argument or "auto"
    if choice not in BACKENDS:
        source = "QUAMBA_BACKEND" if os.environ.get("QUAMBA_BACKEND") else "backend"
        raise BackendError(f"{source} must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


def select(op: str, device: torch.device, argument: str | None = None) -> Callable:
    """The implementation of ``op`` to run on tensors on ``device``."""
    choice = requested_backend(argument)
    impls = _IMPLS[op]
    if choice == "torch":
        return _use(op, "torch", impls)
    cuda_ready = device.type == "cuda" and cuda_missing(op) is None and "cuda" in impls
    if choice == "auto" or op in _OPTIONAL:
        return _use(op, "cuda" if cuda_ready else "torch", impls)
    if not cuda_ready:
        raise BackendError(f"backend 'cuda' requested for {op} but {_why_not_cuda(op, device)}")
    return _use(op, "cuda", impls)


def _why_not_cuda(op: str, device: torch.device) -> str:
    if device.type != "cuda":
        return f"its inputs are on {device}, not a CUDA device"
    return cuda_missing(op) or f"no CUDA kernel implements {op}"


def cuda_missing(op: str) -> str | None:
    """None when the cuda implementation of ``op`` can run here (a CUDA device aside), else why not."""
    if op in _REQUIREMENTS:
        return _REQUIREMENTS[op]()
    return cuda_extension_error() or _kernel_missing(op)


@functools.lru_cache(maxsize=None)
def _kernel_missing(op: str) -> str | None:
    """quamba._C built with some kernel families only (setup.py's QUAMBA_CUDA_FAMILIES) lacks the
    others' ops; each cuda implementation of ours runs the torch op of its own name, or those
    registered as its ``kernels``."""
    for kernel in _KERNELS.get(op, (op,)):
        if not hasattr(torch.ops.quamba, kernel):
            return f"quamba._C was built without the {kernel} kernel (QUAMBA_CUDA_FAMILIES)"
    return None


def _use(op: str, backend: str, impls: dict) -> Callable:
    if (op, backend) not in _LOGGED:
        _LOGGED.add((op, backend))
        log.info("op %s uses the %s backend", op, backend)
    return impls[backend]


def used_backends() -> dict[str, list[str]]:
    """Which backends each op kind has used in this process (for run logs)."""
    used: dict[str, list[str]] = {}
    for op, backend in sorted(_LOGGED):
        used.setdefault(op, []).append(backend)
    return used
