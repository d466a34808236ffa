"""W8A8 linear layer: int8 weight codes with a per-tensor scale."""
from __future__ import annotations

import torch

from quamba.layers.base import QuantModule
from quamba.ops.qlinear import w8a8_linear
from quamba.ops.quant import dequantize, fake_quantize, quantize_weight


class W8A8Linear(QuantModule):
    """y = x · Wᵀ with int8 x (scale ``in_scale``) and int8 W; int8 out (scale ``out_scale``) or a
    float out (``out_scale`` None). In float-sim mode x and y are fake-quantized fp32 tensors."""

    def __init__(self, in_features: int, out_features: int, in_scale: float,
                 out_scale: float | None, out_dtype=torch.float16, device=None):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                   device=device))
        self.register_scale("weight_scale", 1.0)
        self.register_scale("in_scale", in_scale)
        self.int8_out = out_scale is not None
        if self.int8_out:
            self.register_scale("out_scale", out_scale)
        self.out_dtype = out_dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, in_scale: float, out_scale: float | None,
                   out_dtype=torch.float16):
        layer = cls(weight.shape[1], weight.shape[0], in_scale, out_scale, out_dtype, weight.device)
        codes, scale = quantize_weight(weight)
        layer.weight.copy_(codes)
        layer.weight_scale.fill_(scale)
        layer.refresh_scales()
        return layer

    def forward(self, x):
        s = self.scales
        out_scale = s["out_scale"] if self.int8_out else None
        if self.simulate:
            y = x.float() @ dequantize(self.weight, s["weight_scale"]).t()
            return fake_quantize(y, out_scale) if self.int8_out else y.to(self.out_dtype)
        return w8a8_linear(x.contiguous(), s["in_scale"], self.weight, s["weight_scale"], out_scale,
                           out_dtype=self.out_dtype, backend_name=self.backend)

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, "
                f"output={'int8' if self.int8_out else self.out_dtype}")
