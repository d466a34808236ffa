"""The selective scan for training: :func:`trainable_selective_scan`, differentiable on every
backend. ``torch`` is autograd through the reference (quamba.ops.scan.selective_scan, which keeps
every step's state); ``cuda`` is the fused Triton forward and backward of
quamba.ops.scan.trainable_scan_triton, which keep one state per chunk of steps and recompute the
rest.

The inference scan (:func:`quamba.ops.selective_scan.selective_scan`) is untouched: on a GPU it
runs mamba-ssm's kernel (zoh only). This op's cuda backend implements zoh, zoh-exact, bilinear
and rk4; foh under ``cuda`` is a BackendError, under ``auto`` the reference runs.
"""
from __future__ import annotations

import functools

from quamba.ops import backend
from quamba.ops.scan.discretization import DEFAULT, check
from quamba.ops.scan.selective_scan import _selective_scan_torch

# quamba.ops.scan.trainable_scan_triton.METHODS (not imported here: importing quamba never needs
# Triton)
FUSED_METHODS = ("zoh", "zoh-exact", "bilinear", "rk4")


def trainable_selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                             delta_softplus=False, discretization=DEFAULT, backend_name=None):
    """(y, last_state) of :func:`quamba.ops.selective_scan.selective_scan` (same arguments and
    formulas, no initial state), with gradients for u, delta, A, B, C, D, z and delta_bias
    (and through last_state). y has u's dtype, last_state is fp32; gradients have their input's
    dtype. B and C are [batch, d_state, seqlen] (one group)."""
    check(discretization)
    lacks = None if discretization in FUSED_METHODS else (
        f"its fused Triton kernels implement {', '.join(FUSED_METHODS)}, not {discretization!r}")
    impl = backend.select("trainable_selective_scan", u.device, backend_name, cuda_lacks=lacks)
    return impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus, discretization)


@backend.register("trainable_selective_scan", "torch")
def _trainable_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, discretization):
    return _selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, None,
                                 discretization=discretization)


@functools.lru_cache(maxsize=1)
def triton_missing() -> str | None:
    """None when Triton imports, else why not (one line)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc})"
    return None


@backend.register("trainable_selective_scan", "cuda", requires=triton_missing)
def _trainable_scan_cuda(u, delta, A, B, C, D, z, delta_bias, delta_softplus, discretization):
    from quamba.ops.scan import trainable_scan_triton
    return trainable_scan_triton.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                      discretization)
