"""Quantized linear layers: W8A8 (int8 weights, per-tensor scale), W4A8 (4-bit grouped weights,
int8 activations) and W4A16 (4-bit grouped weights, float activations)."""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.base import QuantModule
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.ops.linear.qlinear4 import w4a8_linear, w4a16_linear, w4a16_linear_channel_major
from quamba.ops.quant import dequantize, fake_quantize, quantize_weight
from quamba.ops.quant4 import (
    dequantize_int4,
    effective_scales,
    group_size_for,
    pack_int4,
    quantize_weight_w4a8,
    quantize_weight_w4a16,
)


def register_out_scale(layer: QuantModule, out_scale) -> None:
    """The int8 output scale of a linear layer: a float (per tensor, a registered scale), an fp32
    tensor [out] (per output channel, a buffer: Quamba2's per-segment scales of in_proj's output),
    or None for a float output."""
    layer.int8_out = out_scale is not None
    if isinstance(out_scale, torch.Tensor):
        layer.register_buffer("out_scale", out_scale.detach().float().clone())
    elif layer.int8_out:
        layer.register_scale("out_scale", out_scale)


def output_scale(layer: QuantModule):
    """What :func:`register_out_scale` registered: a float, an fp32 tensor, or None."""
    if not layer.int8_out:
        return None
    if "out_scale" in layer.scales:
        return layer.scales["out_scale"]
    return layer.out_scale


class W8A8Linear(QuantModule):
    """y = x · Wᵀ with int8 x (scale ``in_scale``) and int8 W; int8 out (scale ``out_scale``) or a
    float out (``out_scale`` None). In float-sim mode x and y are fake-quantized fp32 tensors.
    ``per_channel`` gives W one fp32 scale per output channel (a buffer [out]; the int8 lm_head)
    instead of one per tensor."""

    def __init__(self, in_features: int, out_features: int, in_scale: float,
                 out_scale: float | None, out_dtype=torch.float16, device=None,
                 per_channel: bool = False):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                   device=device))
        self.per_channel = per_channel
        if per_channel:
            self.register_buffer("weight_scale", torch.ones(out_features, device=device))
        else:
            self.register_scale("weight_scale", 1.0)
        self.register_scale("in_scale", in_scale)
        register_out_scale(self, out_scale)
        self.out_dtype = out_dtype

    def load_float_weight(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` [out, in] per tensor (per output channel if ``per_channel``)."""
        codes, scale = quantize_weight(weight, per_channel=self.per_channel)
        self.weight.copy_(codes)
        if self.per_channel:
            self.weight_scale.copy_(scale)
        else:
            self.weight_scale.fill_(scale)
        self.refresh_scales()

    def _weight_scale(self):
        """The float per-tensor scale, or the fp32 [out] tensor of a per-channel layer."""
        return self.weight_scale if self.per_channel else self.scales["weight_scale"]

    def forward(self, x):
        s = self.scales
        out_scale = output_scale(self)
        if self.simulate:
            scale = self._weight_scale()
            scale = scale[:, None] if self.per_channel else scale
            y = x.float() @ dequantize(self.weight, scale).t()
            return fake_quantize(y, out_scale) if self.int8_out else y.to(self.out_dtype)
        return w8a8_linear(x, s["in_scale"], self.weight, self._weight_scale(), out_scale,
                           out_dtype=self.out_dtype, backend_name=self.backend)

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, "
                f"per_channel={self.per_channel}, "
                f"output={'int8' if self.int8_out else self.out_dtype}")


class W4A8Linear(QuantModule):
    """y = x · Wᵀ with int8 x and 4-bit W in groups along the input (quamba.ops.quant4: packed
    codes, int8 group multipliers, fp32 channel scales); int8 or float output as W8A8Linear."""

    def __init__(self, in_features: int, out_features: int, in_scale: float,
                 out_scale: float | None, out_dtype=torch.float16, group_size: int = 128,
                 device=None):
        super().__init__()
        self.group_size = group_size_for(in_features, group_size)
        groups = in_features // self.group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2,
                                                   dtype=torch.uint8, device=device))
        self.register_buffer("group_multiplier", torch.ones(out_features, groups,
                                                            dtype=torch.int8, device=device))
        self.register_buffer("channel_scale", torch.ones(out_features, device=device))
        self.register_scale("in_scale", in_scale)
        register_out_scale(self, out_scale)
        self.out_dtype = out_dtype

    def load_float_weight(self, weight: torch.Tensor, codes: torch.Tensor | None = None) -> None:
        """Quantize ``weight`` [out, in] with round-to-nearest, or store ``codes`` (e.g. from GPTQ,
        taken against this weight's two-level scales)."""
        packed, multiplier, channel_scale, _ = quantize_weight_w4a8(weight, self.group_size)
        self.weight.copy_(packed if codes is None else pack_int4(codes))
        self.group_multiplier.copy_(multiplier)
        self.channel_scale.copy_(channel_scale)

    def group_scales(self) -> torch.Tensor:
        """fp32 [out, in / group]: the scales the codes are taken against (channel × group)."""
        return effective_scales(self.channel_scale, self.group_multiplier)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int4(self.weight, self.group_scales(), self.group_size)

    def forward(self, x):
        s = self.scales
        out_scale = output_scale(self)
        if self.simulate:
            y = x.float() @ self.dequantized_weight().t()
            return fake_quantize(y, out_scale) if self.int8_out else y.to(self.out_dtype)
        return w4a8_linear(x.contiguous(), s["in_scale"], self.weight, self.group_multiplier,
                           self.channel_scale, self.group_size, out_scale, self.out_dtype,
                           backend_name=self.backend)

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[1] * 2}, out={self.weight.shape[0]}, "
                f"group={self.group_size}, output={'int8' if self.int8_out else self.out_dtype}")


class W4A16Linear(nn.Module):
    """Weight-only y = x · Wᵀ: float x [..., K], 4-bit W in groups along the input with fp16
    group scales (quamba.ops.quant4), fp32 accumulation, y in x's dtype. It has no activation
    scales and no SSM mode; ``backend`` picks the op implementation (None: the default)."""

    def __init__(self, in_features: int, out_features: int, group_size: int = 128, device=None):
        super().__init__()
        self.group_size = group_size_for(in_features, group_size)
        groups = in_features // self.group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2,
                                                   dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16,
                                                  device=device))
        self.backend: str | None = None

    def load_float_weight(self, weight: torch.Tensor, codes: torch.Tensor | None = None) -> None:
        """Quantize ``weight`` [out, in] with round-to-nearest, or store ``codes`` (e.g. from GPTQ,
        taken against this weight's fp16 group scales)."""
        packed, scales, _ = quantize_weight_w4a16(weight, self.group_size)
        self.weight.copy_(packed if codes is None else pack_int4(codes))
        self.scales.copy_(scales)

    def group_scales(self) -> torch.Tensor:
        """fp32 [out, in / group]: the scales the codes are taken against."""
        return self.scales.float()

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int4(self.weight, self.scales, self.group_size)

    def forward(self, x):
        return w4a16_linear(x, self.weight, self.scales, self.group_size, backend_name=self.backend)

    def forward_channel_major(self, x):
        """W · xᵀ: [out, M] for x [M, in], the transpose of ``forward(x)``; no hooks run."""
        return w4a16_linear_channel_major(x, self.weight, self.scales, self.group_size,
                                          backend_name=self.backend)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1] * 2}, out={self.weight.shape[0]}, group={self.group_size}"
