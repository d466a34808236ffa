"""Quantized depthwise causal conv1d (+ bias, SiLU): int8 in, int8 (or fp32) out."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quamba.ops import backend
from quamba.ops.quant import dequantize, quantize, requant_multiplier

# The int8 conv kernels' limits (csrc/conv1d/qconv1d.cu): widths of check_conv_params, a prefill's
# batch in the grid's z dimension (check_conv_input), its seqlen in the y dimension, kRun = 16
# steps a block (run_qconv1d), and 32-bit element offsets.
KERNEL_WIDTHS = (2, 3, 4)
KERNEL_MAX_BATCH = 65535
KERNEL_MAX_SEQLEN = 65535 * 16
KERNEL_MAX_ELEMENTS = 2**31 - 1


def kernel_lacks(shape, width: int) -> str | None:
    """Why the int8 conv kernels cannot take x of ``shape`` ([batch, dim, seqlen], or [batch, dim]
    for a decode step) with a filter of ``width`` taps; None where they can."""
    if width not in KERNEL_WIDTHS:
        return f"its kernels take conv widths {KERNEL_WIDTHS}, not {width}"
    if math.prod(shape) > KERNEL_MAX_ELEMENTS:
        return f"its kernels take fewer than 2^31 elements, not {math.prod(shape)}"
    if len(shape) == 3 and shape[0] > KERNEL_MAX_BATCH:
        return f"its prefill kernels take a batch up to {KERNEL_MAX_BATCH}, not {shape[0]}"
    if len(shape) == 3 and shape[-1] > KERNEL_MAX_SEQLEN:
        return f"its prefill kernels take seqlen up to {KERNEL_MAX_SEQLEN}, not {shape[-1]}"
    return None


def silu(y: torch.Tensor) -> torch.Tensor:
    """SiLU as every quamba backend computes it in fp32: y / (1 + exp(-y))."""
    return y / (1.0 + torch.exp(-y))


def qconv1d(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale=None,
            activation: str | None = "silu", backend_name=None):
    """Causal depthwise conv of int8 codes with an exact integer accumulator.

    x: int8 [batch, dim, seqlen] (any strides); weight: int8 [dim, width] (width 2–4);
    bias: int8 [dim] or None. Per tensor scales (floats) for each.

        acc[b,d,t] = Σ_k weight[d,k] · x[b,d,t-width+1+k]       (int32, zeros before t = 0)
        y = fp32(acc) · requant_multiplier(x_scale, weight_scale) + fp32(bias[d]) · bias_scale
        y = silu(y)                                              (if activation == "silu")

    The multiply and the add are rounded separately (no FMA). Returns int8 ``quantize(y,
    out_scale)`` [batch, dim, seqlen], or fp32 y when ``out_scale`` is None (the fp32-conv mode).
    int8 outputs agree across backends to one step (exp differs by an ulp between libraries).
    """
    impl = backend.select("qconv1d", x.device, backend_name,
                          cuda_lacks=kernel_lacks(x.shape, weight.shape[-1]))
    return impl(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale, activation)


def qconv1d_update(x, conv_state, x_scale, weight, weight_scale, bias, bias_scale,
                   out_scale=None, activation: str | None = "silu", backend_name=None):
    """One decode step. x: int8 [batch, dim]; conv_state: int8 [batch, dim, width - 1] holding the
    previous inputs' codes (oldest first, scale x_scale), rolled in place. Same arithmetic as
    :func:`qconv1d`; returns int8 [batch, dim] (or fp32 if ``out_scale`` is None)."""
    impl = backend.select("qconv1d_update", x.device, backend_name,
                          cuda_lacks=kernel_lacks(x.shape, weight.shape[-1]))
    return impl(x, conv_state, x_scale, weight, weight_scale, bias, bias_scale, out_scale,
                activation)


def _epilogue(acc, x_scale, weight_scale, bias, bias_scale, out_scale, activation):
    y = acc.float() * requant_multiplier(x_scale, weight_scale)
    if bias is not None:
        y = y + dequantize(bias, bias_scale).view(-1, *([1] * (acc.dim() - 2)))
    if activation == "silu":
        y = silu(y)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return y if out_scale is None else quantize(y, out_scale)


@backend.register("qconv1d", "torch")
def _qconv1d_torch(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale, activation):
    dim, width = weight.shape
    # fp64 sums of int8 products are exact: this is the integer convolution.
    acc = F.conv1d(x.double(), weight.double().unsqueeze(1), padding=width - 1, groups=dim)
    acc = acc[..., :x.shape[-1]]
    return _epilogue(acc, x_scale, weight_scale, bias, bias_scale, out_scale, activation)


@backend.register("qconv1d_update", "torch")
def _qconv1d_update_torch(x, conv_state, x_scale, weight, weight_scale, bias, bias_scale,
                          out_scale, activation):
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    conv_state.copy_(window[..., 1:])
    acc = (window.int() * weight.int()).sum(-1)
    return _epilogue(acc, x_scale, weight_scale, bias, bias_scale, out_scale, activation)
