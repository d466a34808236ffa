"""Fused residual add + RMSNorm → int8 (the quantized block input)."""
from __future__ import annotations

import torch

from quamba.ops import backend
from quamba.ops.quant import quantize


def rmsnorm_quant(x, residual, weight, eps: float, out_scale, residual_in_fp32: bool = True,
                  backend_name=None):
    """x: [..., dim] float (fp16/bf16/fp32); residual: same shape or None; weight: [dim] or None
    (None once the norm weight is folded into in_proj by the rotation).

        r = fp32(x) + fp32(residual)
        q = quantize(r · rsqrt(mean(r²) + eps) · weight, out_scale)

    Returns ``(q, residual_out)``: q int8 [..., dim]; residual_out = r in fp32 if
    ``residual_in_fp32`` else in x's dtype. int8 outputs agree across backends to one step (the
    order of the fp32 sum of squares differs)."""
    impl = backend.select("rmsnorm_quant", x.device, backend_name)
    return impl(x, residual, weight, eps, out_scale, residual_in_fp32)


@backend.register("rmsnorm_quant", "torch")
def _rmsnorm_quant_torch(x, residual, weight, eps, out_scale, residual_in_fp32):
    r = x.float() if residual is None else x.float() + residual.float()
    normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    return quantize(normed, out_scale), (r if residual_in_fp32 else r.to(x.dtype))
