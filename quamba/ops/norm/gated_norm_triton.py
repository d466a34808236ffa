"""Mamba2's gated RMSNorm (quamba.ops.norm.gated_norm) in Triton: one program per (row, group) loads
y and z (int8 z dequantized on load; rows of either may be strided), gates, normalizes and scales
in fp32."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quamba.ops import backend
from quamba.ops.quant import fp32_value


@triton.jit
def _gated_rms_norm_kernel(y_ptr, y_row_stride, z_ptr, z_row_stride, z_scale, weight_ptr, out_ptr,
                           dim, group_size, eps, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = c < (tl.program_id(1) + 1) * group_size
    y = tl.load(y_ptr + row * y_row_stride + c, mask=mask, other=0).to(tl.float32)
    z = tl.load(z_ptr + row * z_row_stride + c, mask=mask, other=0).to(tl.float32) * z_scale
    gated = y * z * tl.sigmoid(z)
    normed = gated * tl.rsqrt(tl.sum(gated * gated, axis=0) / group_size + eps)
    if HAS_WEIGHT:
        normed *= tl.load(weight_ptr + c, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + row * dim + c, normed.to(out_ptr.dtype.element_ty), mask=mask)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, dim] with unit stride along dim (a view where one exists: z is a slice of
    in_proj's output)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@backend.register("gated_rms_norm", "cuda", kernels=())
def _gated_rms_norm_cuda(y, z, weight, group_size, eps, z_scale, out_dtype):
    dim = y.shape[-1]
    y_rows, z_rows = as_rows(y), as_rows(z)
    out = torch.empty(y_rows.shape, dtype=out_dtype, device=y.device)
    block = triton.next_power_of_2(group_size)
    grid = (y_rows.shape[0], dim // group_size)
    _gated_rms_norm_kernel[grid](
        y_rows, y_rows.stride(0), z_rows, z_rows.stride(0),
        1.0 if z_scale is None else fp32_value(float(z_scale)),
        out if weight is None else weight.contiguous(), out, dim, group_size, eps,
        BLOCK=block, HAS_WEIGHT=weight is not None, num_warps=min(16, max(1, block // 512)))
    return out.view(y.shape)
