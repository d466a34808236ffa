"""The norms of dt_low, B and C (quamba.ops.norm.mixer_norm) in Triton: one launch for all three,
one program per (row, segment). Each program loads its segment of the row (strided rows: the
segments are slices of x_proj's output), normalizes in fp32, rounds to the input's dtype as the
reference does, multiplies by the weight in fp32 where there is one (the product of two 16-bit
floats is exact in fp32, so that multiplication rounds as torch's does), rounds to the result's
float dtype and writes its segment of one output buffer, returned as three views: the floats, or
their int8 codes (quamba.ops.quant's rule, quamba.ops.quant_triton) for ``out_scale``.

Against the torch reference: the sum of squares is reduced in another order and rsqrt is the
GPU's approximation, so fp32 results differ by a few fp32 ulps, and fp16 / bf16 results by at
most one ulp of their dtype where the fp32 value lies next to a rounding boundary; elsewhere they
are equal. The codes are the reference's codes of the kernel's floats: equal where the floats
are, else at most one int8 step apart."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quamba.ops import backend
from quamba.ops.norm.gated_norm_triton import as_rows
from quamba.ops.quant import fp32_reciprocal
from quamba.ops.quant_triton import int8_codes

TRITON_FLOATS = {torch.float32: tl.float32, torch.float16: tl.float16,
                 torch.bfloat16: tl.bfloat16}


@triton.jit
def _normalize_segment(in_ptr, in_row_stride, weight_ptr, out_ptr, out_row_stride, row, width,
                       eps, inverse, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                       FLOAT: tl.constexpr, INT8_OUT: tl.constexpr):
    c = tl.arange(0, BLOCK)
    mask = c < width
    x = tl.load(in_ptr + row * in_row_stride + c, mask=mask, other=0).to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    normed = (x * inverse_rms).to(in_ptr.dtype.element_ty)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + c, mask=mask, other=0).to(tl.float32)
        normed = normed.to(tl.float32) * weight
    result = normed.to(FLOAT)
    if INT8_OUT:
        result = int8_codes(result.to(tl.float32), inverse)
    tl.store(out_ptr + row * out_row_stride + c, result, mask=mask)


@triton.jit
def _mixer_rms_norm_kernel(dt_ptr, dt_row_stride, b_ptr, b_row_stride, c_ptr, c_row_stride,
                           dt_weight_ptr, b_weight_ptr, c_weight_ptr, out_ptr, dt_rank, d_state,
                           eps, inverse, BLOCK_DT: tl.constexpr, BLOCK_STATE: tl.constexpr,
                           HAS_WEIGHT: tl.constexpr, FLOAT: tl.constexpr,
                           INT8_OUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    out_row_stride = dt_rank + 2 * d_state
    if segment == 0:
        _normalize_segment(dt_ptr, dt_row_stride, dt_weight_ptr, out_ptr, out_row_stride, row,
                           dt_rank, eps, inverse, BLOCK_DT, HAS_WEIGHT, FLOAT, INT8_OUT)
    elif segment == 1:
        _normalize_segment(b_ptr, b_row_stride, b_weight_ptr, out_ptr + dt_rank, out_row_stride,
                           row, d_state, eps, inverse, BLOCK_STATE, HAS_WEIGHT, FLOAT, INT8_OUT)
    else:
        _normalize_segment(c_ptr, c_row_stride, c_weight_ptr, out_ptr + dt_rank + d_state,
                           out_row_stride, row, d_state, eps, inverse, BLOCK_STATE, HAS_WEIGHT,
                           FLOAT, INT8_OUT)


@backend.register("mixer_rms_norm", "cuda", kernels=())
def _mixer_rms_norm_cuda(dt_low, B, C, eps, weights=None, out_scale=None):
    dt_rank, d_state = dt_low.shape[-1], B.shape[-1]
    dt_rows, b_rows, c_rows = as_rows(dt_low), as_rows(B), as_rows(C)
    float_dtype = dt_low.dtype if weights is None else torch.promote_types(dt_low.dtype,
                                                                           weights[0].dtype)
    out = torch.empty(dt_rows.shape[0], dt_rank + 2 * d_state, device=dt_low.device,
                      dtype=float_dtype if out_scale is None else torch.int8)
    dt_weight, b_weight, c_weight = ((out, out, out) if weights is None
                                     else tuple(weight.contiguous() for weight in weights))
    if out.numel():
        _mixer_rms_norm_kernel[(dt_rows.shape[0], 3)](
            dt_rows, dt_rows.stride(0), b_rows, b_rows.stride(0), c_rows, c_rows.stride(0),
            dt_weight, b_weight, c_weight, out, dt_rank, d_state, eps,
            1.0 if out_scale is None else fp32_reciprocal(float(out_scale)),
            BLOCK_DT=triton.next_power_of_2(dt_rank),
            BLOCK_STATE=triton.next_power_of_2(d_state), HAS_WEIGHT=weights is not None,
            FLOAT=TRITON_FLOATS[float_dtype], INT8_OUT=out_scale is not None)
    parts = out.view(*dt_low.shape[:-1], out.shape[1]).split([dt_rank, d_state, d_state], dim=-1)
    return tuple(parts)
