"""RMSNorm with the residual add in front (mamba_ssm's fused add-norm): the reference op. On CUDA
tensors the ``auto`` backend runs mamba-ssm's Triton kernel when installed (quamba.ops.fp_kernels)."""
from __future__ import annotations

import torch

from quamba.ops import backend, fp_kernels  # noqa: F401  fp_kernels registers the cuda kernel


def rms_norm(hidden, residual, weight, eps: float, residual_in_fp32: bool, backend_name=None):
    """``(normed, residual_out)``: residual_out = hidden + residual (residual None: hidden), fp32 if
    ``residual_in_fp32`` else hidden's dtype; normed = weight · residual_out / rms(residual_out),
    computed in fp32 and returned in hidden's dtype."""
    impl = backend.select("rms_norm", hidden.device, backend_name)
    return impl(hidden, residual, weight, eps, residual_in_fp32)


@backend.register("rms_norm", "torch")
def _rms_norm_torch(hidden, residual, weight, eps, residual_in_fp32):
    out_dtype = hidden.dtype
    residual = hidden.float() if residual is None else hidden.float() + residual.float()
    normed = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed * weight.float()).to(out_dtype)
    return normed, (residual if residual_in_fp32 else residual.to(out_dtype))
