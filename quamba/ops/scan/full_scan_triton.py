"""The full-A selective scan (quamba.ops.scan.full_scan) on the GPU, in Triton, for d_state ≤ 16.

One program (one warp) per (batch, pair of channels) walks the sequence; per channel it keeps h
(a d_state vector, padded to 16) and A_d (16 × 16, with its transpose) in registers. No matrix exponential
is ever formed: every method is a series of matrix-vector products acting on a vector.

A step of length Δ is cut into s sub-steps of τ = Δ / s, X = τ A_d, and each sub-step is

    h ← h + φ1(X) w + φ2(X) e        (φ1(X) = Σ_k X^k / (k + 1)!,  φ2(X) = Σ_k X^k / (k + 2)!)

with w = X h + τ c and e the drive's change over the sub-step, which is expm(X) h plus the exact
response to a drive c + (e / τ)(r / τ) linear in the time r inside the sub-step. So

    zoh        c = 0, e = 0, and Δ v_t added after the sub-steps (Euler on B, as mamba_ssm)
    zoh-exact  c = v_t, e = 0
    foh        c = v_{t-1} + (j / s)(v_t - v_{t-1}) on sub-step j, e = τ (v_t - v_{t-1}) / s
    rk4        s = 1, c = v_t, e = 0 and the series cut after X³ (it is S(M)(M h + Δ v_t))

The series (Horner, one product per term) is cut after X^m; s is chosen per step and channel
block from Δ ||A_d||∞ (the norm hoisted out of the time loop) so that ||X|| ≤ ``THETA``, and m
(5, 8 or ``TERMS``) from ||X|| so that the first term dropped, X^(m+1) w / (m+2)! with w ≈ X h,
is below fp32's rounding of h. Splitting the step is exact
for these methods (expm(τA)^s = expm(ΔA)). bilinear solves (I - M/2) x = M h + Δ v_t per step by
Gauss-Jordan elimination with partial pivoting, h ← h + x.

Matrix-vector products are broadcast-multiply-sums (d_state 16 is below what tl.dot profits
from); they alternate between A (summing its rows) and Aᵀ (summing its columns) so that one
product's output is the next one's input without a layout conversion.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# a channel's d_state × d_state A is held in registers, zero-padded to this tile (full_scan.py's
# KERNEL_MAX_D_STATE, the largest d_state the dispatch sends here, is the same number)
D_STATE_TILE = 16

# The series' length and the sub-step norm bound: the first term dropped, X^13 w / 14! with
# w = X h, is under 2^-24 ||h|| for ||X|| ≤ 1.8. Sub-steps
# of a smaller norm take shorter series (_phi_series_for), as Mamba's small Δ mostly gives.
TERMS = 12
THETA = 1.8
RK4_TERMS = tl.constexpr(3)  # a global a kernel reads must be a constexpr
METHOD_IDS = {"zoh": 0, "zoh-exact": 1, "foh": 2, "rk4": 3, "bilinear": 4}
# One warp per program, two channels: the products' sums stay inside the warp (shuffles, no shared
# memory), and batch * d_inner / 2 programs fill the GPU. On an H100 (zoh, d_state 16, L 1024)
# this ran 3-4x faster than 4 channels on 4 warps; 1 to 4 channels on one warp were within 1.4x.
BLOCK_D = 2
NUM_WARPS = 1


@triton.jit
def _softplus(x):
    # PyTorch's softplus: x above 20, else log1p(exp(x))
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _mv_rows(A, r):
    """A r for A [D, N, N] (A[d, i, j]) and r [D, N] entering along axis 2."""
    return tl.sum(A * r[:, None, :], axis=2)


@triton.jit
def _mv_cols(At, r):
    """A r for At [D, N, N] = Aᵀ (At[d, j, i] = A[d, i, j]) and r [D, N] entering along axis 1."""
    return tl.sum(At * r[:, :, None], axis=1)


@triton.jit
def _phi_series(A, At, tau, w, e, TERMS_: tl.constexpr, HAS_E: tl.constexpr):
    """φ1(X) w + φ2(X) e with X = τ A (τ [D] per channel), cut after X^TERMS_, by Horner:
    r_k = q_k + X r_{k+1} / (k + 2) with q_k = w + e / (k + 2), r_0 the result."""
    r = w
    if HAS_E:
        r = w + e / (TERMS_ + 2)
    for step in tl.static_range(TERMS_):  # k = TERMS_ - 1 - step, dividing by k + 2
        if step % 2 == 0:
            product = _mv_cols(At, r)
        else:
            product = _mv_rows(A, r)
        r = w + tau[:, None] * product / (TERMS_ + 1 - step)
        if HAS_E:
            r = r + e / (TERMS_ + 1 - step)
    return r


@triton.jit
def _phi_series_for(A, At, tau, w, e, reach, TERMS_: tl.constexpr, HAS_E: tl.constexpr):
    """:func:`_phi_series` as long as the channel block's sub-step norm bound ``reach`` needs:
    5 products below 0.3, 8 below 0.85 (||X||^(m+2) / (m+2)! stays under 2^-24), else TERMS_."""
    if reach <= 0.3:
        r = _phi_series(A, At, tau, w, e, 5, HAS_E)
    elif reach <= 0.85:
        r = _phi_series(A, At, tau, w, e, 8, HAS_E)
    else:
        r = _phi_series(A, At, tau, w, e, TERMS_, HAS_E)
    return r


@triton.jit
def _bilinear_increment(A, dt, w, BLOCK_N: tl.constexpr):
    """x solving (I - Δ A / 2) x = w per channel, by Gauss-Jordan elimination with partial
    pivoting: each column's pivot is its largest entry in a row not pivoted yet; rows are not
    swapped, so the reduced matrix ends a permutation P (exactly: pivot rows are divided by
    their pivot, other rows lose pivot-row multiples that zero the column) and x = Pᵀ rhs.
    The zero padding of A leaves identity rows and columns, which pivot on themselves."""
    index = tl.arange(0, BLOCK_N)
    cols = index[None, None, :]
    matrix = (index[None, :, None] == cols).to(tl.float32) - dt[:, None, None] * A / 2
    rhs = w
    used = tl.zeros_like(w)
    for c in tl.static_range(BLOCK_N):
        column = tl.sum(tl.where(cols == c, matrix, 0.0), axis=2)  # [D, rows]
        pivot = tl.argmax(tl.where(used == 0, tl.abs(column), -1.0), axis=1)  # [D]
        is_pivot = index[None, :] == pivot[:, None]  # [D, rows]
        pivot_value = tl.sum(tl.where(is_pivot, column, 0.0), axis=1)
        pivot_row = tl.sum(tl.where(is_pivot[:, :, None], matrix, 0.0), axis=1) / pivot_value[:, None]
        pivot_rhs = tl.sum(tl.where(is_pivot, rhs, 0.0), axis=1) / pivot_value
        factor = tl.where(is_pivot, 0.0, column)
        matrix = tl.where(is_pivot[:, :, None], pivot_row[:, None, :],
                          matrix - factor[:, :, None] * pivot_row[:, None, :])
        rhs = tl.where(is_pivot, pivot_rhs[:, None], rhs - factor * pivot_rhs[:, None])
        used = tl.where(is_pivot, 1.0, used)
    return tl.sum(matrix * rhs[:, :, None], axis=1)


@triton.jit
def _full_scan_kernel(u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, y_ptr,
                      state_ptr, initial_state_ptr, initial_drive_ptr, last_drive_ptr,
                      d_inner, d_state, seqlen,
                      su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
                      sB_b, sB_n, sB_l, sC_b, sC_n, sC_l, sy_b, sy_d, sy_l,
                      METHOD: tl.constexpr, TERMS_: tl.constexpr, THETA_: tl.constexpr,
                      BLOCK_D_: tl.constexpr, BLOCK_N: tl.constexpr, SOFTPLUS: tl.constexpr,
                      HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_INITIAL_STATE: tl.constexpr, HAS_INITIAL_DRIVE: tl.constexpr,
                      WRITE_DRIVE: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D_ + tl.arange(0, BLOCK_D_)
    n = tl.arange(0, BLOCK_N)
    d_mask, n_mask = d < d_inner, n < d_state
    # A[d, i, j] and its transpose, zero-padded to BLOCK_N
    i3 = tl.arange(0, BLOCK_N)[None, :, None]
    j3 = tl.arange(0, BLOCK_N)[None, None, :]
    d3 = d[:, None, None]
    A_mask = (d3 < d_inner) & (i3 < d_state) & (j3 < d_state)
    A = tl.load(A_ptr + (d3 * d_state + i3) * d_state + j3, mask=A_mask, other=0.0)
    At = tl.load(A_ptr + (d3 * d_state + j3) * d_state + i3, mask=A_mask, other=0.0)
    norm = tl.max(tl.sum(tl.abs(A), axis=2), axis=1)  # ||A_d||∞ [D]
    vec_mask = d_mask[:, None] & n_mask[None, :]
    vec_offsets = (b * d_inner + d[:, None]) * d_state + n[None, :]
    if HAS_INITIAL_STATE:
        h = tl.load(initial_state_ptr + vec_offsets, mask=vec_mask, other=0.0)
    else:
        h = tl.zeros((BLOCK_D_, BLOCK_N), dtype=tl.float32)
    if HAS_INITIAL_DRIVE:
        v_prev = tl.load(initial_drive_ptr + vec_offsets, mask=vec_mask, other=0.0)
    else:
        v_prev = tl.zeros((BLOCK_D_, BLOCK_N), dtype=tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + d, mask=d_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_mask, other=0.0)
    v = v_prev
    for t in range(seqlen):
        u = tl.load(u_ptr + b * su_b + d * su_d + t * su_l, mask=d_mask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + b * sdt_b + d * sdt_d + t * sdt_l, mask=d_mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt += bias
        if SOFTPLUS:
            dt = _softplus(dt)
        dt = tl.where(d_mask, dt, 0.0)
        B = tl.load(B_ptr + b * sB_b + n * sB_n + t * sB_l, mask=n_mask, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + b * sC_b + n * sC_n + t * sC_l, mask=n_mask, other=0.0).to(tl.float32)
        v = u[:, None] * B[None, :]
        if METHOD == 4:  # bilinear
            w = dt[:, None] * (_mv_rows(A, h) + v)
            h = h + _bilinear_increment(A, dt, w, BLOCK_N)
        elif METHOD == 3:  # rk4
            w = dt[:, None] * (_mv_rows(A, h) + v)
            h = h + _phi_series(A, At, dt, w, w, RK4_TERMS, False)
        else:
            reach = tl.max(dt * norm, axis=0)  # ≥ ||Δ A_d|| over the block
            substeps = tl.maximum(tl.ceil(reach / THETA_), 1.0)
            reach = reach / substeps
            tau = dt / substeps
            for j in range(substeps.to(tl.int32)):
                if METHOD == 0:  # zoh: expm(X) h, the input added after
                    w = tau[:, None] * _mv_rows(A, h)
                    h = h + _phi_series_for(A, At, tau, w, w, reach, TERMS_, False)
                elif METHOD == 1:  # zoh-exact
                    w = tau[:, None] * (_mv_rows(A, h) + v)
                    h = h + _phi_series_for(A, At, tau, w, w, reach, TERMS_, False)
                else:  # foh: the drive moves linearly from v_{t-1} to v_t over the step
                    slope = (v - v_prev) / substeps
                    start = v_prev + j * slope
                    w = tau[:, None] * (_mv_rows(A, h) + start)
                    h = h + _phi_series_for(A, At, tau, w, tau[:, None] * slope, reach, TERMS_, True)
            if METHOD == 0:
                h = h + dt[:, None] * v
        v_prev = v
        y = tl.sum(h * C[None, :], axis=1)
        if HAS_D:
            y += D * u
        if HAS_Z:
            z = tl.load(z_ptr + b * sz_b + d * sz_d + t * sz_l, mask=d_mask, other=0.0).to(tl.float32)
            y = y * z / (1.0 + tl.exp(-z))
        tl.store(y_ptr + b * sy_b + d * sy_d + t * sy_l, y.to(y_ptr.dtype.element_ty), mask=d_mask)
    tl.store(state_ptr + vec_offsets, h, mask=vec_mask)
    if WRITE_DRIVE:
        tl.store(last_drive_ptr + vec_offsets, v, mask=vec_mask)


def _fp32(t, fallback):
    """``t`` as contiguous fp32, or ``fallback`` standing in for an absent input (never read)."""
    return fallback if t is None else t.float().contiguous()


def scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, method,
         initial_drive=None, last_drive=None, state_out=None):
    """(y [batch, d_inner, seqlen] in u's dtype, last state fp32 [batch, d_inner, d_state]) of the
    kernel; layouts as quamba.ops.scan.full_scan's. ``last_drive`` (fp32 contiguous [batch, d_inner,
    d_state]) receives the last step's v = u ⊗ B; the state goes to ``state_out`` where given."""
    batch, d_inner, seqlen = u.shape
    d_state = A.shape[-1]
    y = torch.empty_like(u)
    state = state_out if state_out is not None else torch.empty(
        batch, d_inner, d_state, dtype=torch.float32, device=u.device)
    z_arg = z if z is not None else u
    grid = (batch, triton.cdiv(d_inner, BLOCK_D))
    _full_scan_kernel[grid](
        u, delta, _fp32(A, None), B, C, _fp32(D, y), z_arg, _fp32(delta_bias, y), y, state,
        _fp32(initial_state, state), _fp32(initial_drive, state),
        state if last_drive is None else last_drive, d_inner, d_state, seqlen,
        *u.stride(), *delta.stride(), *z_arg.stride(), *B.stride(), *C.stride(), *y.stride(),
        METHOD=METHOD_IDS[method], TERMS_=TERMS, THETA_=THETA, BLOCK_D_=BLOCK_D,
        BLOCK_N=D_STATE_TILE, SOFTPLUS=bool(delta_softplus), HAS_D=D is not None,
        HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        HAS_INITIAL_STATE=initial_state is not None, HAS_INITIAL_DRIVE=initial_drive is not None,
        WRITE_DRIVE=last_drive is not None, num_warps=NUM_WARPS)
    return y, state


def step(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus, method, drive=None):
    """One decode step (the scan of one time step): ``state`` (fp32 [batch, d_inner, d_state])
    and, for foh, ``drive`` updated in place; returns y [batch, d_inner] in u's dtype."""
    state_out = _in_place(state)
    drive_out = None if drive is None else _in_place(drive)
    y, _ = scan(u[..., None], delta[..., None], A, B[..., None], C[..., None], D,
                None if z is None else z[..., None], delta_bias, delta_softplus, state, method,
                initial_drive=drive, last_drive=drive_out, state_out=state_out)
    for target, written in ((state, state_out), (drive, drive_out)):
        if target is not None and written is not target:
            target.copy_(written)
    return y[..., 0]


def _in_place(t):
    """``t`` where the kernel can write it directly (fp32, contiguous), else a buffer for it."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=torch.float32, device=t.device)
