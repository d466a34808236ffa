"""The exported linears as quamba computes them, for quamba.export.reference_model."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from quamba.layers.qlinear import W8A8Linear
from quamba.ops.linear.input_quant import per_token_scales
from quamba.ops.quant import dequantize, fake_quantize

PER_TOKEN = "per-token"


class ExportedLinear(nn.Module):
    """y = q(x) · Wᵀ in fp32: W the quantized linear's dequantized weight, q the fake
    quantization of x with its static input scale or, ``in_scale`` PER_TOKEN, with each
    token's absmax / 127 as quamba's QInputLinear computes it (W8A8), or the identity
    (W4A16)."""

    def __init__(self, weight: torch.Tensor, in_scale: float | str | None):
        super().__init__()
        self.register_buffer("weight", weight.float())
        self.in_scale = in_scale

    @classmethod
    def of(cls, linear, dynamic: bool = False) -> "ExportedLinear":
        if isinstance(linear, W8A8Linear):
            weight = dequantize(linear.weight, linear.scales["weight_scale"])
            return cls(weight, PER_TOKEN if dynamic else linear.scales["in_scale"])
        return cls(linear.dequantized_weight(), None)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_scale is None:
            return x.float()
        scale = per_token_scales(x) if self.in_scale == PER_TOKEN else self.in_scale
        return fake_quantize(x, scale)

    def forward(self, x):
        return F.linear(self._input(x), self.weight).to(x.dtype)

    def forward_channel_major(self, x):
        """W · xᵀ: [out, M] for x [M, in] (the FP mixer's in_proj path)."""
        return (self.weight @ self._input(x).t()).to(x.dtype)
