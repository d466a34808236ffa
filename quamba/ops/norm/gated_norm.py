"""Mamba2's gated RMSNorm, ``weight · g / rms(g)`` with ``g = y · SiLU(z)`` and the RMS taken over
groups of channels: the torch reference op. On CUDA tensors it runs a Triton kernel
(quamba.ops.norm.gated_norm_triton), one program per row and group instead of the ten
elementwise and reduction kernels of the reference: at decode, a Mamba2 layer's norm is otherwise
a string of tiny launches."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quamba.ops import backend
from quamba.ops.quant import dequantize


def gated_rms_norm(y, z, weight, group_size: int, eps: float, z_scale=None, out_dtype=None,
                   backend_name=None):
    """y [..., dim] (float), z [..., dim] (float, or int8 codes of ``z_scale``), weight [dim] or
    None (ones: a weight folded into the next layer); the RMS over each ``group_size`` channels.
    Computed in fp32, returned in ``out_dtype`` (default y's dtype)."""
    if y.shape != z.shape:
        raise ValueError(f"gated_rms_norm: y {tuple(y.shape)} and z {tuple(z.shape)} differ")
    if y.shape[-1] % group_size:
        raise ValueError(f"gated_rms_norm: {y.shape[-1]} channels are not groups of {group_size}")
    if (z.dtype == torch.int8) != (z_scale is not None):
        raise ValueError("gated_rms_norm: int8 z needs its z_scale, float z takes none")
    impl = backend.select("gated_rms_norm", y.device, backend_name)
    return impl(y, z, weight, group_size, eps, z_scale, out_dtype or y.dtype)


@backend.register("gated_rms_norm", "torch")
def _gated_rms_norm_torch(y, z, weight, group_size, eps, z_scale, out_dtype):
    z = dequantize(z, z_scale) if z_scale is not None else z.float()
    gated = y.float() * F.silu(z)
    groups = gated.unflatten(-1, (-1, group_size))
    normed = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        normed = normed * weight.float()
    return normed.to(out_dtype)
