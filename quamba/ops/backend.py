"""Backend selection for ops: ``torch`` (reference, always present) or ``cuda`` (our kernels in
``quamba._C`` when built; for the FP ops, mamba-ssm's and causal-conv1d's kernels when installed).

Resolution order: the environment variable ``QUAMBA_BACKEND`` (torch | cuda | auto), then the
argument, then ``auto``. ``auto`` takes the CUDA kernel for CUDA tensors when one can run there,
else the torch reference. Asking for ``cuda`` where quamba's own kernel cannot run is an error,
never a silent fallback; so is asking for it with an option that only the reference implements
(a discretization other than zoh for the FP scans, quamba.ops.scan.discretization) or a shape
outside every kernel's limits (each family's ``kernel_lacks``, beside its reference), which
``auto`` runs there.

A torch reference on a CUDA device is a slow path (the decode step of a quantized 2.8B model runs
10-25x slower on it). Where ``auto`` (or ``cuda`` for the optional FP kernels) ends up there, a
WARNING names the op and the reason, once per op, reason and process. Every other first use of an
(op, backend) pair is logged at INFO. :func:`recording` collects which backend each op ran on
inside a block (the profile and the quantized model report it); :func:`plan` says what would run
on a device without running anything (``python -m quamba.env``).

The registry knows no op family: each family (quamba.ops.linear, .conv, .scan, .norm, .ssd,
.fused_decode) registers its torch references when imported and names, with
:func:`kernel_modules`, the modules that register its cuda implementations; those load once
``quamba._C`` has loaded, since they call its ops.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from typing import Callable, Iterator

import torch

from quamba.errors import QuambaError

log = logging.getLogger("quamba")

BACKENDS = ("torch", "cuda", "auto")
ENV_HELP = "`python -m quamba.env` shows the setup"
_IMPLS: dict[str, dict[str, Callable]] = {}
# op → a function returning None when its cuda implementation can run here, else why not
_REQUIREMENTS: dict[str, Callable[[], str | None]] = {}
# ops whose cuda implementation is an optional accelerator from another package (the FP16
# baseline kernels): asking for cuda where it is missing runs the torch reference instead
_OPTIONAL: set[str] = set()
# op → the quamba._C ops its cuda implementation runs, where they are not the one of its own name
_KERNELS: dict[str, tuple[str, ...]] = {}
_LOGGED: set[tuple[str, str]] = set()
_WARNED: set[tuple[str, str]] = set()  # (op, why it runs the reference)
_RECORDERS: list[dict[str, set[str]]] = []
# modules that register cuda implementations, named by the op families, not yet imported
_PENDING_KERNEL_MODULES: list[str] = []
_EXTENSION_LOADED = False


class BackendError(QuambaError):
    """A requested backend cannot run the op here."""


def register(op: str, backend: str, requires: Callable[[], str | None] | None = None,
             kernels: tuple[str, ...] | None = None, fp: bool = False):
    """Decorator registering ``fn`` as ``backend``'s implementation of ``op``. ``requires`` marks an
    optional cuda implementation from another package (the FP ops on mamba-ssm's kernels) and
    says whether it can run here: None, or why not. Where it cannot, both ``cuda`` and ``auto``
    run the torch reference: only quamba's own kernels make ``cuda`` strict. ``fp`` marks an FP
    op the same way where no cuda implementation exists yet. ``kernels`` names the quamba._C ops
    a cuda implementation runs when it composes others (default: ``op`` itself; ``()`` for a
    Triton kernel, which needs no quamba._C op)."""
    def wrap(fn):
        _IMPLS.setdefault(op, {})[backend] = fn
        if requires is not None:
            _REQUIREMENTS[op] = requires
        if requires is not None or fp:
            _OPTIONAL.add(op)
        if kernels is not None:
            _KERNELS[op] = kernels
        return fn
    return wrap


def quamba_ops() -> list[str]:
    """The ops whose cuda implementation is quamba's own kernel (the quantized ops)."""
    return sorted(op for op in _IMPLS if op not in _OPTIONAL)


def fp_ops() -> list[str]:
    """The FP ops, whose cuda implementation is the optional FP16 baseline kernels."""
    return sorted(_OPTIONAL)


def kernel_modules(*names: str) -> None:
    """Names the modules (dotted) that register an op family's cuda implementations: imported
    when quamba._C is found to load (:func:`cuda_extension_error`), or at once if it has been."""
    _PENDING_KERNEL_MODULES.extend(names)
    if _EXTENSION_LOADED:
        _import_kernel_modules()


def _import_kernel_modules() -> None:
    while _PENDING_KERNEL_MODULES:
        importlib.import_module(_PENDING_KERNEL_MODULES.pop(0))


@functools.lru_cache(maxsize=1)
def cuda_extension_error() -> str | None:
    """None when quamba._C loads (its kernel modules then register their implementations), else
    why not (one line, with the import error's own text)."""
    global _EXTENSION_LOADED
    try:
        import quamba._C  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "quamba._C":
            return f"quamba._C failed to load: {exc}"
        return ("the quamba CUDA extension quamba._C is not built (no quamba/_C*.so beside "
                f"{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}/__init__.py); "
                "build it as the README's GPU install says")
    except Exception as exc:  # noqa: BLE001  an undefined symbol, a missing library, a bad ELF...
        return f"quamba._C failed to load: {type(exc).__name__}: {_one_line(exc)}"
    _EXTENSION_LOADED = True
    _import_kernel_modules()
    return None


@functools.lru_cache(maxsize=None)
def device_error(index: int) -> str | None:
    """None when quamba._C holds kernels that CUDA device ``index`` can run, else why not."""
    probe = getattr(torch.ops.quamba, "kernel_image_error", None)
    if probe is None:  # a build older than the probe: its kernels check at launch
        return None
    error = probe(index)
    if not error:
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return (f"quamba._C holds no kernel for {torch.cuda.get_device_name(index)} (compute capability "
            f"{major}.{minor}; built for {cuda_archs() or 'unknown architectures'}): {error}; "
            "rebuild with TORCH_CUDA_ARCH_LIST naming it")


@functools.lru_cache(maxsize=None)
def has_programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch programmatically dependent (PDL: compute
    capability 9 and up), as quamba's Triton kernels do there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def cuda_archs() -> str:
    """The virtual architectures quamba._C was compiled for, as nvcc lists them ('900'), or ''."""
    archs = getattr(torch.ops.quamba, "cuda_archs", None)
    return archs() if archs is not None else ""


def requested_backend(argument: str | None = None) -> str:
    choice = os.environ.get("QUAMBA_BACKEND") or argument or "auto"
    if choice not in BACKENDS:
        source = "QUAMBA_BACKEND" if os.environ.get("QUAMBA_BACKEND") else "backend"
        raise BackendError(f"{source} must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


def resolve(op: str, device: torch.device, argument: str | None = None,
            cuda_lacks: str | None = None) -> tuple[str, str | None]:
    """(the backend ``op`` runs on for tensors on ``device``, why not cuda where that is the torch
    reference and cuda was possible to ask for). Raises BackendError where ``cuda`` is required
    and cannot run. ``cuda_lacks`` says why no cuda implementation can serve this call (an option
    only the reference implements, e.g. a discretization, or a shape outside the kernels' limits):
    ``auto`` then runs the reference, and ``cuda`` is refused even for the optional FP kernels."""
    choice = requested_backend(argument)
    if choice == "torch":
        return "torch", None
    if cuda_lacks is not None:
        if choice == "cuda":
            raise BackendError(f"backend 'cuda' requested for {op} but {cuda_lacks}")
        return "torch", cuda_lacks
    why_not = _why_not_cuda(op, device)
    if why_not is None:
        return "cuda", None
    if choice == "auto" or op in _OPTIONAL:
        return "torch", why_not
    raise BackendError(f"backend 'cuda' requested for {op} but {why_not}")


def select(op: str, device: torch.device, argument: str | None = None,
           cuda_lacks: str | None = None) -> Callable:
    """The implementation of ``op`` to run on tensors on ``device`` (``cuda_lacks``: see
    :func:`resolve`)."""
    name, why_not = resolve(op, device, argument, cuda_lacks)
    if device.type == "cuda" and why_not is not None:
        _warn_slow_path(op, device, why_not)
    _use(op, name)
    return _IMPLS[op][name]


def plan(device: torch.device, argument: str | None = None) -> dict[str, tuple[str, str | None]]:
    """For every registered op: (backend, reason or None) on ``device``, as :func:`select` would
    choose, without running, logging or warning; a refused ``cuda`` reads ('error', reason)."""
    cuda_extension_error()  # registers quamba's kernels where they load
    choices = {}
    for op in sorted(_IMPLS):
        try:
            choices[op] = resolve(op, device, argument)
        except BackendError as exc:
            choices[op] = ("error", str(exc))
    return choices


def _why_not_cuda(op: str, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"its inputs are on {device}, not a CUDA device"
    cuda_extension_error()  # registers quamba's kernels (the FP SSD's among them) where they load
    if op in _OPTIONAL and op not in _REQUIREMENTS:
        return f"no CUDA kernel implements {op} yet"
    missing = cuda_missing(op, device)
    if missing is None and "cuda" not in _IMPLS[op]:
        return f"no CUDA kernel implements {op}"
    return missing


def cuda_missing(op: str, device: torch.device | None = None) -> str | None:
    """None when the cuda implementation of ``op`` can run here (on ``device``, where given),
    else why not."""
    if op in _REQUIREMENTS:
        return _REQUIREMENTS[op]()
    if op in _OPTIONAL:
        return f"no CUDA kernel implements {op} yet"
    missing = cuda_extension_error() or _kernel_missing(op)
    if missing is None and device is not None and device.type == "cuda":
        missing = device_error(_device_index(device))
    return missing


def _device_index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


@functools.lru_cache(maxsize=None)
def _kernel_missing(op: str) -> str | None:
    """quamba._C built with some kernel families only (setup.py's QUAMBA_CUDA_FAMILIES) lacks the
    others' ops; each cuda implementation of ours runs the torch op of its own name, or those
    registered as its ``kernels``."""
    for kernel in _KERNELS.get(op, (op,)):
        if not hasattr(torch.ops.quamba, kernel):
            return f"quamba._C was built without the {kernel} kernel (QUAMBA_CUDA_FAMILIES)"
    return None


def _warn_slow_path(op: str, device: torch.device, why_not: str) -> None:
    if (op, why_not) in _WARNED:
        return
    _WARNED.add((op, why_not))
    kind = "the FP16 kernel" if op in _OPTIONAL else "quamba's CUDA kernel"
    log.warning("op %s runs its torch reference on %s, a slow path, not %s: %s (%s)",
                op, device, kind, why_not, ENV_HELP)


def _use(op: str, backend: str) -> None:
    for recorder in _RECORDERS:
        recorder.setdefault(op, set()).add(backend)
    if (op, backend) not in _LOGGED:
        _LOGGED.add((op, backend))
        log.info("op %s uses the %s backend", op, backend)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, set[str]]]:
    """Collects, for every op selected inside the block, the backends it ran on: op → {backend}.
    Blocks nest; each sees every op selected inside it."""
    ran: dict[str, set[str]] = {}
    _RECORDERS.append(ran)
    try:
        yield ran
    finally:
        _RECORDERS.remove(ran)


def summary(ran: dict[str, set[str]]) -> dict[str, str]:
    """A :func:`recording` as op → backend ("cuda", "torch", or "cuda+torch" where both ran)."""
    return {op: "+".join(sorted(backends)) for op, backends in sorted(ran.items())}


def on_reference(ran: dict[str, set[str]], ops=None) -> list[str]:
    """The ops of ``ran`` (a :func:`recording`) that ran their torch reference, limited to
    ``ops`` (default: quamba's own, the quantized ops)."""
    ops = set(quamba_ops() if ops is None else ops)
    return sorted(op for op, backends in ran.items() if op in ops and "torch" in backends)


def used_backends() -> dict[str, list[str]]:
    """Which backends each op kind has used in this process (for run logs)."""
    used: dict[str, list[str]] = {}
    for op, backend in sorted(_LOGGED):
        used.setdefault(op, []).append(backend)
    return used


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
