"""The cuda backend of ``qmixer_ssm_step`` (quamba.ops.fused_decode.mixer_step): a quantized Mamba1
mixer's SSM side at decode in two Triton kernels.

1. conv + x_proj, one program per (block of d_inner channels, block of batch rows): rolls its
   channels' conv state, computes conv + bias + SiLU → u codes (written: the scan reads them),
   and its K slice's share of x_proj for every output (dt_rank + 2 d_state of them), written to
   a split-K buffer of int32 partial sums [K blocks, batch, outputs]. W4A8's 4-bit codes times
   their group multipliers are int8 weights (quamba.ops.quant4), so both recipes' partial sums
   are exact integers; x_proj's reduction over all of d_inner is what needs the second kernel.
2. dt_proj + scan step, one program per (block of channels, block of rows): adds the partial
   sums of the x_proj outputs it needs (all of dt_low, B and C: every program does) in K-block
   order, applies x_proj's W8A8 epilogue (one multiplier, or W4A8's one per output channel),
   runs dt_proj for its channels (int8 × int8 → int32, epilogue to dt codes) and the zoh state
   update of its channels, and writes y gated by SiLU(z), adding C · h in the order of the
   QSScan step (quamba.ops.scan.selective_scan.state_readout).

No atomics, no synchronization between programs: integer sums make every result independent of
the schedule. The arithmetic is the torch reference's operation by operation (quamba.ops.quant's
rounding rule: round half to even of x · fp32(1/scale), saturated to ±127, nothing contracted
into an FMA: the kernels are compiled with fp fusion off), so that the integer outputs match the
chain of reference ops to one int8 step and y to the scan's tolerance. On a GPU exp and log1p are
libdevice's (the CUDA kernels' expf and log1pf) and the state's decay is ex2.approx (as the CUDA
step's), so every output equals the chain of CUDA ops' bit for bit
(tests/ops/test_cuda_fused_decode.py); under Triton's interpreter exp is numpy's.

Tiles: at most 8 batch rows per program (decode's batch 1-8 is one row block; larger batches take
more, each reading the weights again), and tiles of at most TILE elements. The
block sizes are first choices for Mamba-2.8B's shapes (d_inner 5120: 20 conv programs, 80 scan
programs) not yet tuned on a GPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from quamba.ops import backend
from quamba.ops.constants import cached
from quamba.ops.fused_decode.weights import W4A8Weight
from quamba.ops.quant import fp32_multiplier, fp32_reciprocal, fp32_value, requant_multiplier
from quamba.ops.quant_triton import int8_code_values, int8_codes

MAX_ROWS = 8  # batch rows per program
# Elements of a program's largest tile (the conv's [rows, channels, 4] window, a broadcast
# product, the scan's [rows, channels, d_state] state): 32 per thread with 8 warps. Compiled for
# sm_90 at Mamba-2.8B's shapes, batch 1 to 8, no kernel spills registers (at most ~205 used);
# with 4 warps both spilled at batch 8.
TILE = 8192
NUM_WARPS = 8
CONV_CHANNELS = 128  # d_inner channels per conv + x_proj program (x_proj's K slice)
SCAN_CHANNELS = 64  # d_inner channels per dt_proj + scan program



@triton.jit
def _dependent_launch(PDL: tl.constexpr):
    """Under programmatic dependent launch (csrc/pdl.cuh): wait until the kernel before has
    finished and its writes are visible, then let the next kernel's programs launch, so that
    each boundary of the decode step costs no launch latency."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        result = libdevice.exp(x)
    else:
        result = tl.exp(x)
    return result


@triton.jit
def _decay(z, LIBDEVICE: tl.constexpr):
    """zoh's exp(z) as the CUDA step computes it (csrc/qsscan/scan_step.cuh): ex2.approx of
    z · log2 e, flushing subnormals."""
    scaled = z * 1.4426950408889634
    if LIBDEVICE:
        result = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [scaled],
                                           dtype=tl.float32, is_pure=True, pack=1)
    else:
        result = tl.exp2(scaled)
    return result


