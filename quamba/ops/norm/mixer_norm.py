"""Falcon-Mamba's norms inside the Mamba1 mixer: dt_low, B and C (x_proj's output, split) each
divided by its RMS over its own last dimension, with no weight (MambaConfig.mixer_rms_eps), as
transformers' FalconMambaMixer computes them: in fp32, returned in the input's dtype.

Only the torch reference exists: on a GPU it runs as a few torch ops between the mixer's kernels,
and the backend registry warns once that no CUDA kernel implements ``mixer_rms_norm`` yet.
"""
from __future__ import annotations

import torch

from quamba.ops import backend


def mixer_rms_norm(dt_low, B, C, eps: float, backend_name=None) -> tuple:
    """(dt_low, B, C), each normalized over its last dimension: x / sqrt(mean(x²) + eps)."""
    impl = backend.select("mixer_rms_norm", dt_low.device, backend_name)
    return impl(dt_low, B, C, eps)


@backend.register("mixer_rms_norm", "torch", fp=True)
def _mixer_rms_norm_torch(dt_low, B, C, eps):
    return tuple(_weightless_rms_norm(tensor, eps) for tensor in (dt_low, B, C))


def _weightless_rms_norm(x, eps: float):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
