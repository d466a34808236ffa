"""Floating-point selective scan with a full (dense) A per channel: the torch reference.

Mamba1's A is diagonal, one scalar ODE per channel d and state n. Here each channel d holds the
vector ODE h' = A_d h + v(s) with A_d = A[d] a dense d_state × d_state matrix and the drive
v = u[d] B (B_t ∈ R^d_state). With step Δ = Δ_t[d], M = Δ A_d and v_t = u_t[d] B_t:

    h_t = Ā_t h_{t-1} + B̄u_t,   y_t = C_t · h_t + D u_t,   y_t ← y_t ⊙ SiLU(z_t)

and, per method (the matrix forms of quamba.ops.scan.discretization's scalar ones, which they equal
entry by entry when A_d is diagonal):

    zoh (default)  Ā = expm(M)                  B̄u_t = Δ v_t   (Euler on B, as mamba_ssm)
    zoh-exact      Ā = expm(M)                  B̄u_t = Δ φ1(M) v_t = A_d⁻¹ (expm(M) - I) v_t
    bilinear       Ā = (I - M/2)⁻¹ (I + M/2)    B̄u_t = (I - M/2)⁻¹ Δ v_t
    foh            Ā = expm(M)                  B̄u_t = Δ (φ1 - φ2)(M) v_{t-1} + Δ φ2(M) v_t
    rk4            Ā = I + M S(M)               B̄u_t = Δ S(M) v_t

with φ1(M) = Σ_k M^k / (k + 1)!, φ2(M) = Σ_k M^k / (k + 2)! and S(M) = I + M/2 + M²/6 + M³/24
(rk4: one classical Runge-Kutta step of h' = A_d h + v_t, v held). zoh-exact and foh never
invert A: they read φ1(M) w and φ2(M) w off the exponential of an augmented matrix
(:func:`_augmented_exp`), so a singular A is fine. bilinear solves with I - M/2
(torch.linalg.solve) instead of inverting it.
foh carries v_{t-1} as selective_scan does (``initial_drive``, ``drive``).

A may also be given in the structured form ``(diagonal, U, V)``, A_d = diag(diagonal_d) + U_d V_dᵀ
(:func:`structured_A`), densified before either backend runs. The state is fp32 [batch, d_inner,
d_state].

Both ops are FP ops with a Triton kernel for d_state ≤ 16, every method
(quamba.ops.scan.full_scan_triton: series of matrix-vector products, fp32, no backward). The
``cuda`` backend is refused (BackendError) for what the kernel lacks, a larger d_state, fp64 inputs
or inputs that need gradients; ``auto`` runs this reference there, with the backend's warning on a
GPU, as it does where Triton is missing.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from quamba.ops import backend
from quamba.ops.scan.discretization import (
    DEFAULT,
    METHODS,
    compute_dtype,
    input_drive,
    require_drive,
    select_scan,
)

# Time steps whose Ā ([batch, d_inner, _CHUNK, d_state, d_state]) are materialised at once.
_CHUNK = 64
_RK4_GAIN = tuple(1 / math.factorial(k + 1) for k in range(4))  # S(M), lowest power first
KERNEL_MAX_D_STATE = 16  # the Triton kernel's tile (full_scan_triton.D_STATE_TILE): a 16 × 16 A


def structured_A(diagonal: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """The dense A = diag(diagonal) + U Vᵀ per channel: diagonal [d_inner, d_state], U and V
    [d_inner, d_state, rank] → [d_inner, d_state, d_state]."""
    if diagonal.dim() != 2 or U.dim() != 3 or U.shape[:2] != diagonal.shape or U.shape != V.shape:
        raise ValueError("structured A must be (diagonal [d_inner, d_state], U and V [d_inner, "
                         f"d_state, rank]), got {list(diagonal.shape)}, {list(U.shape)}, "
                         f"{list(V.shape)}")
    return torch.diag_embed(diagonal) + U @ V.transpose(-1, -2)


def full_selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                        initial_state=None, discretization=DEFAULT, backend_name=None,
                        initial_drive=None):
    """Full-A selective scan in fp32 (fp64 for fp64 inputs); returns ``(y, last_state)``.

    u, delta, z: [batch, d_inner, seqlen]; A: [d_inner, d_state, d_state] or ``(diagonal, U, V)``;
    B, C: [batch, d_state, seqlen]; D, delta_bias: [d_inner]; initial_state: [batch, d_inner,
    d_state] or None (zeros). Δ = softplus(delta + delta_bias) (softplus only if delta_softplus).
    foh reads ``initial_drive`` (fp32 [batch, d_inner, d_state]) as v_{-1}, zeros if None.
    y has u's dtype; last_state is fp32 [batch, d_inner, d_state].
    """
    A = _dense(A)
    _check_shapes(u, delta, A, B, C, D, z, delta_bias, ("seqlen",),
                  initial_state=initial_state, initial_drive=initial_drive)
    impl = select_scan("full_selective_scan", u.device, backend_name, discretization,
                       kernel_methods=METHODS,
                       kernel_lacks=_kernel_lacks(A, u, delta, B, C, D, z, delta_bias,
                                                  initial_state, initial_drive),
                       initial_drive=initial_drive)
    return impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state)


def full_selective_state_update(state, u, delta, A, B, C, D=None, z=None, delta_bias=None,
                                delta_softplus=False, discretization=DEFAULT, backend_name=None,
                                drive=None):
    """One decode step of :func:`full_selective_scan`; updates ``state`` (fp32 [batch, d_inner,
    d_state]) in place and returns y [batch, d_inner] in u's dtype. u, delta, z: [batch, d_inner];
    B, C: [batch, d_state]. foh needs ``drive``, the previous step's v = u ⊗ B (fp32 [batch,
    d_inner, d_state]; zeros before a sequence's first step), which it overwrites with this one's.
    """
    require_drive(discretization, drive)
    A = _dense(A)
    _check_shapes(u, delta, A, B, C, D, z, delta_bias, (), state=state, drive=drive)
    impl = select_scan("full_selective_state_update", u.device, backend_name, discretization,
                       kernel_methods=METHODS,
                       kernel_lacks=_kernel_lacks(A, state, u, delta, B, C, D, z, delta_bias,
                                                  drive),
                       drive=drive)
    return impl(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus)


def _kernel_lacks(A, *tensors) -> str | None:
    """Why the Triton kernel cannot run a call with this A and these tensors (None allowed), or
    None where it can."""
    if A.shape[-1] > KERNEL_MAX_D_STATE:
        return f"its Triton kernel handles d_state ≤ {KERNEL_MAX_D_STATE}, not {A.shape[-1]}"
    present = [A] + [t for t in tensors if t is not None]
    if any(t.dtype == torch.float64 for t in present):
        return "its Triton kernel computes in fp32, not fp64"
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return "its Triton kernel has no backward (inputs require grad)"
    return None


def _dense(A):
    return structured_A(*A) if isinstance(A, tuple) else A


def _check_shapes(u, delta, A, B, C, D, z, delta_bias, time_dims, **states):
    """One-line ValueErrors for tensors off the layouts; ``time_dims`` is ("seqlen",) for a scan,
    () for a decode step; ``states`` are [batch, d_inner, d_state] tensors or None."""
    if u.dim() != 2 + len(time_dims):
        raise ValueError(f"u must be [batch, d_inner{''.join(', ' + d for d in time_dims)}], "
                         f"got {list(u.shape)}")
    batch, d_inner = u.shape[:2]
    if A.dim() != 3 or A.shape[0] != d_inner or A.shape[1] != A.shape[2]:
        raise ValueError(f"A must be [d_inner, d_state, d_state] with d_inner = {d_inner}, "
                         f"got {list(A.shape)}")
    d_state, time = A.shape[-1], tuple(u.shape[2:])
    layouts = {"delta": (delta, ("batch", "d_inner") + time_dims, (batch, d_inner) + time),
               "z": (z, ("batch", "d_inner") + time_dims, (batch, d_inner) + time),
               "B": (B, ("batch", "d_state") + time_dims, (batch, d_state) + time),
               "C": (C, ("batch", "d_state") + time_dims, (batch, d_state) + time),
               "D": (D, ("d_inner",), (d_inner,)),
               "delta_bias": (delta_bias, ("d_inner",), (d_inner,))}
    layouts.update({name: (tensor, ("batch", "d_inner", "d_state"), (batch, d_inner, d_state))
                    for name, tensor in states.items()})
    for name, (tensor, dims, shape) in layouts.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be [{', '.join(dims)}] = {list(shape)}, "
                             f"got {list(tensor.shape)}")


@backend.register("full_selective_scan", "torch", fp=True)
def _full_selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                               discretization=DEFAULT, initial_drive=None):
    out_dtype = u.dtype
    dtype = compute_dtype(u)
    u, B, C, A = u.to(dtype), B.to(dtype), C.to(dtype), A.to(dtype)
    dt = _step_lengths(u, delta, delta_bias, delta_softplus)
    batch, d_inner, seqlen = u.shape
    state = (u.new_zeros(batch, d_inner, A.shape[-1]) if initial_state is None
             else initial_state.to(dtype).clone())
    previous_drive = (state.new_zeros(state.shape) if initial_drive is None
                      else initial_drive.to(dtype))
    ys = []
    for start in range(0, seqlen, _CHUNK):
        chunk = slice(start, min(start + _CHUNK, seqlen))
        drive = input_drive(u[:, :, chunk], B[:, :, chunk])  # v_t [b, d, t, n]
        earlier = torch.cat([previous_drive.unsqueeze(2), drive[:, :, :-1]], dim=2)  # v_{t-1}
        decay, step_input = _discretize(discretization, dt[:, :, chunk], A[None, :, None],
                                        drive, earlier)
        states = torch.empty_like(step_input)
        for t in range(states.shape[2]):
            state = _step(decay[:, :, t], state, step_input[:, :, t])
            states[:, :, t] = state
        previous_drive = drive[:, :, -1]
        ys.append(torch.einsum("bdtn,bnt->bdt", states, C[:, :, chunk]))
    y = torch.cat(ys, dim=-1) if ys else u.new_zeros(batch, d_inner, 0)
    return _output(y, u, D, z).to(out_dtype), state


@backend.register("full_selective_state_update", "torch", fp=True)
def _full_selective_state_update_torch(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                       discretization=DEFAULT, drive=None):
    out_dtype = u.dtype
    dtype = compute_dtype(u)
    u = u.to(dtype)
    dt = _step_lengths(u, delta, delta_bias, delta_softplus)
    current_drive = input_drive(u, B)
    previous_drive = None if drive is None else drive.to(dtype, copy=True)  # autograd keeps it
    decay, step_input = _discretize(discretization, dt, A.to(dtype)[None], current_drive,
                                    previous_drive)
    new_state = _step(decay, state.to(dtype, copy=True), step_input)
    state.copy_(new_state)
    if drive is not None:
        drive.copy_(current_drive)
    y = torch.einsum("bdn,bn->bd", new_state, C.to(dtype))
    return _output(y, u, D, z).to(out_dtype)


@functools.lru_cache(maxsize=1)
def _triton_missing() -> str | None:
    """None when Triton imports (it ships with PyTorch's CUDA builds), else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc}): no full-A scan kernel"
    return None


@backend.register("full_selective_scan", "cuda", kernels=(), requires=_triton_missing)
def _full_selective_scan_cuda(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                              discretization=DEFAULT, initial_drive=None):
    from quamba.ops.scan import full_scan_triton
    return full_scan_triton.scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                 initial_state, discretization, initial_drive=initial_drive)


