"""Residual add + RMSNorm → int8: the quantized block input."""
from __future__ import annotations

import torch

from quamba.layers.base import QuantModule
from quamba.ops.norm.qnorm import rmsnorm_quant
from quamba.ops.quant import dequantize


class QRMSNorm(QuantModule):
    """``forward(hidden, residual) -> (codes, residual)``, the interface of the FP RMSNorm, with
    int8 codes (scale ``out_scale``) in place of the normed tensor; fake-quantized fp32 values in
    float-sim mode. ``weight`` is None once the rotation folded it into in_proj."""

    def __init__(self, dim: int, eps: float, residual_in_fp32: bool, out_scale: float,
                 has_weight: bool, device=None):
        super().__init__()
        self.eps = eps
        self.residual_in_fp32 = residual_in_fp32
        self.register_buffer("weight", torch.ones(dim, device=device) if has_weight else None)
        self.register_scale("out_scale", out_scale)

    def forward(self, hidden, residual=None):
        backend_name = "torch" if self.simulate else self.backend
        codes, residual = rmsnorm_quant(hidden, residual, self.weight, self.eps,
                                        self.scales["out_scale"], self.residual_in_fp32,
                                        backend_name=backend_name)
        if self.simulate:
            return dequantize(codes, self.scales["out_scale"]), residual
        return codes, residual
