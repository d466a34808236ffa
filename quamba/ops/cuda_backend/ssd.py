"""Mamba2's SSD on the GPU, in Triton: ``qssd_scan`` and ``qssd_state_update`` (int8 codes with
their scales, or floats), the specification being their torch references in quamba.ops.qssd, and
the FP model's ``ssd_scan`` and ``ssd_state_update`` (quamba.ops.ssd) on the same kernels.

Prefill: one program per (batch, head, block of headdim channels) walks the sequence in chunks
of ``CHUNK`` steps, as the SSD algorithm does: inside a chunk the masked product (C Bᵀ ∘ decay ∘
Δ) x, plus the carried state read through C, then the state carried to the chunk's end. Inputs
are dequantized on load (x per channel, B and C per state group), everything runs in fp32 with
IEEE fp32 products (``DOT_PRECISION``), so results differ from the reference by summation order
only. Its tiles fit shared memory without software pipelining (``num_stages=1``: with it, d_state
128 asked for 263 KB on an H100, above its 227 KB) and with 32 channels per program at d_state
128. Decode: one program per (batch, head, channel block) steps its fp32 state; an int8 state is
dequantized before and requantized after, in torch, as the reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from quamba.ops import backend
from quamba.ops.quant import dequantize, quantize

CHUNK = 64
DOT_PRECISION = "ieee"


def _block(size: int) -> int:
    """A power of two ≥ size and ≥ 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(size))


@triton.jit
def _softplus(x):
    # PyTorch's softplus: x above 20, else log1p(exp(x))
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _ssd_scan_kernel(x_ptr, x_scale_ptr, dt_ptr, dt_scale, B_ptr, B_scale_ptr, C_ptr, C_scale_ptr,
                     A_ptr, D_ptr, dt_bias_ptr, y_ptr, state_ptr, initial_state_ptr,
                     seqlen, headdim, d_state, heads_per_group,
                     sx_b, sx_l, sx_h, sx_p, sdt_b, sdt_l, sdt_h,
                     sB_b, sB_l, sB_g, sB_n, sC_b, sC_l, sC_g, sC_n,
                     sy_b, sy_l, sy_h, sy_p,
                     CHUNK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    q = tl.arange(0, CHUNK_SIZE)
    g = h // heads_per_group
    p_mask, n_mask = p < headdim, n < d_state
    x_scale = tl.load(x_scale_ptr + h * headdim + p, mask=p_mask, other=0.0)
    B_scale = tl.load(B_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)
    C_scale = tl.load(C_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)
    A = tl.load(A_ptr + h)
    D = tl.load(D_ptr + h)
    dt_bias = tl.load(dt_bias_ptr + h)
    causal = q[:, None] >= q[None, :]
    state_offsets = ((b * tl.num_programs(1) + h) * headdim + p[:, None]) * d_state + n[None, :]
    state_mask = p_mask[:, None] & n_mask[None, :]
    if HAS_INITIAL_STATE:
        state = tl.load(initial_state_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, seqlen, CHUNK_SIZE):
        t = start + q
        t_mask = t < seqlen
        dt = tl.load(dt_ptr + b * sdt_b + t * sdt_l + h * sdt_h, mask=t_mask, other=0).to(tl.float32)
        dt = tl.where(t_mask, _softplus(dt * dt_scale + dt_bias), 0.0)
        log_decay = tl.cumsum(dt * A, axis=0)  # [Q]
        x = tl.load(x_ptr + b * sx_b + t[:, None] * sx_l + h * sx_h + p[None, :] * sx_p,
                    mask=t_mask[:, None] & p_mask[None, :], other=0).to(tl.float32) * x_scale[None, :]
        B = tl.load(B_ptr + b * sB_b + t[:, None] * sB_l + g * sB_g + n[None, :] * sB_n,
                    mask=t_mask[:, None] & n_mask[None, :], other=0).to(tl.float32) * B_scale[None, :]
        C = tl.load(C_ptr + b * sC_b + t[:, None] * sC_l + g * sC_g + n[None, :] * sC_n,
                    mask=t_mask[:, None] & n_mask[None, :], other=0).to(tl.float32) * C_scale[None, :]
        # inside the chunk: y_t += Σ_{s ≤ t} (C_t · B_s) exp(Σ_{s<r≤t} Δ_r A) Δ_s x_s
        scores = tl.dot(C, tl.trans(B), input_precision=PRECISION)  # [Q, Q]
        decay = tl.exp(tl.where(causal, log_decay[:, None] - log_decay[None, :], float("-inf")))
        y = tl.dot(scores * decay * dt[None, :], x, input_precision=PRECISION)
        # the state carried into the chunk, decayed to each step
        y += tl.dot(C, tl.trans(state), input_precision=PRECISION) * tl.exp(log_decay)[:, None]
        y += D * x
        tl.store(y_ptr + b * sy_b + t[:, None] * sy_l + h * sy_h + p[None, :] * sy_p,
                 y.to(y_ptr.dtype.element_ty), mask=t_mask[:, None] & p_mask[None, :])
        chunk_decay = tl.sum(dt * A, axis=0)
        to_end = tl.exp(chunk_decay - log_decay) * dt  # [Q]
        state = state * tl.exp(chunk_decay) + tl.dot(tl.trans(x * to_end[:, None]), B,
                                                     input_precision=PRECISION)
    tl.store(state_ptr + state_offsets, state, mask=state_mask)


@triton.jit
def _ssd_step_kernel(state_ptr, x_ptr, x_scale_ptr, dt_ptr, dt_scale, B_ptr, B_scale_ptr, C_ptr,
                     C_scale_ptr, A_ptr, D_ptr, dt_bias_ptr, y_ptr,
                     headdim, d_state, heads_per_group,
                     sx_b, sx_h, sx_p, sdt_b, sdt_h, sB_b, sB_g, sB_n, sC_b, sC_g, sC_n,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    g = h // heads_per_group
    p_mask, n_mask = p < headdim, n < d_state
    mask = p_mask[:, None] & n_mask[None, :]
    dt = tl.load(dt_ptr + b * sdt_b + h * sdt_h).to(tl.float32)
    dt = _softplus(dt * dt_scale + tl.load(dt_bias_ptr + h))
    x = tl.load(x_ptr + b * sx_b + h * sx_h + p * sx_p, mask=p_mask, other=0).to(tl.float32)
    x = x * tl.load(x_scale_ptr + h * headdim + p, mask=p_mask, other=0.0)
    B = tl.load(B_ptr + b * sB_b + g * sB_g + n * sB_n, mask=n_mask, other=0).to(tl.float32)
    B = B * tl.load(B_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)
    C = tl.load(C_ptr + b * sC_b + g * sC_g + n * sC_n, mask=n_mask, other=0).to(tl.float32)
    C = C * tl.load(C_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)
    offsets = ((b * tl.num_programs(1) + h) * headdim + p[:, None]) * d_state + n[None, :]
    state = tl.load(state_ptr + offsets, mask=mask, other=0.0)
    state = state * tl.exp(dt * tl.load(A_ptr + h)) + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptr + offsets, state, mask=mask)
    y = tl.sum(state * C[None, :], axis=1) + tl.load(D_ptr + h) * x
    tl.store(y_ptr + (b * tl.num_programs(1) + h) * headdim + p, y.to(y_ptr.dtype.element_ty),
             mask=p_mask)


# Per-call constants (scale tables, dequantized SSM parameters) by the tensor they come from:
# built once per (its version, the view and shape asked), not on every call (small kernels per
# layer and decode step). Not kept for an inference tensor (no version counter) nor while a CUDA
# graph is being captured (its kernels run only at replay).
_CONSTANTS = WeakIdKeyDictionary()
_ONES = {}


def _keeps_constants(device: torch.device) -> bool:
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _cached(anchor: torch.Tensor, key: tuple, make):
    """``make()``, kept per (``anchor``, ``key``) until ``anchor`` changes (several views of one
    buffer each keep theirs)."""
    if anchor.is_inference() or not _keeps_constants(anchor.device):
        return make()
    entries = _CONSTANTS.setdefault(anchor, {})
    version, value = entries.get(key, (None, None))
    if version != anchor._version:
        value = make()
        entries[key] = (anchor._version, value)
    return value


def _ones(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The scale table of float inputs, whose scale is ignored."""
    key = (rows, cols, device)
    if key not in _ONES:
        ones = torch.ones(rows, cols, dtype=torch.float32, device=device)
        if not _keeps_constants(device):
            return ones
        _ONES[key] = ones
    return _ONES[key]


def _scale_table(t, scale, rows: int, cols: int) -> torch.Tensor:
    """The fp32 [rows, cols] scales of input ``t``: int8 codes' ``scale`` (a float, or a tensor
    broadcasting to [rows, cols]) expanded; ones for a float input."""
    if t.dtype != torch.int8:
        return _ones(rows, cols, t.device)
    if not isinstance(scale, torch.Tensor):
        return torch.full((rows, cols), float(scale), dtype=torch.float32, device=t.device)
    # the mixer passes views of one [conv_dim] buffer, new objects each call: key on the buffer
    anchor = scale if scale._base is None else scale._base
    view = (scale.storage_offset(), tuple(scale.shape), tuple(scale.stride()))
    return _cached(anchor, view + (rows, cols, t.device), lambda: scale.to(
        device=t.device, dtype=torch.float32).expand(rows, cols).contiguous())


def _scale_tables(x, x_scale, B, B_scale, C, C_scale) -> tuple:
    """(x's [nheads, headdim], B's and C's [ngroups, d_state] scale tables) of the SSD inputs
    (x [..., nheads, headdim], B and C [..., ngroups, d_state])."""
    nheads, headdim = x.shape[-2:]
    ngroups, d_state = B.shape[-2:]
    return (_scale_table(x, x_scale, nheads, headdim), _scale_table(B, B_scale, ngroups, d_state),
            _scale_table(C, C_scale, ngroups, d_state))


def _scalar_scale(t, scale) -> float:
    return float(scale) if t.dtype == torch.int8 else 1.0


def _launch_scan(x, x_table, dt, dt_scale, B, B_table, C, C_table, A, D, dt_bias, out_dtype,
                 initial_state=None):
    """(y [batch, seqlen, nheads, headdim] in out_dtype, last state fp32) of the prefill kernel;
    A, D, dt_bias fp32 [nheads]."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2], B.shape[3]
    y = torch.empty(batch, seqlen, nheads, headdim, dtype=out_dtype, device=x.device)
    state = torch.empty(batch, nheads, headdim, d_state, dtype=torch.float32, device=x.device)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    block_n = _block(d_state)
    block_p = min(_block(headdim), 32 if block_n >= 128 else 64)
    grid = (batch, nheads, triton.cdiv(headdim, block_p))
    _ssd_scan_kernel[grid](
        x, x_table, dt, dt_scale, B, B_table, C, C_table, A, D, dt_bias, y, state,
        state if initial_state is None else initial_state, seqlen, headdim, d_state,
        nheads // ngroups, *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(),
        CHUNK_SIZE=CHUNK, BLOCK_P=block_p, BLOCK_N=block_n, PRECISION=DOT_PRECISION,
        HAS_INITIAL_STATE=initial_state is not None, num_warps=8, num_stages=1)
    return y, state


def _launch_step(state, x, x_table, dt, dt_scale, B, B_table, C, C_table, A, D, dt_bias, out_dtype):
    """y [batch, nheads, headdim] in out_dtype of one decode step; ``state`` (contiguous fp32)
    stepped in place."""
    batch, nheads, headdim = x.shape
    ngroups, d_state = B.shape[1], B.shape[2]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the SSD step kernel needs a contiguous fp32 state")
    y = torch.empty(batch, nheads, headdim, dtype=out_dtype, device=x.device)
    block_p = min(_block(headdim), 64)
    grid = (batch, nheads, triton.cdiv(headdim, block_p))
    _ssd_step_kernel[grid](
        state, x, x_table, dt, dt_scale, B, B_table, C, C_table, A, D, dt_bias, y, headdim,
        d_state, nheads // ngroups, *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        BLOCK_P=block_p, BLOCK_N=_block(d_state))
    return y


def _params(params, device) -> tuple:
    """(A, D, dt_bias) fp32 [nheads] on ``device`` from the int8 SSM parameters."""
    def dequantized():
        return tuple(p.to(device).contiguous() for p in params.dequantized())
    return _cached(params.A_log, (params.A_log_scale, params.D._version, params.D_scale,
                                  params.dt_bias._version, params.dt_bias_scale, device),
                   dequantized)


@backend.register("qssd_scan", "cuda", kernels=())
def _qssd_scan_cuda(x, x_scale, dt, dt_scale, B, B_scale, C, C_scale, params, chunk_size,
                    state_scale, out_dtype):
    x_table, B_table, C_table = _scale_tables(x, x_scale, B, B_scale, C, C_scale)
    y, state = _launch_scan(x, x_table, dt, _scalar_scale(dt, dt_scale), B, B_table, C, C_table,
                            *_params(params, x.device), out_dtype)
    if state_scale is not None:
        state = quantize(state, state_scale)
    return y, state


@backend.register("qssd_state_update", "cuda", kernels=())
def _qssd_state_update_cuda(state, state_scale, x, x_scale, dt, dt_scale, B, B_scale, C, C_scale,
                            params, out_dtype):
    x_table, B_table, C_table = _scale_tables(x, x_scale, B, B_scale, C, C_scale)
    int8_state = state.dtype == torch.int8
    h = dequantize(state, state_scale) if int8_state else state
    y = _launch_step(h, x, x_table, dt, _scalar_scale(dt, dt_scale), B, B_table, C, C_table,
                     *_params(params, x.device), out_dtype)
    if int8_state:
        state.copy_(quantize(h, state_scale))
    return y


def _fp32(*tensors):
    return [t.float().contiguous() for t in tensors]


# The FP model's SSD (quamba.ops.ssd) on the same kernels, unit scales: an optional FP kernel as
# mamba-ssm's are for Mamba1, present wherever quamba's cuda backend loads.
@backend.register("ssd_scan", "cuda", requires=lambda: None)
def _ssd_scan_cuda(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state):
    x_table, B_table, C_table = _scale_tables(x, None, B, None, C, None)
    return _launch_scan(x, x_table, dt, 1.0, B, B_table, C, C_table, *_fp32(A, D, dt_bias),
                        x.dtype, initial_state)


@backend.register("ssd_state_update", "cuda", requires=lambda: None)
def _ssd_state_update_cuda(state, x, dt, A, B, C, D, dt_bias):
    x_table, B_table, C_table = _scale_tables(x, None, B, None, C, None)
    return _launch_step(state, x, x_table, dt, 1.0, B, B_table, C, C_table, *_fp32(A, D, dt_bias),
                        x.dtype)