@triton.jit
def _log1p(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        result = libdevice.log1p(x)
    else:
        # log(w) · x / (w - 1) with w = 1 + x rounded: accurate where log(1 + x) is not (tiny x)
        w = 1.0 + x
        result = tl.where(w == 1.0, x, tl.log(w) * x / (w - 1.0))
    return result


@triton.jit
def _softplus(x, LIBDEVICE: tl.constexpr):
    # PyTorch's softplus: x above 20, else log1p(exp(x))
    return tl.where(x > 20.0, x, _log1p(_exp(tl.minimum(x, 20.0), LIBDEVICE), LIBDEVICE))


@triton.jit
def _silu(y, LIBDEVICE: tl.constexpr):
    # y / (1 + exp(-y)), each operation rounded, as quamba.ops.conv.qconv1d.silu and the CUDA
    # kernels
    return tl.math.div_rn(y, 1.0 + _exp(-y, LIBDEVICE))


@triton.jit
def _conv_step(x_ptr, sx_b, sx_d, conv_state_ptr, weight_ptr, bias_ptr, m, k, mask, d_inner,
               multiplier, bias_scale, u_inverse, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
               LIBDEVICE: tl.constexpr):
    """u codes (int32 [rows, channels], zero outside ``mask``) of one conv step; the conv state
    (oldest input first) rolled in place."""
    taps = tl.arange(0, 4)  # the widest conv's window (KERNEL_WIDTHS)
    tap = taps[None, None, :]
    channel = m[:, None, None] * d_inner + k[None, :, None]
    state_ptrs = conv_state_ptr + channel * (WIDTH - 1) + tap
    window = tl.load(state_ptrs, mask=mask[:, :, None] & (tap < WIDTH - 1), other=0).to(tl.int32)
    x = tl.load(x_ptr + m[:, None] * sx_b + k[None, :] * sx_d, mask=mask, other=0).to(tl.int32)
    window = tl.where(tap == WIDTH - 1, x[:, :, None], window)
    weight = tl.load(weight_ptr + k[:, None] * WIDTH + taps[None, :],
                     mask=(k < d_inner)[:, None] & (taps < WIDTH)[None, :], other=0).to(tl.int32)
    acc = tl.sum(window * weight[None, :, :], axis=2)
    tl.debug_barrier()  # the state is read by all threads before any of them overwrites it
    tl.store(state_ptrs - 1, window.to(tl.int8),
             mask=mask[:, :, None] & (tap >= 1) & (tap < WIDTH))
    y = acc.to(tl.float32) * multiplier
    if HAS_BIAS:
        bias = tl.load(bias_ptr + k, mask=k < d_inner, other=0).to(tl.float32) * bias_scale
        y = y + bias[None, :]
    codes = int8_code_values(_silu(y, LIBDEVICE), u_inverse)
    return tl.where(mask, codes, 0.0).to(tl.int32)


@triton.jit
def _int4_weights(packed_ptr, group_multiplier_ptr, j, k, mask, d_inner, group_size):
    """int32 [outputs, channels] of W4A8's int8 weights: 4-bit code · group multiplier."""
    byte = tl.load(packed_ptr + j[:, None] * (d_inner // 2) + (k // 2)[None, :], mask=mask,
                   other=0).to(tl.int32)
    nibble = (byte >> ((k % 2) * 4)[None, :]) & 15
    code = tl.where(nibble >= 8, nibble - 16, nibble)
    multiplier = tl.load(group_multiplier_ptr + j[:, None] * (d_inner // group_size)
                         + (k // group_size)[None, :], mask=mask, other=0).to(tl.int32)
    return code * multiplier


@triton.jit
def _conv_x_proj_kernel(x_ptr, sx_b, sx_d, conv_state_ptr, conv_weight_ptr, conv_bias_ptr, u_ptr,
                        x_proj_ptr, group_multiplier_ptr, partial_ptr, batch, d_inner,
                        group_size, conv_multiplier, bias_scale, u_inverse, N_OUT: tl.constexpr,
                        WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, INT4: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
                        LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    _dependent_launch(PDL)
    k_block = tl.program_id(0)
    k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = m < batch
    mask = row_mask[:, None] & (k < d_inner)[None, :]
    u = _conv_step(x_ptr, sx_b, sx_d, conv_state_ptr, conv_weight_ptr, conv_bias_ptr, m, k, mask,
                   d_inner, conv_multiplier, bias_scale, u_inverse, WIDTH, HAS_BIAS, LIBDEVICE)
    tl.store(u_ptr + m[:, None] * d_inner + k[None, :], u.to(tl.int8), mask=mask)
    for j0 in tl.static_range(0, N_OUT, BLOCK_J):  # unrolled: the weight loads go out together
        j = j0 + tl.arange(0, BLOCK_J)
        w_mask = (j < N_OUT)[:, None] & (k < d_inner)[None, :]
        if INT4:
            w = _int4_weights(x_proj_ptr, group_multiplier_ptr, j, k, w_mask, d_inner, group_size)
        else:
            w = tl.load(x_proj_ptr + j[:, None] * d_inner + k[None, :], mask=w_mask,
                        other=0).to(tl.int32)
        partial = tl.sum(u[:, None, :] * w[None, :, :], axis=2)
        tl.store(partial_ptr + (k_block * batch + m[:, None]) * N_OUT + j[None, :], partial,
                 mask=row_mask[:, None] & (j < N_OUT)[None, :])


@triton.jit
def _partial_sums(partial_ptr, offsets, mask, k0, batch, n_out, K_BLOCKS: tl.constexpr,
                  K_CHUNK: tl.constexpr):
    """int32 sums over K blocks k0 … k0 + K_CHUNK - 1 of the partial sums at ``offsets``."""
    k_block = k0 + tl.arange(0, K_CHUNK)
    chunk = tl.load(partial_ptr + k_block[:, None, None] * batch * n_out + offsets[None, :, :],
                    mask=(k_block < K_BLOCKS)[:, None, None] & mask[None, :, :], other=0)
    return tl.sum(chunk, axis=0)


@triton.jit
def _x_dbl_codes(partial_ptr, multipliers_ptr, multiplier, m, j, mask, batch, n_out,
                 K_BLOCKS: tl.constexpr, K_CHUNK: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """fp32 codes [rows, outputs j] of x_proj's int8 output (zero outside ``mask``): the sum of
    the K blocks' partial sums (integers: any order gives the same sum), then the W8A8 epilogue.
    The K blocks are read K_CHUNK at a time in unrolled loads that go out together."""
    offsets = m[:, None] * n_out + j[None, :]
    acc = _partial_sums(partial_ptr, offsets, mask, 0, batch, n_out, K_BLOCKS, K_CHUNK)
    for k0 in tl.static_range(K_CHUNK, K_BLOCKS, K_CHUNK):
        acc += _partial_sums(partial_ptr, offsets, mask, k0, batch, n_out, K_BLOCKS, K_CHUNK)
    if PER_CHANNEL:
        multiplier = tl.load(multipliers_ptr + j, mask=j < n_out, other=0.0)[None, :]
    return int8_code_values(acc.to(tl.float32), multiplier)


@triton.jit
def _state_readout(h, C, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   LEVELS_N: tl.constexpr):
    """y [rows, channels] = Σ_n h[:, :, n] · C[:, n], summed in the order of
    quamba.ops.scan.selective_scan.state_readout (a pairwise tree over n, adjacent states first; h
    and C are zero past d_state), which the unfused QSScan step shares: tl.sum's order is the
    compiler's. BLOCK_N = 2^LEVELS_N."""
    terms = h * C[:, None, :]
    for level in tl.static_range(LEVELS_N):
        pairs = tl.reshape(terms, (BLOCK_M, BLOCK_D, BLOCK_N >> (level + 1), 2))
        even, odd = tl.split(pairs)
        terms = even + odd
    return tl.reshape(terms, (BLOCK_M, BLOCK_D))


@triton.jit
def _dt_proj_scan_kernel(partial_ptr, xdbl_multipliers_ptr, u_ptr, z_ptr, sz_b, sz_d, dt_proj_ptr,
                         state_ptr, y_ptr, A_log_ptr, D_ptr, dt_bias_ptr, x_dbl_out_ptr,
                         dt_out_ptr, batch, d_inner, d_state,
                         xdbl_multiplier, dt_multiplier, u_scale, xdbl_scale, dt_scale, z_scale,
                         state_scale, state_inverse, A_log_scale, D_scale, dt_bias_scale,
                         PER_CHANNEL: tl.constexpr, INT8_STATE: tl.constexpr,
                         WRITES_CODES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, LEVELS_N: tl.constexpr,
                         DT_RANK: tl.constexpr,
                         K_BLOCKS: tl.constexpr, K_CHUNK_R: tl.constexpr,
                         K_CHUNK_N: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    _dependent_launch(PDL)
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    dt_rank = DT_RANK
    n_out = dt_rank + 2 * d_state
    row_mask, d_mask = m < batch, d < d_inner
    mask = row_mask[:, None] & d_mask[None, :]

    # dt_proj over dt_low, a chunk of dt_rank at a time (unrolled: the loads go out together)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.int32)
    for r0 in tl.static_range(0, DT_RANK, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = row_mask[:, None] & (r < dt_rank)[None, :]
        dt_low = _x_dbl_codes(partial_ptr, xdbl_multipliers_ptr, xdbl_multiplier, m, r, r_mask,
                              batch, n_out, K_BLOCKS, K_CHUNK_R, PER_CHANNEL)
        if WRITES_CODES:
            if tl.program_id(0) == 0:  # x_proj's codes: written once
                tl.store(x_dbl_out_ptr + m[:, None] * n_out + r[None, :], dt_low.to(tl.int8),
                         mask=r_mask)
        w = tl.load(dt_proj_ptr + d[:, None] * dt_rank + r[None, :],
                    mask=d_mask[:, None] & (r < dt_rank)[None, :], other=0).to(tl.int32)
        acc += tl.sum(dt_low.to(tl.int32)[:, None, :] * w[None, :, :], axis=2)
    dt_codes = int8_code_values(acc.to(tl.float32), dt_multiplier)
    if WRITES_CODES:
        tl.store(dt_out_ptr + m[:, None] * d_inner + d[None, :], dt_codes.to(tl.int8), mask=mask)

    n = tl.arange(0, BLOCK_N)
    n_mask = row_mask[:, None] & (n < d_state)[None, :]
    B_codes = _x_dbl_codes(partial_ptr, xdbl_multipliers_ptr, xdbl_multiplier, m, dt_rank + n,
                           n_mask, batch, n_out, K_BLOCKS, K_CHUNK_N, PER_CHANNEL)
    C_codes = _x_dbl_codes(partial_ptr, xdbl_multipliers_ptr, xdbl_multiplier, m,
                           dt_rank + d_state + n, n_mask, batch, n_out, K_BLOCKS, K_CHUNK_N,
                           PER_CHANNEL)
    if WRITES_CODES:
        if tl.program_id(0) == 0:
            codes_ptrs = x_dbl_out_ptr + m[:, None] * n_out + dt_rank + n[None, :]
            tl.store(codes_ptrs, B_codes.to(tl.int8), mask=n_mask)
            tl.store(codes_ptrs + d_state, C_codes.to(tl.int8), mask=n_mask)
    B, C = B_codes * xdbl_scale, C_codes * xdbl_scale

    # the zoh step of qsscan_update's reference, operation by operation
    u = tl.load(u_ptr + m[:, None] * d_inner + d[None, :], mask=mask, other=0)
    u = u.to(tl.float32) * u_scale
    z = tl.load(z_ptr + m[:, None] * sz_b + d[None, :] * sz_d, mask=mask, other=0)
    z = z.to(tl.float32) * z_scale
    dt_bias = tl.load(dt_bias_ptr + d, mask=d_mask, other=0).to(tl.float32) * dt_bias_scale
    delta = _softplus(dt_codes * dt_scale + dt_bias[None, :], LIBDEVICE)
    A_mask = d_mask[:, None] & (n < d_state)[None, :]
    A_log = tl.load(A_log_ptr + d[:, None] * d_state + n[None, :], mask=A_mask, other=0)
    A = -_exp(A_log.to(tl.float32) * A_log_scale, LIBDEVICE)
    offsets = (m[:, None, None] * d_inner + d[None, :, None]) * d_state + n[None, None, :]
    state_mask = mask[:, :, None] & (n < d_state)[None, None, :]
    h = tl.load(state_ptr + offsets, mask=state_mask, other=0).to(tl.float32)
    if INT8_STATE:
        h = h * state_scale
    decay = _decay(delta[:, :, None] * A[None, :, :], LIBDEVICE)
    h = decay * h + (delta * u)[:, :, None] * B[:, None, :]
    if INT8_STATE:
        tl.store(state_ptr + offsets, int8_codes(h, state_inverse), mask=state_mask)
    else:
        tl.store(state_ptr + offsets, h, mask=state_mask)
    D = tl.load(D_ptr + d, mask=d_mask, other=0).to(tl.float32) * D_scale
    y = _state_readout(h, C, BLOCK_M, BLOCK_D, BLOCK_N, LEVELS_N) + u * D[None, :]
    y = y * _silu(z, LIBDEVICE)
    tl.store(y_ptr + m[:, None] * d_inner + d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# libdevice's exp and log1p and inline PTX where the kernels are compiled; Triton's interpreter
# (TRITON_INTERPRET when they were defined) has neither and runs numpy's
LIBDEVICE_MATH = not isinstance(_dt_proj_scan_kernel, InterpretedFunction)


def ssm_step(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales, out_dtype):
    """:func:`quamba.ops.fused_decode.mixer_step.qmixer_ssm_step` on the two kernels: y [batch,
    d_inner]."""
    return _launch(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales, out_dtype,
                   codes=None)


def ssm_step_with_codes(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales,
                        out_dtype):
    """:func:`ssm_step` that also returns the step's integer intermediates, which the kernels
    otherwise keep in registers: (y, u codes [batch, d_inner], x_proj's codes [batch, dt_rank +
    2 d_state], dt codes [batch, d_inner]), all int8."""
    batch, d_inner = x.shape
    n_out = dt_proj.weight.shape[1] + 2 * ssm_state.shape[2]
    codes = (torch.empty(batch, d_inner, dtype=torch.int8, device=x.device),
             torch.empty(batch, n_out, dtype=torch.int8, device=x.device),
             torch.empty(batch, d_inner, dtype=torch.int8, device=x.device))
    y = _launch(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales, out_dtype,
                codes)
    return (y, *codes)


def _launch(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales, out_dtype, codes):
    batch, d_inner = x.shape
    d_state, dt_rank = ssm_state.shape[2], dt_proj.weight.shape[1]
    n_out = dt_rank + 2 * d_state
    y = torch.empty(batch, d_inner, dtype=out_dtype, device=x.device)
    if batch == 0 or d_inner == 0:
        return y
    rows = min(MAX_ROWS, triton.next_power_of_2(batch))
    row_blocks = triton.cdiv(batch, rows)
    block_k = _block(d_inner, min(CONV_CHANNELS, TILE // (4 * rows)))
    k_blocks = triton.cdiv(d_inner, block_k)
    u = codes[0] if codes is not None else torch.empty(batch, d_inner, dtype=torch.int8,
                                                       device=x.device)
    partial = torch.empty(k_blocks, batch, n_out, dtype=torch.int32, device=x.device)
    int4 = isinstance(x_proj, W4A8Weight)
    launch = _launch_options(x.device)
    _conv_x_proj_kernel[(k_blocks, row_blocks)](
        x, x.stride(0), x.stride(1), conv_state, conv.weight.contiguous(),
        conv.weight if conv.bias is None else conv.bias, u,
        x_proj.packed if int4 else x_proj.weight, x_proj.group_multiplier if int4 else partial,
        partial, batch, d_inner, x_proj.group_size if int4 else 1,
        fp32_multiplier(scales.xz, conv.weight_scale), fp32_value(float(conv.bias_scale)),
        fp32_reciprocal(float(scales.u)), N_OUT=n_out,
        WIDTH=conv.weight.shape[1], HAS_BIAS=conv.bias is not None, INT4=int4, BLOCK_M=rows,
        BLOCK_K=block_k, BLOCK_J=_block(n_out, TILE // (rows * block_k)),
        LIBDEVICE=LIBDEVICE_MATH, num_warps=NUM_WARPS, enable_fp_fusion=False, **launch)

    block_n = triton.next_power_of_2(d_state)
    block_d = _block(d_inner, min(SCAN_CHANNELS, TILE // (rows * block_n)))
    int8_state = ssm_state.dtype == torch.int8
    state_scale = fp32_value(float(scales.state)) if int8_state else 1.0
    xdbl_multipliers, xdbl_multiplier = _x_proj_multipliers(x_proj, x.device)
    block_r = _block(dt_rank, TILE // (rows * block_d))
    _dt_proj_scan_kernel[(triton.cdiv(d_inner, block_d), row_blocks)](
        partial, partial if xdbl_multipliers is None else xdbl_multipliers, u, z, z.stride(0),
        z.stride(1), dt_proj.weight.contiguous(), ssm_state, y, params.A_log, params.D,
        params.dt_bias, u if codes is None else codes[1], u if codes is None else codes[2],
        batch, d_inner, d_state, xdbl_multiplier,
        fp32_multiplier(dt_proj.in_scale, dt_proj.weight_scale, dt_proj.out_scale),
        *(fp32_value(float(s)) for s in (scales.u, scales.xdbl, scales.dt, scales.xz)),
        state_scale, fp32_reciprocal(state_scale) if int8_state else 1.0,
        *(fp32_value(float(s)) for s in (params.A_log_scale, params.D_scale, params.dt_bias_scale)),
        PER_CHANNEL=xdbl_multipliers is not None, INT8_STATE=int8_state,
        WRITES_CODES=codes is not None, BLOCK_M=rows, BLOCK_D=block_d, BLOCK_R=block_r,
        BLOCK_N=block_n, LEVELS_N=block_n.bit_length() - 1, DT_RANK=dt_rank, K_BLOCKS=k_blocks,
        K_CHUNK_R=_k_chunk(k_blocks, rows * block_r), K_CHUNK_N=_k_chunk(k_blocks, rows * block_n),
        LIBDEVICE=LIBDEVICE_MATH, num_warps=NUM_WARPS, enable_fp_fusion=False, **launch)
    return y


@functools.lru_cache(maxsize=16)
def _launch_options(device) -> dict:
    """The kernels' PDL argument and Triton's launch option for it: programmatic dependent
    launch where they are compiled for a device of compute capability 9 or more."""
    pdl = LIBDEVICE_MATH and backend.has_programmatic_launch(device)
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def _block(size: int, limit: int) -> int:
    """A power of two covering ``size`` but at most ``limit`` (at least 2)."""
    return max(2, min(triton.next_power_of_2(size), triton.next_power_of_2(limit + 1) // 2))


def _k_chunk(k_blocks: int, tile: int) -> int:
    """K blocks of split-K partial sums read at once by a scan program, for ``tile`` outputs."""
    return _block(k_blocks, TILE // tile)


def _x_proj_multipliers(x_proj, device) -> tuple[torch.Tensor | None, float]:
    """(fp32 [N] per-channel multipliers of W4A8, or None; W8A8's one multiplier, or 0.0). W4A8's
    are kept per version of its channel_scale (quamba.ops.constants), not made in every step."""
    if not isinstance(x_proj, W4A8Weight):
        return None, fp32_multiplier(x_proj.in_scale, x_proj.weight_scale, x_proj.out_scale)
    in_scale, out_scale = float(x_proj.in_scale), float(x_proj.out_scale)
    def make():
        return requant_multiplier(in_scale, x_proj.channel_scale, out_scale).to(device).contiguous()
    return cached(x_proj.channel_scale, (in_scale, out_scale, device), make), 0.0