@backend.register("full_selective_state_update", "cuda", kernels=(), requires=_triton_missing)
def _full_selective_state_update_cuda(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                      discretization=DEFAULT, drive=None):
    from quamba.ops.scan import full_scan_triton
    return full_scan_triton.step(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                 discretization, drive)


def _step_lengths(u, delta, delta_bias, delta_softplus):
    """Δ in u's (compute) dtype: delta + delta_bias, through softplus if asked."""
    dt = delta.to(u.dtype)
    if delta_bias is not None:
        dt = dt + _per_channel(delta_bias, u)
    return F.softplus(dt) if delta_softplus else dt


def _step(decay, state, step_input):
    """h_t = Ā h_{t-1} + B̄u_t for matrices Ā [..., n, n] and vectors h, B̄u [..., n]."""
    return (decay @ state.unsqueeze(-1)).squeeze(-1) + step_input


def _output(y, u, D, z):
    """y + D u, gated by SiLU(z), in y's dtype."""
    if D is not None:
        y = y + u * _per_channel(D, u)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def _per_channel(values, u):
    """[d_inner] values shaped to broadcast against u [batch, d_inner(, seqlen)], in u's dtype."""
    return values.to(u.dtype).reshape(-1, *(1,) * (u.dim() - 2))


def _discretize(method, dt, A, drive, previous_drive):
    """(Ā [..., n, n], B̄u [..., n]) of ``method`` for steps ``dt`` [...], A [..., n, n] and
    drives v_t, v_{t-1} [..., n] (broadcasting over the leading dims)."""
    M = dt[..., None, None] * A
    return _DISCRETIZERS[method](dt.unsqueeze(-1), M, drive, previous_drive)


