"""Quantized linears of the hybrids' attention, MLP and MoE layers
(quamba.models.transformer_layers): each nn.Linear becomes a W8A8 / W4A8 linear behind an int8
quantizer of its float input (QInputLinear), or a W4A16Linear. The layers' own forwards (RoPE in
float after q_proj and k_proj), the KV cache (float, the model dtype) and the MoE routers (fp32
TopkRouter; Granite's nn.Linear router, FLOAT_LINEARS) stay as they are.

Input scales: static per tensor from calibration, except down_proj's input (relu² or SwiGLU
outputs, large range), quantized per token at run time (DYNAMIC_INPUTS). Both quantizers are ops
of quamba.ops.linear.input_quant (one Triton kernel each on a GPU); the GEMM after a per-token
one is the W8A8 / W4A8 kernel with an input scale of 1, its fp32 output times each token's scale.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.base import QuantModule
from quamba.layers.qlinear import W4A8Linear, W4A16Linear, W8A8Linear
from quamba.models.state import AttentionState
from quamba.models.transformer_layers import MLP, Attention, GatedMLP, GraniteMoE, MoE
from quamba.ops.linear.input_quant import per_token_scales, quantize_per_tensor, quantize_per_token
from quamba.ops.quant import fake_quantize, scale_from_range

# The hybrid layers whose nn.Linear modules quantize_linears_ replaces
TRANSFORMER_LAYERS = (Attention, MLP, GatedMLP, MoE, GraniteMoE)
# nn.Linear modules left float and uncalibrated (by the end of the name): Granite's router
FLOAT_LINEARS = ("router",)
# Linears whose input is quantized per token at run time (by the end of the name)
DYNAMIC_INPUTS = ("down_proj",)
# Linears that read the layer's normed input (their static scale is the layer's "in_proj.input")
LAYER_INPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def quantized_linears(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of each nn.Linear of ``layer`` that quantize_linears_ replaces."""
    return [(name, module) for name, module in layer.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in FLOAT_LINEARS]


def is_dynamic(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in DYNAMIC_INPUTS


def input_kind(name: str) -> str:
    """The calibrated kind whose range gives linear ``name``'s static input scale."""
    return "in_proj.input" if name.rsplit(".", 1)[-1] in LAYER_INPUTS else f"{name}.input"


class QInputLinear(QuantModule):
    """int8 quantizer of a float input (static: the inner linear's in_scale; ``dynamic``: absmax
    per token) → W8A8Linear or W4A8Linear (float output: the model dtype, fp32 if ``dynamic``)
    → the input's dtype."""

    def __init__(self, linear: QuantModule, dynamic: bool):
        super().__init__()
        self.linear, self.dynamic = linear, dynamic

    def forward(self, x):
        if self.simulate:
            scale = per_token_scales(x) if self.dynamic else self.linear.scales["in_scale"]
            return self.linear(fake_quantize(x, scale)).to(x.dtype)
        if self.dynamic:
            codes, scales = quantize_per_token(x, backend_name=self.backend)
            return (self.linear(codes) * scales).to(x.dtype)
        codes = quantize_per_tensor(x, self.linear.scales["in_scale"], backend_name=self.backend)
        return self.linear(codes).to(x.dtype)

    def extra_repr(self) -> str:
        return f"input={'per-token dynamic' if self.dynamic else 'static'}"


def empty_linear(fp_linear: nn.Linear, name: str, w_bits: int, a_bits: int, group_size: int,
                 in_scale: float = 1.0) -> nn.Module:
    """The quantized form of ``fp_linear`` (named ``name`` in its layer), weights still zero."""
    shape = (fp_linear.in_features, fp_linear.out_features)
    device, dynamic = fp_linear.weight.device, is_dynamic(name)
    if a_bits == 16:
        return W4A16Linear(*shape, group_size, device)
    # a dynamic input's GEMM writes fp32 (then times each token's scale), a static one the
    # model dtype
    in_scale, out_dtype = (1.0, torch.float32) if dynamic else (in_scale, fp_linear.weight.dtype)
    if w_bits == 4:
        linear = W4A8Linear(*shape, in_scale, None, out_dtype, group_size, device)
    else:
        linear = W8A8Linear(*shape, in_scale, None, out_dtype, device)
    return QInputLinear(linear, dynamic)


class QAttention(Attention):
    """Attention with quantized linears: its KV cache in ``kv_dtype`` (the model's float dtype),
    which its int8 weights no longer tell."""

    def allocate_state(self, batch_size: int, device=None) -> AttentionState:
        device = device or next(self.buffers()).device
        empty = torch.zeros(batch_size, self.num_kv_heads, 0, self.head_dim, device=device,
                            dtype=self.kv_dtype)
        return AttentionState(key=empty, value=empty.clone())


def quantize_linears_(layer: nn.Module, w_bits: int, a_bits: int, group_size: int,
                      ranges: dict | None = None, load: bool = True) -> nn.Module:
    """Replace every nn.Linear of ``layer`` (attention, MLP or MoE) but a router
    (quantized_linears) in place by its quantized form, its weights quantized if ``load``, its
    static input scales from ``ranges`` (the layer's calibrated clipping ranges; None for W4A16
    or an empty layer)."""
    if isinstance(layer, Attention):
        layer.__class__, layer.kv_dtype = QAttention, layer.k_proj.weight.dtype
    for name, fp_linear in quantized_linears(layer):
        if fp_linear.bias is not None:
            raise ValueError(f"{name}: quantized linears of hybrid layers take no bias")
        scale = 1.0
        if ranges is not None and a_bits != 16 and not is_dynamic(name):
            scale = scale_from_range(ranges[input_kind(name)])
        linear = empty_linear(fp_linear, name, w_bits, a_bits, group_size, scale)
        if load:
            inner = linear if a_bits == 16 else linear.linear
            inner.load_float_weight(fp_linear.weight.detach())
        layer.set_submodule(name, linear)
    return layer
