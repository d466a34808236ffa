"""Mamba2's SSD on the GPU, in Triton: ``qssd_scan`` and ``qssd_state_update`` (int8 codes with
their scales, or floats), the specification being their torch references in quamba.ops.ssd.qssd, and
the FP model's ``ssd_scan`` and ``ssd_state_update`` (quamba.ops.ssd.ssd) on the same kernels.

Prefill, the SSD algorithm in chunks of ``CHUNK`` steps (whatever ``chunk_size`` the caller
passes: the result does not depend on it), four passes that each spread over chunks, heads and
channel blocks (as mamba-ssm's SSD does):
  0. C_t · B_s for the step pairs of each chunk, once per state group (shared by its heads);
  1. each chunk's own end state, Σ_s exp(Σ_{s<r≤end} Δ_r A) Δ_s x_s ⊗ B_s, with Δ and the
     within-chunk cumulative log decay (and, for int8 x, its codes in fp16 for pass 3);
  2. the state carried into each chunk, walking the chunks in order (fp32), and the last state;
  3. y = C_t · (carried state, decayed to t) + Σ_{s≤t} (C_t · B_s) exp(Σ_{s<r≤t} Δ_r A) Δ_s x_s
     + D x_t.
Products run on tensor cores in fp16 for int8 and fp16 inputs (int8 codes are exact in fp16; x's
per-channel scales multiply the results), bf16 for bf16, tf32 for fp32, with fp32 accumulation and
fp32 elsewhere: results differ from the fp32 reference by the rounding of one product operand
(about 1e-3 of the output's range for int8 inputs, an eighth of an int8 step). Decode: one program
per (batch, head, channel block) steps its state in place, an int8 state dequantized on load and
requantized on store (one kernel per step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quamba.ops import backend
from quamba.ops.constants import cached, keeps_constants
from quamba.ops.quant import fp32_reciprocal, fp32_value, quantize
from quamba.ops.quant_triton import int8_codes
from quamba.ops.ssd.ssd import KERNEL_CHUNK

# Tiles, chosen on an H100 at Mamba2-2.7B's heads (80 × 64, d_state 128), L 1024-2048, batch 1-8
CHUNK = KERNEL_CHUNK  # steps per chunk (mamba-ssm's default, 256)
BLOCK_T = 64  # steps per tile of passes 0 and 3 (pass 3: rows of y)
BLOCK_S = 32  # earlier steps per inner tile of pass 3
SCAN_WARPS = 4  # warps per program of pass 3
STATE_BLOCK_T = 32  # steps per tile of pass 1
STATE_BLOCK_N = 128  # states per program of pass 1
STATE_WARPS = 4  # warps per program of pass 1
PASSING_BLOCK = 1024  # state entries per program of pass 2
DOT_PRECISION = "tf32"  # fp32 inputs' products
# A head's channels per program of the decode step: 16 while it has few heads to spread (batch ·
# nheads under 256), else 64. H200, Mamba2-2.7B's 80 heads of 64 (bench_ssd.py --step, which sets
# STEP_BLOCK_P to sweep them): batch 1 2.91 µs at 16 against 3.72 at 64, batch 8 7.04 at 64
# against 7.70 at 16.
STEP_BLOCK_P = None
STEP_FEW_HEADS = 256


def _block(size: int) -> int:
    """A power of two ≥ size and ≥ 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(size))


