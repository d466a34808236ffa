"""The differentiable selective scan of Mamba1 (diagonal A) in Triton: a fused forward and a fused
backward, the cuda backend of :func:`quamba.ops.scan.trainable_scan.trainable_selective_scan`.

Forward: one program per (batch, block of ``block_d`` channels) walks the sequence in chunks of
``chunk`` steps. Inside a chunk the states h_t = Ā_t ⊙ h_{t-1} + B̄u_t of every channel and state
are one associative scan over time ([block_d, d_state, chunk] tiles; with time the last axis,
Triton lays a chunk's steps across a warp's lanes), started from the state carried in;
y_t = C_t · h_t (+ D u_t, ⊙ SiLU(z_t)) is written, and the state entering each chunk is kept in
a checkpoint tensor [batch, chunks, d_inner, d_state] (not all seqlen states).

Backward: the same programs walk the chunks from the last to the first. Each recomputes its
chunk's states from the checkpoint, then the adjoint g_t = ∂L/∂h_t = C_t dy_t + Ā_{t+1} g_{t+1} as
a reverse scan (step t holds step t + 1's Ā and C dy), carrying Ā g of the chunk's first step to
the chunk before. From g and h: dB̄u_t = g_t and dĀ_t = g_t ⊙ h_{t-1}, hence dΔ, dA, du, dB; dC
from h and dy. For zoh and zoh-exact (Ā = exp(Δa), so dĀ/dz · h_{t-1} = h_t − B̄u_t) the states
of the forward's own scan suffice; bilinear and rk4, whose Ā may vanish, get h_{t-1} from a
second scan over step t − 1's inputs. dB and dC, shared by all channels, are written per channel
block and summed in torch (deterministic, no atomics); dA, dD and dΔ-bias per batch likewise.

Everything runs in fp32 whatever the inputs' dtype. Every discretization of
quamba.ops.scan.discretization with Ā and B̄ functions of z = Δa alone is implemented (zoh,
zoh-exact, bilinear, rk4); foh, whose B̄u reads the previous step's drive too, is not.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# discretization → the kernels' METHOD code
METHODS = {"zoh": 0, "zoh-exact": 1, "bilinear": 2, "rk4": 3}
CHUNK = 32
# (channels per program, warps per program) of each pass when the caller names none
FORWARD_TILE = (2, 2)
BACKWARD_TILE = (2, 2)
# Bytes the backward's per-channel-block partial sums of dB and dC may take together; a larger
# problem gets wider channel blocks (fewer partials) than its tile asks for.
PARTIAL_BYTES = 2 << 30


@triton.jit
def _combine(decay_a, input_a, decay_b, input_b):
    # two steps h ↦ decay h + input, a's first
    return decay_a * decay_b, decay_b * input_a + input_b


@triton.jit
def _phi1(z):
    """(exp(z) - 1)/z and its derivative (exp(z)(z - 1) + 1)/z², by their series for |z| < 0.5
    (8 terms: relative error < 1e-8; the closed forms lose under 4 bits beyond)."""
    near = tl.abs(z) < 0.5
    safe = tl.where(near, 1.0, z)
    ez = tl.exp(safe)
    value_series = 1.0 + z * (1 / 2 + z * (1 / 6 + z * (1 / 24 + z * (1 / 120 + z * (
        1 / 720 + z * (1 / 5040 + z * (1 / 40320)))))))
    slope_series = 1 / 2 + z * (2 / 6 + z * (3 / 24 + z * (4 / 120 + z * (5 / 720 + z * (
        6 / 5040 + z * (7 / 40320 + z * (8 / 362880)))))))
    value = tl.where(near, value_series, (ez - 1.0) / safe)
    slope = tl.where(near, slope_series, (ez * (safe - 1.0) + 1.0) / (safe * safe))
    return value, slope


@triton.jit
def _coefficients(z, METHOD: tl.constexpr):
    """(Ā, G, dĀ/dz, dG/dz) at z = Δa, where B̄u_t = Δ G(z) u_t B_t."""
    if METHOD == 0:  # zoh
        decay = tl.exp(z)
        return decay, tl.full(z.shape, 1.0, tl.float32), decay, tl.zeros(z.shape, tl.float32)
    elif METHOD == 1:  # zoh-exact
        decay = tl.exp(z)
        gain, gain_slope = _phi1(z)
        return decay, gain, decay, gain_slope
    elif METHOD == 2:  # bilinear
        inverse = 1.0 / (1.0 - 0.5 * z)
        return (1.0 + 0.5 * z) * inverse, inverse, inverse * inverse, 0.5 * inverse * inverse
    else:  # rk4
        decay_slope = 1.0 + z * (1.0 + z * (1 / 2 + z * (1 / 6)))
        decay = 1.0 + z * (1.0 + z * (1 / 2 + z * (1 / 6 + z * (1 / 24))))
        gain = 1.0 + z * (1 / 2 + z * (1 / 6 + z * (1 / 24)))
        return decay, gain, decay_slope, 1 / 2 + z * (1 / 3 + z * (1 / 8))


@triton.jit
def _dt(delta, bias, SOFTPLUS: tl.constexpr):
    """(Δ, dΔ/d(delta)) of the raw delta plus its bias (softplus as PyTorch: identity above 20)."""
    x = delta + bias
    if SOFTPLUS:
        ex = tl.exp(tl.minimum(x, 20.0))
        return tl.where(x > 20.0, x, tl.log(1.0 + ex)), tl.where(x > 20.0, 1.0, ex / (1.0 + ex))
    return x, tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def _load_channels(ptr, row, t, mask):
    """[BLOCK_D, CHUNK] fp32 tile of a contiguous [batch, d_inner, seqlen] tensor at rows
    offsets ``row`` = (batch * d_inner + channel) * seqlen (0 where masked)."""
    return tl.load(ptr + row[:, None] + t[None, :], mask=mask, other=0).to(tl.float32)


@triton.jit
def _load_states(ptr, row, t, mask):
    """[BLOCK_N, CHUNK] fp32 tile of a contiguous [batch, d_state, seqlen] tensor at rows
    offsets ``row`` = (batch * d_state + state) * seqlen (0 where masked)."""
    return tl.load(ptr + row[:, None] + t[None, :], mask=mask, other=0).to(tl.float32)


@triton.jit
def _load_channel_vector(ptr, d, d_mask, PRESENT: tl.constexpr):
    """fp32 [BLOCK_D] of a per-channel parameter; zeros where it is absent."""
    if PRESENT:
        return tl.load(ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    return tl.zeros(d.shape, dtype=tl.float32)


@triton.jit
def _scan_forward_kernel(u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr,
                         y_ptr, last_state_ptr, checkpoint_ptr, d_inner, d_state, seqlen,
                         METHOD: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr,
                         HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    steps = tl.arange(0, CHUNK)
    d_mask, n_mask = d < d_inner, n < d_state
    state_mask = d_mask[:, None] & n_mask[None, :]
    A = tl.load(A_ptr + d[:, None] * d_state + n[None, :], mask=state_mask, other=0.0).to(tl.float32)
    D = _load_channel_vector(D_ptr, d, d_mask, HAS_D)
    bias = _load_channel_vector(bias_ptr, d, d_mask, HAS_BIAS)
    channel_row = (b * d_inner + d) * seqlen
    state_row = (b * d_state + n) * seqlen
    state_offsets = (b * d_inner + d[:, None]) * d_state + n[None, :]
    chunks = tl.cdiv(seqlen, CHUNK)
    state = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    for chunk in range(0, chunks):
        tl.store(checkpoint_ptr + (b * chunks + chunk) * d_inner * d_state + d[:, None] * d_state
                 + n[None, :], state, mask=state_mask)
        t = chunk * CHUNK + steps
        t_mask = t < seqlen
        mask = d_mask[:, None] & t_mask[None, :]
        dt, _ = _dt(_load_channels(delta_ptr, channel_row, t, mask), bias[:, None], SOFTPLUS)
        dt = tl.where(mask, dt, 0.0)  # a step past the end keeps the state: Ā = 1, B̄u = 0
        u = _load_channels(u_ptr, channel_row, t, mask)
        B = _load_states(B_ptr, state_row, t, n_mask[:, None] & t_mask[None, :])
        C = _load_states(C_ptr, state_row, t, n_mask[:, None] & t_mask[None, :])
        decay, gain, _, _ = _coefficients(dt[:, None, :] * A[:, :, None], METHOD)
        step_input = gain * (dt * u)[:, None, :] * B[None, :, :]
        decay_from_start, input_from_start = tl.associative_scan((decay, step_input), 2, _combine)
        states = decay_from_start * state[:, :, None] + input_from_start
        y = tl.sum(states * C[None, :, :], axis=1)
        if HAS_D:
            y += D[:, None] * u
        if HAS_Z:
            gate = _load_channels(z_ptr, channel_row, t, mask)
            y *= gate * tl.sigmoid(gate)
        tl.store(y_ptr + channel_row[:, None] + t[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        state = tl.sum(tl.where((steps == CHUNK - 1)[None, None, :], states, 0.0), axis=2)
    tl.store(last_state_ptr + state_offsets, state, mask=state_mask)


@triton.jit
def _previous_states(delta_ptr, u_ptr, B_ptr, entering, A, bias, channel_row, state_row, t,
                     t_mask, d_mask, n_mask, steps, METHOD: tl.constexpr, SOFTPLUS: tl.constexpr):
    """h_{t-1} over a chunk's steps t: a scan over step t - 1's inputs (loaded shifted), started
    from the state entering the chunk. For the discretizations whose Ā can vanish (bilinear,
    rk4), where h_{t-1} cannot be recovered from h_t."""
    previous = t - 1
    shifted = t_mask & (steps > 0)
    p_mask = d_mask[:, None] & shifted[None, :]
    dt_p, _ = _dt(_load_channels(delta_ptr, channel_row, previous, p_mask), bias[:, None],
                  SOFTPLUS)
    dt_p = tl.where(p_mask, dt_p, 0.0)
    u_p = _load_channels(u_ptr, channel_row, previous, p_mask)
    B_p = _load_states(B_ptr, state_row, previous, n_mask[:, None] & shifted[None, :])
    decay_p, gain_p, _, _ = _coefficients(dt_p[:, None, :] * A[:, :, None], METHOD)
    first = (steps == 0)[None, None, :]
    _, before = tl.associative_scan(
        (tl.where(first, 0.0, decay_p),
         tl.where(first, entering[:, :, None], gain_p * (dt_p * u_p)[:, None, :] * B_p[None, :, :])),
        2, _combine)
    return before


@triton.jit
def _output_grad(dout_ptr, z_ptr, channel_row, t, mask, HAS_Z: tl.constexpr):
    """(dL/dy before the gate, the gate's SiLU slope, z): dy = dout ⊙ SiLU(z)."""
    dout = _load_channels(dout_ptr, channel_row, t, mask)
    if HAS_Z:
        gate = _load_channels(z_ptr, channel_row, t, mask)
        sig = tl.sigmoid(gate)
        return dout * gate * sig, sig * (1.0 + gate * (1.0 - sig)), dout
    return dout, dout, dout


@triton.jit
def _scan_backward_kernel(u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr,
                          dout_ptr, dlast_ptr, checkpoint_ptr,
                          du_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dbias_ptr,
                          d_inner, d_state, seqlen,
                          METHOD: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr,
                          HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DLAST: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    steps = tl.arange(0, CHUNK)
    d_mask, n_mask = d < d_inner, n < d_state
    state_mask = d_mask[:, None] & n_mask[None, :]
    A = tl.load(A_ptr + d[:, None] * d_state + n[None, :], mask=state_mask, other=0.0).to(tl.float32)
    D = _load_channel_vector(D_ptr, d, d_mask, HAS_D)
    bias = _load_channel_vector(bias_ptr, d, d_mask, HAS_BIAS)
    channel_row = (b * d_inner + d) * seqlen
    state_row = (b * d_state + n) * seqlen
    state_offsets = (b * d_inner + d[:, None]) * d_state + n[None, :]
    # dB and dC of this channel block: [channel blocks, batch, d_state, seqlen]
    partial_row = tl.program_id(1) * tl.num_programs(0) * d_state * seqlen + state_row
    chunks = tl.cdiv(seqlen, CHUNK)
    first = (steps == 0)[None, None, :]
    # ∂L/∂h flowing into the last step of the chunk from later steps (the last state's gradient)
    if HAS_DLAST:
        carry = tl.load(dlast_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dA = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dD = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for back in range(0, chunks):
        chunk = chunks - 1 - back
        t = chunk * CHUNK + steps
        t_mask = t < seqlen
        mask = d_mask[:, None] & t_mask[None, :]
        state_time_mask = n_mask[:, None] & t_mask[None, :]
        # step t
        dt, dt_slope = _dt(_load_channels(delta_ptr, channel_row, t, mask), bias[:, None], SOFTPLUS)
        dt = tl.where(mask, dt, 0.0)
        u = _load_channels(u_ptr, channel_row, t, mask)
        B = _load_states(B_ptr, state_row, t, state_time_mask)
        C = _load_states(C_ptr, state_row, t, state_time_mask)
        decay, gain, decay_slope, gain_slope = _coefficients(dt[:, None, :] * A[:, :, None], METHOD)
        drive = u[:, None, :] * B[None, :, :]
        step_input = gain * dt[:, None, :] * drive
        entering = tl.load(checkpoint_ptr + (b * chunks + chunk) * d_inner * d_state
                           + d[:, None] * d_state + n[None, :], mask=state_mask, other=0.0)
        if METHOD <= 1:
            # Ā = exp(z), so dĀ/dz h_{t-1} = Ā_t h_{t-1} = h_t - B̄u_t: the states of the
            # forward's own scan suffice
            decay_from_start, input_from_start = tl.associative_scan((decay, step_input), 2,
                                                                     _combine)
            states = decay_from_start * entering[:, :, None] + input_from_start
            grad_decay_factor = states - step_input
        else:
            before = _previous_states(delta_ptr, u_ptr, B_ptr, entering, A, bias, channel_row,
                                      state_row, t, t_mask, d_mask, n_mask, steps, METHOD,
                                      SOFTPLUS)
            states = decay * before + step_input
            grad_decay_factor = before * decay_slope
        dy, gate_slope, dout = _output_grad(dout_ptr, z_ptr, channel_row, t, mask, HAS_Z)
        # g_t = C_t dy_t + q_t, q_t = Ā_{t+1} g_{t+1}: a reverse scan over step t + 1's Ā and C dy
        following = t + 1
        f_mask = d_mask[:, None] & (following < seqlen)[None, :]
        dt_f, _ = _dt(_load_channels(delta_ptr, channel_row, following, f_mask), bias[:, None],
                      SOFTPLUS)
        decay_f, _, _, _ = _coefficients(dt_f[:, None, :] * A[:, :, None], METHOD)
        C_f = _load_states(C_ptr, state_row, following,
                           n_mask[:, None] & (following < seqlen)[None, :])
        dy_f, _, _ = _output_grad(dout_ptr, z_ptr, channel_row, following, f_mask, HAS_Z)
        last = ((steps == CHUNK - 1) | (t == seqlen - 1))[None, None, :]
        _, later = tl.associative_scan(
            (tl.where(last, 0.0, decay_f),
             tl.where(last, carry[:, :, None], decay_f * dy_f[:, None, :] * C_f[None, :, :])),
            2, _combine, reverse=True)
        grad = tl.where(mask[:, None, :], dy[:, None, :] * C[None, :, :] + later, 0.0)
        carry = tl.sum(tl.where(first, decay * grad, 0.0), axis=2)
        # dĀ_t = g_t h_{t-1}, dB̄u_t = g_t; Ā and B̄ are functions of z = Δ a
        grad_z = grad * grad_decay_factor
        if METHOD != 0:
            grad_z += grad * dt[:, None, :] * gain_slope * drive
        ddt = tl.sum(grad_z * A[:, :, None] + grad * gain * drive, axis=1)
        dA += tl.sum(grad_z * dt[:, None, :], axis=2)
        grad_drive = grad * gain * dt[:, None, :]
        du = tl.sum(grad_drive * B[None, :, :], axis=1)
        tl.store(dB_ptr + partial_row[:, None] + t[None, :],
                 tl.sum(grad_drive * u[:, None, :], axis=0), mask=state_time_mask)
        tl.store(dC_ptr + partial_row[:, None] + t[None, :],
                 tl.sum(states * dy[:, None, :], axis=0), mask=state_time_mask)
        if HAS_D:
            du += dy * D[:, None]
            dD += tl.sum(dy * u, axis=1)
        if HAS_Z:
            y = tl.sum(states * C[None, :, :], axis=1)
            if HAS_D:
                y += D[:, None] * u
            tl.store(dz_ptr + channel_row[:, None] + t[None, :],
                     (dout * y * gate_slope).to(dz_ptr.dtype.element_ty), mask=mask)
        ddelta = ddt * dt_slope
        dbias += tl.sum(tl.where(mask, ddelta, 0.0), axis=1)
        tl.store(du_ptr + channel_row[:, None] + t[None, :], du.to(du_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(ddelta_ptr + channel_row[:, None] + t[None, :],
                 ddelta.to(ddelta_ptr.dtype.element_ty), mask=mask)
    tl.store(dA_ptr + state_offsets, dA, mask=state_mask)
    tl.store(dD_ptr + b * d_inner + d, dD, mask=d_mask)
    tl.store(dbias_ptr + b * d_inner + d, dbias, mask=d_mask)


def _contiguous(t):
    return None if t is None else t.contiguous()


def _launch_options(u, A, chunk, tile):
    batch, d_inner, seqlen = u.shape
    d_state = A.shape[1]
    block_d, num_warps = tile
    grid = (batch, triton.cdiv(d_inner, block_d))
    return grid, dict(d_inner=d_inner, d_state=d_state, seqlen=seqlen, CHUNK=chunk,
                      BLOCK_D=block_d, BLOCK_N=max(2, triton.next_power_of_2(d_state)),
                      num_warps=num_warps)


class _SelectiveScan(torch.autograd.Function):
    """(y, last_state) of the scan on the fused kernels, with their fused backward."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, method, chunk,
                forward_tile, backward_tile):
        u, delta, A, B, C, D, z, delta_bias = (_contiguous(t) for t in (u, delta, A, B, C, D, z,
                                                                          delta_bias))
        grid, sizes = _launch_options(u, A, chunk, forward_tile)
        batch, d_inner, seqlen = u.shape
        y = torch.empty_like(u)
        last_state = u.new_empty(batch, d_inner, A.shape[1], dtype=torch.float32)
        checkpoint = u.new_empty(batch, triton.cdiv(seqlen, chunk), d_inner, A.shape[1],
                                 dtype=torch.float32)
        _scan_forward_kernel[grid](
            u, delta, A, B, C, _or(D, u), _or(z, u), _or(delta_bias, u), y, last_state,
            checkpoint, METHOD=METHODS[method], SOFTPLUS=delta_softplus, HAS_D=D is not None,
            HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, **sizes)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, checkpoint)
        ctx.options = (delta_softplus, method, chunk, backward_tile)
        return y, last_state

    @staticmethod
    def backward(ctx, dy, dlast_state):
        u, delta, A, B, C, D, z, delta_bias, checkpoint = ctx.saved_tensors
        delta_softplus, method, chunk, backward_tile = ctx.options
        grid, sizes = _launch_options(u, A, chunk, partial_capped(backward_tile, *u.shape,
                                                                  A.shape[1]))
        batch, d_inner, seqlen = u.shape
        d_state = A.shape[1]
        dy = torch.zeros_like(u) if dy is None else dy.contiguous()
        fp32 = dict(dtype=torch.float32, device=u.device)
        du, ddelta = torch.empty_like(u), torch.empty_like(delta)  # stored in the inputs' dtypes
        dz = torch.empty_like(z) if z is not None else None
        dB, dC = (torch.empty(grid[1], batch, d_state, seqlen, **fp32) for _ in range(2))
        dA = torch.empty(batch, d_inner, d_state, **fp32)
        dD, dbias = torch.empty(batch, d_inner, **fp32), torch.empty(batch, d_inner, **fp32)
        _scan_backward_kernel[grid](
            u, delta, A, B, C, _or(D, u), _or(z, u), _or(delta_bias, u), dy,
            _or(_contiguous(dlast_state), u), checkpoint, du, ddelta, _or(dz, du), dB, dC, dA,
            dD, dbias, METHOD=METHODS[method], SOFTPLUS=delta_softplus, HAS_D=D is not None,
            HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            HAS_DLAST=dlast_state is not None, **sizes)
        grads = (du, ddelta, dA.sum(0).to(A.dtype), dB.sum(0).to(B.dtype), dC.sum(0).to(C.dtype),
                 None if D is None else dD.sum(0).to(D.dtype), dz,
                 None if delta_bias is None else dbias.sum(0).to(delta_bias.dtype))
        return grads + (None, None, None, None, None)


def partial_capped(tile, batch, d_inner, seqlen, d_state):
    """``tile`` (block_d, num_warps) with block_d doubled until the backward's fp32 partial sums of
    dB and dC, [2, d_inner / block_d, batch, d_state, seqlen], fit PARTIAL_BYTES."""
    block_d, num_warps = tile
    while (block_d < d_inner
           and 2 * triton.cdiv(d_inner, block_d) * batch * d_state * seqlen * 4 > PARTIAL_BYTES):
        block_d *= 2
    return block_d, num_warps


def _or(t, placeholder):
    """``t``, or a tensor standing in for an absent one (the kernel reads none of it)."""
    return placeholder if t is None else t


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   discretization="zoh", chunk=CHUNK, block_d=None, num_warps=None):
    """(y in u's dtype, last_state fp32 [batch, d_inner, d_state]) as the reference
    quamba.ops.scan.selective_scan computes them, differentiable through the fused backward with
    respect to every tensor (and last_state's gradient). ``chunk``: steps per scan tile and
    between checkpointed states; ``block_d``: channels per program and ``num_warps``: warps per
    program (powers of two), for both passes; None: each pass's own (FORWARD_TILE,
    BACKWARD_TILE)."""
    if discretization not in METHODS:
        raise ValueError(f"the fused scan implements {', '.join(METHODS)}, not {discretization!r}")
    for value, name in ((chunk, "chunk"), (block_d, "block_d"), (num_warps, "num_warps")):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two, got {value}")
    forward_tile, backward_tile = ((block_d or default[0], num_warps or default[1])
                                   for default in (FORWARD_TILE, BACKWARD_TILE))
    return _SelectiveScan.apply(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus),
                                discretization, chunk, forward_tile, backward_tile)