def _zoh(dt, M, drive, previous_drive):
    return torch.linalg.matrix_exp(M), dt * drive


def _zoh_exact(dt, M, drive, previous_drive):
    return _augmented_exp(M, [dt * drive])


def _foh(dt, M, drive, previous_drive):
    """Δ(φ1 - φ2)(M) v_{t-1} + Δ φ2(M) v_t = φ1(M) Δv_{t-1} + φ2(M) Δ(v_t - v_{t-1})."""
    return _augmented_exp(M, [dt * (drive - previous_drive), dt * previous_drive])


def _bilinear(dt, M, drive, previous_drive):
    n = M.shape[-1]
    eye = torch.eye(n, dtype=M.dtype, device=M.device)
    right_sides = torch.cat([(eye + M / 2).expand_as(M), (dt * drive).unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve(eye - M / 2, right_sides)
    return solved[..., :n], solved[..., n]


def _rk4(dt, M, drive, previous_drive):
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    gain = _RK4_GAIN[-1] * eye  # S(M) by Horner's rule
    for coefficient in reversed(_RK4_GAIN[:-1]):
        gain = M @ gain + coefficient * eye
    return eye + M @ gain, dt * (gain @ drive.unsqueeze(-1)).squeeze(-1)


def _augmented_exp(M, columns):
    """(expm(M), the last top-right column of expm(X)) for X = [[M, W], [0, J]], W [..., n, k]
    holding ``columns`` w_1..w_k and J the k × k shift (ones above the diagonal).

    expm(X)'s top-right block is Σ_{j≥1} Σ_{i+l=j-1} M^i W J^l / j!; as W J^l shifts W's columns
    right by l, its last column is Σ_l φ_{l+1}(M) w_{k-l}: φ1(M) w_1 for k = 1 (zoh-exact),
    φ1(M) w_2 + φ2(M) w_1 for k = 2 (foh). No inverse of A is needed (Van Loan, 1978)."""
    n, k = M.shape[-1], len(columns)
    augmented = M.new_zeros(*M.shape[:-2], n + k, n + k)
    augmented[..., :n, :n] = M
    augmented[..., :n, n:] = torch.stack(columns, dim=-1)
    for i in range(k - 1):
        augmented[..., n + i, n + i + 1] = 1
    exponential = torch.linalg.matrix_exp(augmented)
    return exponential[..., :n, :n], exponential[..., :n, -1]


_DISCRETIZERS = {"zoh": _zoh, "zoh-exact": _zoh_exact, "bilinear": _bilinear, "foh": _foh,
                 "rk4": _rk4}
