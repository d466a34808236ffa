"""The int8 conv ops on the kernels of ``quamba._C`` (csrc/conv1d): ``qconv1d``, ``qconv1d_update``,
and their per-channel-scale variants ``qconv1d_channelwise`` and ``qconv1d_channelwise_update``
(Mamba2's xBC), with the torch references' signatures (quamba.ops.conv.qconv1d).

Every fp32 constant a kernel applies (epilogue multiplier, reciprocal of an output scale) is
computed here by the functions of :mod:`quamba.ops.quant` that the references use, so both
backends multiply by the same numbers.

Layouts: the kernels read [batch, dim, seqlen] inputs with any strides (coalesced when the time or
the channel dimension has stride 1) and return outputs in their input's layout family:
channel-last (a transposed [batch, seqlen, dim] tensor) when ``x`` has ``stride(1) == 1``, else
contiguous.
"""
from __future__ import annotations

import torch

import quamba._C  # noqa: F401  loads torch.ops.quamba.*
from quamba.ops import backend
from quamba.ops.constants import cached, reciprocal_or_none, scale_float
from quamba.ops.quant import fp32_multiplier, fp32_value, reciprocal, requant_multiplier


def _silu_flag(activation) -> bool:
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return activation == "silu"


def _conv_constants(x_scale, weight_scale, bias, bias_scale, out_scale):
    multiplier = fp32_multiplier(scale_float(x_scale), scale_float(weight_scale))
    bias_scale32 = fp32_value(scale_float(bias_scale)) if bias is not None else 1.0
    return multiplier, bias_scale32, reciprocal_or_none(out_scale)


@backend.register("qconv1d", "cuda")
def _qconv1d_cuda(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale, activation):
    silu = _silu_flag(activation)
    multiplier, bias_scale32, out_inv = _conv_constants(x_scale, weight_scale, bias, bias_scale,
                                                        out_scale)
    return torch.ops.quamba.qconv1d(x, weight, bias, multiplier, bias_scale32, out_inv, silu)


@backend.register("qconv1d_update", "cuda")
def _qconv1d_update_cuda(x, conv_state, x_scale, weight, weight_scale, bias, bias_scale,
                         out_scale, activation):
    silu = _silu_flag(activation)
    multiplier, bias_scale32, out_inv = _conv_constants(x_scale, weight_scale, bias, bias_scale,
                                                        out_scale)
    return torch.ops.quamba.qconv1d_update(x, conv_state, weight, bias, multiplier, bias_scale32,
                                           out_inv, silu)


def _channel_conv_constants(x_scale, weight_scale, out_scale, device):
    """(multipliers fp32 [dim], out_inv_scales fp32 [dim] or None) on ``device``, computed by the
    reference's functions, kept per version of the scale tensors (quamba.ops.constants)."""
    def make():
        multipliers = requant_multiplier(x_scale.float(), weight_scale).to(device).contiguous()
        out_inv = None if out_scale is None else reciprocal(out_scale).to(device).contiguous()
        return multipliers, out_inv
    if out_scale is not None and out_scale.is_inference():
        return make()
    out_key = None if out_scale is None else (id(out_scale), out_scale._version)
    return cached(x_scale, (out_key, float(weight_scale), device), make)


@backend.register("qconv1d_channelwise", "cuda")
def _qconv1d_channelwise_cuda(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale,
                              activation):
    silu = _silu_flag(activation)
    multipliers, out_inv = _channel_conv_constants(x_scale, weight_scale, out_scale, x.device)
    bias_scale32 = fp32_value(scale_float(bias_scale)) if bias is not None else 1.0
    return torch.ops.quamba.qconv1d_channelwise(x, weight, bias, multipliers, bias_scale32,
                                                out_inv, silu)


@backend.register("qconv1d_channelwise_update", "cuda")
def _qconv1d_channelwise_update_cuda(x, conv_state, x_scale, weight, weight_scale, bias,
                                     bias_scale, out_scale, activation):
    silu = _silu_flag(activation)
    multipliers, out_inv = _channel_conv_constants(x_scale, weight_scale, out_scale, x.device)
    bias_scale32 = fp32_value(scale_float(bias_scale)) if bias is not None else 1.0
    return torch.ops.quamba.qconv1d_channelwise_update(x, conv_state, weight, bias, multipliers,
                                                       bias_scale32, out_inv, silu)