@triton.jit
def _softplus(x):
    # PyTorch's softplus: x above 20, else log1p(exp(x))
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _chunk_scores_kernel(B_ptr, B_scale_ptr, C_ptr, C_scale_ptr, scores_ptr,
                         seqlen, ngroups, d_state, sB_b, sB_l, sB_g, sB_n, sC_b, sC_l, sC_g, sC_n,
                         CHUNK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Pass 0, one program per (chunk, block of rows t, block of columns s ≤ t, batch × group):
    C_t · B_s for the steps of a chunk, shared by every head of the group, into ``scores``
    [batch × group, chunk, CHUNK_SIZE, CHUNK_SIZE] (blocks above the diagonal are not written)."""
    blocks: tl.constexpr = CHUNK_SIZE // BLOCK_T
    c = tl.program_id(0) // (blocks * blocks)
    t_block = tl.program_id(0) // blocks % blocks
    s_block = tl.program_id(0) % blocks
    if s_block > t_block:
        return
    bg = tl.program_id(1)
    b, g = bg // ngroups, bg % ngroups
    n = tl.arange(0, BLOCK_N)
    n_mask = n < d_state
    t = c * CHUNK_SIZE + t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    s = c * CHUNK_SIZE + s_block * BLOCK_T + tl.arange(0, BLOCK_T)
    C = tl.load(C_ptr + b * sC_b + t[:, None] * sC_l + g * sC_g + n[None, :] * sC_n,
                mask=(t < seqlen)[:, None] & n_mask[None, :], other=0).to(tl.float32)
    C = C * tl.load(C_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)[None, :]
    B = tl.load(B_ptr + b * sB_b + s[:, None] * sB_l + g * sB_g + n[None, :] * sB_n,
                mask=(s < seqlen)[:, None] & n_mask[None, :], other=0).to(tl.float32)
    B = B * tl.load(B_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)[None, :]
    scores = tl.dot(C, tl.trans(B), input_precision=PRECISION)
    nchunks = tl.num_programs(0) // (blocks * blocks)
    rows = (bg * nchunks + c) * CHUNK_SIZE + t_block * BLOCK_T
    tl.store(scores_ptr + (rows + tl.arange(0, BLOCK_T))[:, None] * CHUNK_SIZE
             + s_block * BLOCK_T + tl.arange(0, BLOCK_T)[None, :], scores)


@triton.jit
def _chunk_state_kernel(x_ptr, x_scale_ptr, dt_ptr, dt_scale, B_ptr, B_scale_ptr, A_ptr,
                        dt_bias_ptr, dt_out_ptr, log_decay_ptr, states_ptr, x_codes_ptr,
                        seqlen, nheads, headdim, d_state, heads_per_group, padded_len, n_blocks,
                        sx_b, sx_l, sx_h, sx_p, sdt_b, sdt_l, sdt_h, sB_b, sB_l, sB_g, sB_n,
                        CHUNK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                        WRITES_CODES: tl.constexpr):
    """Pass 1, one program per (chunk, batch × head, block of channels × block of states): the
    state a chunk alone leaves at its end, Σ_s exp(Σ_{s<r≤end} Δ_r A) Δ_s x_s ⊗ B_s, into
    ``states``. The first program of a (chunk, head) also writes Δ and the within-chunk cumulative
    log decay for passes 2 and 3; with ``WRITES_CODES``, the first state block copies int8 x to
    ``x_codes`` in DOT_DTYPE (exact), which pass 3 streams into its products without converting."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // nheads, bh % nheads
    g = h // heads_per_group
    n_block = tl.program_id(2) % n_blocks
    p = tl.program_id(2) // n_blocks * BLOCK_P + tl.arange(0, BLOCK_P)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < headdim, n < d_state
    x_scale = tl.load(x_scale_ptr + h * headdim + p, mask=p_mask, other=0.0)
    B_scale = tl.load(B_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)
    A = tl.load(A_ptr + h)
    dt_bias = tl.load(dt_bias_ptr + h)
    writes_steps = tl.program_id(2) == 0
    state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    offset = 0.0  # log decay from the chunk's start to the end of the previous block
    for start in range(c * CHUNK_SIZE, (c + 1) * CHUNK_SIZE, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        t_mask = t < seqlen
        dt = tl.load(dt_ptr + b * sdt_b + t * sdt_l + h * sdt_h, mask=t_mask, other=0).to(tl.float32)
        dt = tl.where(t_mask, _softplus(dt * dt_scale + dt_bias), 0.0)
        log_decay = tl.cumsum(dt * A, axis=0)  # within the block
        block_decay = tl.sum(dt * A, axis=0)
        if writes_steps:
            tl.store(dt_out_ptr + bh * padded_len + t, dt)
            tl.store(log_decay_ptr + bh * padded_len + t, offset + log_decay)
        x = tl.load(x_ptr + b * sx_b + t[:, None] * sx_l + h * sx_h + p[None, :] * sx_p,
                    mask=t_mask[:, None] & p_mask[None, :], other=0).to(DOT_DTYPE)
        if WRITES_CODES:
            if n_block == 0:
                tl.store(x_codes_ptr + ((b * seqlen + t[:, None]) * nheads + h) * headdim
                         + p[None, :], x, mask=t_mask[:, None] & p_mask[None, :])
        B = tl.load(B_ptr + b * sB_b + t[:, None] * sB_l + g * sB_g + n[None, :] * sB_n,
                    mask=t_mask[:, None] & n_mask[None, :], other=0).to(tl.float32)
        to_end = tl.exp(block_decay - log_decay) * dt
        B = (B * B_scale[None, :] * to_end[:, None]).to(DOT_DTYPE)
        state = state * tl.exp(block_decay) + tl.dot(tl.trans(x), B, input_precision=PRECISION)
        offset += block_decay
    nchunks = tl.num_programs(0)
    offsets = ((bh * nchunks + c) * headdim + p[:, None]) * d_state + n[None, :]
    tl.store(states_ptr + offsets, state * x_scale[:, None], mask=p_mask[:, None] & n_mask[None, :])


@triton.jit
def _state_passing_kernel(states_ptr, log_decay_ptr, initial_state_ptr, carried_ptr,
                          final_state_ptr, final_inverse, nchunks, state_size, padded_len,
                          CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                          HAS_INITIAL_STATE: tl.constexpr, INT8_FINAL: tl.constexpr):
    """Pass 2, one program per (batch × head, block of state entries): walks the chunks in order
    and writes the state carried into each (``carried``, in pass 3's dot dtype) and the state
    after the last one: fp32, or (INT8_FINAL) its int8 codes by quamba.ops.quant's rule
    (``final_inverse`` = fp32(1/scale), round half to even, ±127), the decode cache's format."""
    bh = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < state_size
    if HAS_INITIAL_STATE:
        state = tl.load(initial_state_ptr + bh * state_size + e, mask=mask, other=0.0)
    else:
        state = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(nchunks):
        offsets = (bh * nchunks + c) * state_size + e
        own = tl.load(states_ptr + offsets, mask=mask, other=0.0)
        tl.store(carried_ptr + offsets, state.to(carried_ptr.dtype.element_ty), mask=mask)
        chunk_decay = tl.load(log_decay_ptr + bh * padded_len + c * CHUNK_SIZE + CHUNK_SIZE - 1)
        state = state * tl.exp(chunk_decay) + own
    if INT8_FINAL:
        tl.store(final_state_ptr + bh * state_size + e, int8_codes(state, final_inverse), mask=mask)
    else:
        tl.store(final_state_ptr + bh * state_size + e, state, mask=mask)


@triton.jit
def _chunk_scan_kernel(x_ptr, x_scale_ptr, scores_ptr, C_ptr, C_scale_ptr, D_ptr,
                       dt_ptr, log_decay_ptr, carried_ptr, y_ptr,
                       seqlen, nheads, headdim, d_state, heads_per_group, padded_len,
                       sx_b, sx_l, sx_h, sx_p, sC_b, sC_l, sC_g, sC_n,
                       sy_b, sy_l, sy_h, sy_p,
                       CHUNK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       PRECISION: tl.constexpr):
    """Pass 3, one program per (block of BLOCK_T steps, batch × head, block of channels): the
    outputs, from the state carried into the chunk (read through C, decayed to each step) and the
    masked product (C Bᵀ ∘ decay ∘ Δ) x over the chunk's earlier steps."""
    blocks_per_chunk: tl.constexpr = CHUNK_SIZE // BLOCK_T
    c = tl.program_id(0) // blocks_per_chunk
    bh = tl.program_id(1)
    b, h = bh // nheads, bh % nheads
    g = h // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < headdim, n < d_state
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < seqlen
    if tl.program_id(0) * BLOCK_T >= seqlen:
        return
    x_scale = tl.load(x_scale_ptr + h * headdim + p, mask=p_mask, other=0.0)
    C_scale = tl.load(C_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)
    C = tl.load(C_ptr + b * sC_b + t[:, None] * sC_l + g * sC_g + n[None, :] * sC_n,
                mask=t_mask[:, None] & n_mask[None, :], other=0).to(tl.float32) * C_scale[None, :]
    log_decay_t = tl.load(log_decay_ptr + bh * padded_len + t)
    nchunks = tl.cdiv(seqlen, CHUNK_SIZE)
    carried = tl.load(carried_ptr + ((bh * nchunks + c) * headdim + p[None, :]) * d_state + n[:, None],
                      mask=p_mask[None, :] & n_mask[:, None], other=0.0)  # [N, P]
    y = tl.dot(C.to(carried_ptr.dtype.element_ty), carried, input_precision=PRECISION)
    y *= tl.exp(log_decay_t)[:, None]
    # Σ_s (C_t · B_s of pass 0) exp(Σ_{s<r≤t} Δ_r A) Δ_s x_s on x's codes, scaled once after
    scores_rows = scores_ptr + ((b * (nheads // heads_per_group) + g) * nchunks * CHUNK_SIZE
                                + t[:, None]) * CHUNK_SIZE
    within = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for start in range(c * CHUNK_SIZE, tl.program_id(0) * BLOCK_T + BLOCK_T, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        dt_s = tl.load(dt_ptr + bh * padded_len + s)
        log_decay_s = tl.load(log_decay_ptr + bh * padded_len + s)
        x = tl.load(x_ptr + b * sx_b + s[:, None] * sx_l + h * sx_h + p[None, :] * sx_p,
                    mask=(s < seqlen)[:, None] & p_mask[None, :], other=0).to(DOT_DTYPE)
        scores = tl.load(scores_rows + (s - c * CHUNK_SIZE)[None, :])  # [T, S]
        causal = t[:, None] >= s[None, :]
        decay = tl.exp(tl.where(causal, log_decay_t[:, None] - log_decay_s[None, :], float("-inf")))
        within += tl.dot((scores * decay * dt_s[None, :]).to(DOT_DTYPE), x, input_precision=PRECISION)
    x_t = tl.load(x_ptr + b * sx_b + t[:, None] * sx_l + h * sx_h + p[None, :] * sx_p,
                  mask=t_mask[:, None] & p_mask[None, :], other=0).to(tl.float32)
    y += (within + tl.load(D_ptr + h) * x_t) * x_scale[None, :]
    tl.store(y_ptr + b * sy_b + t[:, None] * sy_l + h * sy_h + p[None, :] * sy_p,
             y.to(y_ptr.dtype.element_ty), mask=t_mask[:, None] & p_mask[None, :])


@triton.jit
def _ssd_step_kernel(state_ptr, state_scale, state_inverse, x_ptr, x_scale_ptr, dt_ptr, dt_scale,
                     B_ptr, B_scale_ptr, C_ptr, C_scale_ptr, A_ptr, A_scale, D_ptr, D_scale,
                     dt_bias_ptr, dt_bias_scale, y_ptr, headdim, d_state, heads_per_group,
                     sx_b, sx_h, sx_p, sdt_b, sdt_h, sB_b, sB_g, sB_n, sC_b, sC_g, sC_n,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, INT8_STATE: tl.constexpr,
                     INT8_PARAMS: tl.constexpr, USE_PDL: tl.constexpr):
    """One decode step in place; an int8 state (INT8_STATE) is dequantized on load and
    requantized on store by quamba.ops.quant's rule (fp32 ``state_inverse`` = fp32(1/scale),
    round half to even, ±127), y being read off the fp32 state as the reference does.
    INT8_PARAMS: A, D, dt_bias are the int8 codes of A_log, D, dt_bias (A = -exp(A_log), each
    code times its scale), dequantized here rather than by torch kernels before every step; else
    fp32 values. USE_PDL: launched programmatically dependent (sm_90+): it waits for the kernel
    before it (the conv update, which lets it launch at once) before any load, and lets the next
    kernel launch at once (the Hadamard → int8, which waits for it in turn)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    g = h // heads_per_group
    p_mask, n_mask = p < headdim, n < d_state
    mask = p_mask[:, None] & n_mask[None, :]
    A = tl.load(A_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if INT8_PARAMS:
        A = -tl.exp(A * A_scale)
        D = D * D_scale
        dt_bias = dt_bias * dt_bias_scale
    dt = tl.load(dt_ptr + b * sdt_b + h * sdt_h).to(tl.float32)
    dt = _softplus(dt * dt_scale + dt_bias)
    x = tl.load(x_ptr + b * sx_b + h * sx_h + p * sx_p, mask=p_mask, other=0).to(tl.float32)
    x = x * tl.load(x_scale_ptr + h * headdim + p, mask=p_mask, other=0.0)
    B = tl.load(B_ptr + b * sB_b + g * sB_g + n * sB_n, mask=n_mask, other=0).to(tl.float32)
    B = B * tl.load(B_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)
    C = tl.load(C_ptr + b * sC_b + g * sC_g + n * sC_n, mask=n_mask, other=0).to(tl.float32)
    C = C * tl.load(C_scale_ptr + g * d_state + n, mask=n_mask, other=0.0)
    offsets = ((b * tl.num_programs(1) + h) * headdim + p[:, None]) * d_state + n[None, :]
    state = tl.load(state_ptr + offsets, mask=mask, other=0).to(tl.float32)
    if INT8_STATE:
        state = state * state_scale
    state = state * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
    if INT8_STATE:
        tl.store(state_ptr + offsets, int8_codes(state, state_inverse), mask=mask)
    else:
        tl.store(state_ptr + offsets, state, mask=mask)
    y = tl.sum(state * C[None, :], axis=1) + D * x
    tl.store(y_ptr + (b * tl.num_programs(1) + h) * headdim + p, y.to(y_ptr.dtype.element_ty),
             mask=p_mask)


# The scale tables of float inputs by shape and device (quamba.ops.constants says when one is kept)
_ONES = {}


def _ones(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The scale table of float inputs, whose scale is ignored."""
    key = (rows, cols, device)
    if key not in _ONES:
        ones = torch.ones(rows, cols, dtype=torch.float32, device=device)
        if not keeps_constants(device):
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
    return cached(anchor, view + (rows, cols, t.device), lambda: scale.to(
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


# The dtype of the prefill's matrix products, by the dtype of x: int8 codes are exact in fp16 (and
# scaled after the products), fp16 and bf16 inputs keep theirs, fp32 inputs use tf32.
_DOT_DTYPES = {torch.int8: (tl.float16, torch.float16), torch.float16: (tl.float16, torch.float16),
               torch.bfloat16: (tl.bfloat16, torch.bfloat16), torch.float32: (tl.float32, torch.float32)}


def _launch_scan(x, x_table, dt, dt_scale, B, B_table, C, C_table, A, D, dt_bias, out_dtype,
                 initial_state=None, state_scale=None):
    """(y [batch, seqlen, nheads, headdim] in out_dtype, last state) of the four prefill passes;
    A, D, dt_bias fp32 [nheads]. The last state is fp32, or with ``state_scale`` its int8 codes
    (``quantize(state, state_scale)``, written by pass 2)."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2], B.shape[3]
    device = x.device
    y = torch.empty(batch, seqlen, nheads, headdim, dtype=out_dtype, device=device)
    state = torch.empty(batch, nheads, headdim, d_state, device=device,
                        dtype=torch.float32 if state_scale is None else torch.int8)
    if seqlen == 0:
        start = (torch.zeros(state.shape, device=device) if initial_state is None
                 else initial_state.to(torch.float32, copy=True))
        return y, start if state_scale is None else quantize(start, state_scale)
    if x.dtype not in _DOT_DTYPES:
        raise TypeError(f"the SSD kernel takes int8, fp16, bf16 or fp32 x, got {x.dtype}")
    dot_dtype, operand_dtype = _DOT_DTYPES[x.dtype]
    nchunks, blocks = triton.cdiv(seqlen, CHUNK), CHUNK // BLOCK_T
    padded_len = nchunks * CHUNK
    steps = torch.empty(2, batch * nheads, padded_len, dtype=torch.float32, device=device)
    own_states = torch.empty(batch * nheads, nchunks, headdim, d_state, dtype=torch.float32,
                             device=device)
    carried = torch.empty(own_states.shape, dtype=operand_dtype, device=device)
    scores = torch.empty(batch * ngroups, nchunks, CHUNK, CHUNK, dtype=torch.float32, device=device)
    block_n = _block(d_state)
    block_p = min(_block(headdim), 64)
    p_blocks = triton.cdiv(headdim, block_p)
    tiles = dict(CHUNK_SIZE=CHUNK, BLOCK_T=BLOCK_T, PRECISION=DOT_PRECISION)
    _chunk_scores_kernel[(nchunks * blocks * blocks, batch * ngroups)](
        B, B_table, C, C_table, scores, seqlen, ngroups, d_state, *B.stride(), *C.stride(),
        BLOCK_N=block_n, **tiles)
    state_block_n = min(block_n, STATE_BLOCK_N)
    n_blocks = triton.cdiv(d_state, state_block_n)
    x_codes = torch.empty(x.shape, dtype=operand_dtype, device=device) if x.dtype == torch.int8 else x
    _chunk_state_kernel[(nchunks, batch * nheads, p_blocks * n_blocks)](
        x, x_table, dt, dt_scale, B, B_table, A, dt_bias, steps[0], steps[1], own_states, x_codes,
        seqlen, nheads, headdim, d_state, nheads // ngroups, padded_len, n_blocks, *x.stride(),
        *dt.stride(), *B.stride(), CHUNK_SIZE=CHUNK, BLOCK_T=STATE_BLOCK_T, BLOCK_P=block_p,
        BLOCK_N=state_block_n, DOT_DTYPE=dot_dtype, PRECISION=DOT_PRECISION,
        WRITES_CODES=x_codes is not x, num_warps=STATE_WARPS)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    state_size = headdim * d_state
    _state_passing_kernel[(batch * nheads, triton.cdiv(state_size, PASSING_BLOCK))](
        own_states, steps[1], own_states if initial_state is None else initial_state, carried,
        state, 1.0 if state_scale is None else fp32_reciprocal(float(state_scale)), nchunks,
        state_size, padded_len, CHUNK_SIZE=CHUNK, BLOCK=PASSING_BLOCK,
        HAS_INITIAL_STATE=initial_state is not None, INT8_FINAL=state_scale is not None)
    _chunk_scan_kernel[(nchunks * blocks, batch * nheads, p_blocks)](
        x_codes, x_table, scores, C, C_table, D, steps[0], steps[1], carried, y,
        seqlen, nheads, headdim, d_state, nheads // ngroups, padded_len, *x_codes.stride(),
        *C.stride(), *y.stride(), BLOCK_S=min(BLOCK_S, BLOCK_T), BLOCK_P=block_p, BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype, num_warps=SCAN_WARPS, **tiles)
    return y, state


def _launch_step(state, x, x_table, dt, dt_scale, B, B_table, C, C_table, A, D, dt_bias, out_dtype,
                 state_scale=None, param_scales=None):
    """y [batch, nheads, headdim] in out_dtype of one decode step; ``state`` (contiguous fp32, or
    int8 codes of ``state_scale``) stepped in place. A, D, dt_bias: fp32 [nheads], or with
    ``param_scales`` (three floats) the int8 codes of A_log, D and dt_bias."""
    batch, nheads, headdim = x.shape
    ngroups, d_state = B.shape[1], B.shape[2]
    int8_state = state.dtype == torch.int8
    if state.dtype not in (torch.float32, torch.int8) or not state.is_contiguous():
        raise ValueError("the SSD step kernel needs a contiguous fp32 or int8 state")
    if int8_state and state_scale is None:
        raise ValueError("an int8 SSD state needs its state_scale")
    scale = fp32_value(float(state_scale)) if int8_state else 1.0
    y = torch.empty(batch, nheads, headdim, dtype=out_dtype, device=x.device)
    block_p = min(_block(headdim),
                  STEP_BLOCK_P or (16 if batch * nheads < STEP_FEW_HEADS else 64))
    grid = (batch, nheads, triton.cdiv(headdim, block_p))
    pdl = backend.has_programmatic_launch(x.device)
    A_scale, D_scale, dt_bias_scale = (fp32_value(float(s)) for s in param_scales or (1.0,) * 3)
    _ssd_step_kernel[grid](
        state, scale, fp32_reciprocal(scale) if int8_state else 1.0, x, x_table, dt, dt_scale, B,
        B_table, C, C_table, A, A_scale, D, D_scale, dt_bias, dt_bias_scale, y, headdim, d_state,
        nheads // ngroups, *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        BLOCK_P=block_p, BLOCK_N=_block(d_state), INT8_STATE=int8_state,
        INT8_PARAMS=param_scales is not None, USE_PDL=pdl, launch_pdl=pdl)
    return y


def _params(params, device) -> tuple:
    """(A, D, dt_bias) fp32 [nheads] on ``device`` from the int8 SSM parameters."""
    def dequantized():
        return tuple(p.to(device).contiguous() for p in params.dequantized())
    return cached(params.A_log, (params.A_log_scale, params.D._version, params.D_scale,
                                 params.dt_bias._version, params.dt_bias_scale, device),
                  dequantized)


@backend.register("qssd_scan", "cuda", kernels=())
def _qssd_scan_cuda(x, x_scale, dt, dt_scale, B, B_scale, C, C_scale, params, chunk_size,
                    state_scale, out_dtype):
    x_table, B_table, C_table = _scale_tables(x, x_scale, B, B_scale, C, C_scale)
    return _launch_scan(x, x_table, dt, _scalar_scale(dt, dt_scale), B, B_table, C, C_table,
                        *_params(params, x.device), out_dtype, state_scale=state_scale)


@backend.register("qssd_state_update", "cuda", kernels=())
def _qssd_state_update_cuda(state, state_scale, x, x_scale, dt, dt_scale, B, B_scale, C, C_scale,
                            params, out_dtype):
    x_table, B_table, C_table = _scale_tables(x, x_scale, B, B_scale, C, C_scale)
    codes = (params.A_log, params.D, params.dt_bias)
    return _launch_step(state, x, x_table, dt, _scalar_scale(dt, dt_scale), B, B_table, C, C_table,
                        *(t.to(x.device).contiguous() for t in codes), out_dtype, state_scale,
                        param_scales=(params.A_log_scale, params.D_scale, params.dt_bias_scale))


def _fp32(*tensors):
    return [t.float().contiguous() for t in tensors]


# The FP model's SSD (quamba.ops.ssd.ssd) on the same kernels, unit scales: an optional FP kernel as
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
