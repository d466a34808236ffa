"""The norms inside the Mamba1 mixer: dt_low, B and C (x_proj's output, split) each divided by its
RMS over its own last dimension, as transformers computes them: in fp32, returned in the input's
dtype. Falcon-Mamba's have no weight (MambaConfig.mixer_rms_eps); Jamba's multiply the result by
a weight of their own (dt_layernorm, b_layernorm, c_layernorm; quamba.models.jamba).

The quantized mixer asks for the int8 codes of the results (``out_scale``), which dt_proj and
the scan take. On CUDA tensors the three norms, and their codes, run as one Triton kernel
(quamba.ops.norm.mixer_norm_triton): one launch rather than a dozen small torch ops between the
mixer's kernels at decode.
"""
from __future__ import annotations

import torch

from quamba.ops import backend
from quamba.ops.quant import quantize

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def mixer_rms_norm(dt_low, B, C, eps: float, backend_name=None, weights=None,
                   out_scale: float | None = None) -> tuple:
    """(dt_low, B, C), each normalized over its last dimension: x / sqrt(mean(x²) + eps), times
    its weight where ``weights`` gives the three (in that order); with ``out_scale``, the int8
    codes of those results for that per-tensor scale (quamba.ops.quant.quantize)."""
    impl = backend.select("mixer_rms_norm", dt_low.device, backend_name,
                          cuda_lacks=kernel_lacks((dt_low, B, C), weights))
    return impl(dt_low, B, C, eps, weights, out_scale)


def kernel_lacks(parts, weights) -> str | None:
    """Why the kernel, which writes the three results into one buffer of one dtype, cannot take
    these tensors (None when it can)."""
    if len({part.dtype for part in parts}) > 1:
        return "dt_low, B and C differ in dtype"
    if parts[0].dtype not in KERNEL_DTYPES:
        return f"the kernel takes fp32, fp16 or bf16, not {parts[0].dtype}"
    if len({part.shape[:-1] for part in parts}) > 1:
        return "dt_low, B and C differ in their leading dimensions"
    if weights is not None and len({weight.dtype for weight in weights}) > 1:
        return "the three norm weights differ in dtype"
    return None


@backend.register("mixer_rms_norm", "torch")
def _mixer_rms_norm_torch(dt_low, B, C, eps, weights=None, out_scale=None):
    weights = (None, None, None) if weights is None else weights
    normed = (_rms_norm(tensor, eps, weight) for tensor, weight in zip((dt_low, B, C), weights))
    if out_scale is None:
        return tuple(normed)
    return tuple(quantize(part, out_scale) for part in normed)


def _rms_norm(x, eps: float, weight=None):
    """As transformers' RMSNorm: normalized in fp32, cast back, then times the weight."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed
