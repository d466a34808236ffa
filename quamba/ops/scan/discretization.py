"""Discretizations of the selective scan's ODE, and the backend choice they imply.

Each channel d and state n of the Mamba1 SSM is a scalar ODE h' = a h + v(s) with a = A[d, n] < 0
and the drive v = B u (B_t[n] u_t[d]); step t lasts Δ = Δ_t[d]. With z = Δ a:

* ``zoh`` (the default, mamba_ssm's): zero-order hold on A, Euler on B:
  h_t = exp(z) h_{t-1} + Δ v_t
* ``zoh-exact``: the exact solution with v held at v_t over the step:
  h_t = exp(z) h_{t-1} + Δ φ1(z) v_t,  Δ φ1(z) = (exp(z) - 1) / a  (→ Δ as a → 0)
* ``bilinear`` (Tustin): h_t = (1 + z/2) / (1 - z/2) h_{t-1} + Δ / (1 - z/2) v_t
* ``foh``: first-order hold: v interpolated linearly from v_{t-1} (at the step's start) to v_t
  (at its end); the held quantity is the product B u, so both B and u move. The exact solution,
  h_t = exp(z) h_{t-1} + ∫_0^Δ exp(a(Δ - s)) [(1 - s/Δ) v_{t-1} + (s/Δ) v_t] ds, is
  h_t = exp(z) h_{t-1} + Δ (φ1(z) - φ2(z)) v_{t-1} + Δ φ2(z) v_t,  φ2(z) = (exp(z) - 1 - z) / z²
  Before a sequence's first step v_{-1} = 0 (u_{-1} = 0), unless a carried drive continues an
  earlier one. A decode step carries v_{t-1} = u_{t-1} ⊗ B_{t-1} (fp32 [batch, d_inner, d_state],
  :func:`input_drive`) beside the state and overwrites it with v_t.
* ``rk4``: one classical Runge-Kutta step of h' = a h + v_t (v held constant): k1 = a h + v,
  k2 = a (h + Δ k1/2) + v, k3 = a (h + Δ k2/2) + v, k4 = a (h + Δ k3) + v,
  h_t = h + Δ (k1 + 2 k2 + 2 k3 + k4)/6, which for this linear ODE expands to
  h_t = R(z) h_{t-1} + Δ S(z) v_t with
  R(z) = 1 + z + z²/2 + z³/6 + z⁴/24 and S(z) = (R(z) - 1)/z = 1 + z/2 + z²/6 + z³/24
  (stable only for z ≥ -2.78: its Ā leaves [-1, 1] below).

φ1(z) = expm1(z)/z and φ2 are evaluated without cancellation (φ2 by its Taylor series near 0).
quamba's QSScan kernels (``qsscan``, ``qsscan_update``) and the full-A scan's Triton kernel
(quamba.ops.scan.full_scan_triton) implement every method; mamba-ssm's FP kernels
(``selective_scan``, ``selective_state_update``) zoh only.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch

from quamba.errors import QuambaError
from quamba.ops import backend

METHODS = ("zoh", "zoh-exact", "bilinear", "foh", "rk4")
DEFAULT = "zoh"

# φ2(z) = Σ_k z^k / (k + 2)! is summed for |z| below this (7 terms: relative error < 1e-7);
# above it (expm1(z) - z) / z² loses under 3 bits.
_PHI2_SERIES_BELOW = 0.5
_PHI2_SERIES = tuple(1 / math.factorial(k + 2) for k in range(7))
_RK4_DECAY = (1, 1, 1 / 2, 1 / 6, 1 / 24)  # R(z), lowest power first
_RK4_GAIN = (1, 1 / 2, 1 / 6, 1 / 24)  # S(z)
# The ops whose CUDA kernels take every method (csrc/qsscan); the others' run zoh only.
class Coefficients(NamedTuple):
    """One step's Ā, and the gains B̄ applies to this step's drive and (foh) the previous one's."""

    decay: torch.Tensor
    gain: torch.Tensor
    previous_gain: torch.Tensor | None


def check(method: str) -> str:
    """``method`` if it names a discretization, else a one-line QuambaError listing them."""
    if method not in METHODS:
        raise QuambaError(f"unknown discretization {method!r}; choose one of {', '.join(METHODS)}")
    return method


def select_scan(op: str, device: torch.device, backend_name: str | None, method: str,
                kernel_methods: tuple[str, ...] = (DEFAULT,), kernel_lacks: str | None = None,
                **foh_drives) -> Callable:
    """The implementation of scan ``op`` (see :func:`quamba.ops.backend.select`) for ``method``.

    The CUDA kernels run ``kernel_methods`` only (default: zoh): for another method,
    or where ``kernel_lacks`` says why the kernel cannot serve this call, ``auto`` takes the
    torch reference (with the backend's slow-path warning on a GPU) and ``cuda`` is a
    BackendError. A method other than zoh gets ``discretization=method`` and ``foh_drives``
    (the carried drive tensors, foh only)."""
    check(method)
    carried = [name for name, drive in foh_drives.items() if drive is not None]
    if carried and method != "foh":
        raise QuambaError(f"{carried[0]} is carried by the foh discretization only, not {method!r}")
    lacks = _cuda_lacks(method, kernel_methods) or kernel_lacks
    impl = backend.select(op, device, backend_name, cuda_lacks=lacks)
    return impl if method == DEFAULT else functools.partial(impl, discretization=method,
                                                            **foh_drives)


def require_drive(method: str, drive) -> None:
    """A foh decode step reads and updates the previous step's drive: a one-line QuambaError
    where none is given."""
    if method == "foh" and drive is None:
        raise QuambaError("a foh decode step needs drive=, the previous step's u ⊗ B "
                          "(fp32 [batch, d_inner, d_state]), which it updates in place")


def _cuda_lacks(method: str, kernel_methods: tuple[str, ...]) -> str | None:
    if method in kernel_methods:
        return None
    return (f"its CUDA kernel implements only the {', '.join(map(repr, kernel_methods))} "
            f"discretization, not {method!r}")


def compute_dtype(u: torch.Tensor) -> torch.dtype:
    """The scans' arithmetic: fp32, or fp64 for fp64 inputs (gradient checks in float64)."""
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def input_drive(u: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The drive v = u ⊗ B in fp32 (fp64 for fp64 u): [batch, d_inner, (seqlen,) d_state] from
    u [batch, d_inner (, seqlen)] and B [batch, d_state (, seqlen)]. Of a prefill's last step
    (u[..., -1], B[..., -1]) it is what a foh decode step continues from."""
    dtype = compute_dtype(u)
    return u.to(dtype).unsqueeze(-1) * B.to(dtype).movedim(1, -1).unsqueeze(1)


def discretize(method: str, dt: torch.Tensor, A: torch.Tensor, drive: torch.Tensor,
               previous_drive: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Ā, B̄u) of ``method`` (not zoh: the scans keep their own zoh arithmetic) for steps of
    length ``dt`` with drives ``drive`` (and, for foh, the steps' previous drives
    ``previous_drive``); dt and A broadcast to the drive's shape."""
    decay, gain, previous_gain = coefficients(method, dt, A)
    step_input = gain * drive
    if previous_gain is not None:
        step_input = step_input + previous_gain * previous_drive
    return decay, step_input


def coefficients(method: str, dt: torch.Tensor, A: torch.Tensor) -> Coefficients:
    """Ā and the drive gains of ``method`` (any but zoh) for z = dt·A, elementwise."""
    return _COEFFICIENTS[method](dt, dt * A)


def _zoh_exact(dt, z) -> Coefficients:
    return Coefficients(torch.exp(z), dt * _phi1(z), None)


def _bilinear(dt, z) -> Coefficients:
    denominator = 1 - z / 2
    return Coefficients((1 + z / 2) / denominator, dt / denominator, None)


def _foh(dt, z) -> Coefficients:
    phi2 = _phi2(z)
    return Coefficients(torch.exp(z), dt * phi2, dt * (_phi1(z) - phi2))


def _rk4(dt, z) -> Coefficients:
    return Coefficients(_polynomial(z, _RK4_DECAY), dt * _polynomial(z, _RK4_GAIN), None)


_COEFFICIENTS = {"zoh-exact": _zoh_exact, "bilinear": _bilinear, "foh": _foh, "rk4": _rk4}


def _phi1(z: torch.Tensor) -> torch.Tensor:
    """(exp(z) - 1) / z, 1 at z = 0."""
    zero = z == 0
    safe = torch.where(zero, 1.0, z)
    return torch.where(zero, 1.0, torch.expm1(safe) / safe)


def _phi2(z: torch.Tensor) -> torch.Tensor:
    """(exp(z) - 1 - z) / z², 1/2 at z = 0."""
    near_zero = z.abs() < _PHI2_SERIES_BELOW
    safe = torch.where(near_zero, 1.0, z)
    closed_form = (torch.expm1(safe) - safe) / (safe * safe)
    return torch.where(near_zero, _polynomial(z, _PHI2_SERIES), closed_form)


def _polynomial(z: torch.Tensor, coefficients: tuple) -> torch.Tensor:
    """Σ_k coefficients[k] z^k by Horner's rule."""
    value = torch.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        value = value * z + c
    return value
