"""The norms inside the Mamba1 mixer: dt_low, B and C (x_proj's output, split) each divided by its
RMS over its own last dimension, as transformers computes them: in fp32, returned in the input's
dtype. Falcon-Mamba's have no weight (MambaConfig.mixer_rms_eps); Jamba's multiply the result by
a weight of their own (dt_layernorm, b_layernorm, c_layernorm; quamba.models.jamba).

Only the torch reference exists: on a GPU it runs as a few torch ops between the mixer's kernels,
and the backend registry warns once that no CUDA kernel implements ``mixer_rms_norm`` yet.
"""
from __future__ import annotations

import torch

from quamba.ops import backend


def mixer_rms_norm(dt_low, B, C, eps: float, backend_name=None, weights=None) -> tuple:
    """(dt_low, B, C), each normalized over its last dimension: x / sqrt(mean(x²) + eps), times
    its weight where ``weights`` gives the three (in that order)."""
    impl = backend.select("mixer_rms_norm", dt_low.device, backend_name)
    return impl(dt_low, B, C, eps, weights)


@backend.register("mixer_rms_norm", "torch", fp=True)
def _mixer_rms_norm_torch(dt_low, B, C, eps, weights=None):
    weights = (None, None, None) if weights is None else weights
    return tuple(_rms_norm(tensor, eps, weight) for tensor, weight in zip((dt_low, B, C), weights))


def _rms_norm(x, eps: float, weight=None):
    """As transformers' RMSNorm: normalized in fp32, cast back, then times the weight."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed
