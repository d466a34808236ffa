"""Quantized linears of the hybrids' attention, MLP and MoE layers
(quamba.models.transformer_layers): each nn.Linear becomes a W8A8 / W4A8 linear behind an int8
quantizer of its float input (QInputLinear), or a W4A16Linear. The layers' own forwards (RoPE in
float after q_proj and k_proj), the KV cache (float, the model dtype) and the MoE routers (fp32
TopkRouter; Granite's nn.Linear router, FLOAT_LINEARS) stay as they are.

Input scales: static per tensor from calibration, except down_proj's input (relu² or SwiGLU
outputs, large range), quantized per token at run time (DYNAMIC_INPUTS; a family's config may
name others: Jamba's and Falcon-H1's add o_proj). Both quantizers are ops of
quamba.ops.linear.input_quant (one Triton kernel each on a GPU); the GEMM after a per-token one
is the W8A8 / W4A8 kernel with an input scale of 1, its fp32 output times each token's scale and
rounded to the model dtype in one elementwise kernel. A quantized MLP hands its activation (QMLP:
relu², QGatedMLP: SwiGLU) to the per-token quantizer of down_proj's input, which applies it as it
reads: the same codes as quantizing the activation's output, without its kernels.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.base import QuantModule
from quamba.layers.qlinear import W4A8Linear, W4A16Linear, W8A8Linear
from quamba.models.mamba import watched
from quamba.models.state import DEFAULT_MAX_SEQLEN, AttentionState
from quamba.models.transformer_layers import MLP, Attention, GatedMLP, GraniteMoE, MoE
from quamba.ops.linear.input_quant import (activated, per_token_scales, quantize_per_tensor,
                                           quantize_per_token)
from quamba.ops.quant import fake_quantize, scale_from_range

# The hybrid layers whose nn.Linear modules quantize_linears_ replaces
TRANSFORMER_LAYERS = (Attention, MLP, GatedMLP, MoE, GraniteMoE)
# nn.Linear modules left float and uncalibrated (by the end of the name): Granite's router
FLOAT_LINEARS = ("router",)
# Linears whose input is quantized per token at run time (by the end of the name), unless the
# family's config names its own (HybridConfig.dynamic_inputs)
DYNAMIC_INPUTS = ("down_proj",)
# Linears that read the layer's normed input (their static scale is the layer's "in_proj.input")
LAYER_INPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def quantized_linears(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of each nn.Linear of ``layer`` that quantize_linears_ replaces."""
    return [(name, module) for name, module in layer.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in FLOAT_LINEARS]


def is_dynamic(name: str, dynamic_inputs: tuple | None = None) -> bool:
    """Whether linear ``name``'s input is quantized per token: its name ends in one of
    ``dynamic_inputs`` (None: DYNAMIC_INPUTS)."""
    return name.rsplit(".", 1)[-1] in (DYNAMIC_INPUTS if dynamic_inputs is None else dynamic_inputs)


def reads_layer_input(name: str) -> bool:
    """Whether linear ``name`` reads the layer's normed input (LAYER_INPUTS)."""
    return name.rsplit(".", 1)[-1] in LAYER_INPUTS


def input_kind(name: str) -> str:
    """The calibrated kind whose range gives linear ``name``'s static input scale."""
    return "in_proj.input" if reads_layer_input(name) else f"{name}.input"


class QInputLinear(QuantModule):
    """int8 quantizer of a float input (static: the inner linear's in_scale; ``dynamic``: absmax
    per token) → W8A8Linear or W4A8Linear: static, its output in the model dtype (the GEMM's
    out_dtype); dynamic, fp32 times each token's scale, cast to the input's dtype. A static
    linear also takes int8 codes of its in_scale, quantized once for several readers (Falcon-H1's
    normed input, which its Mamba2 mixer reads too): they go to the GEMM as they are. In
    float-sim mode those codes come as fake-quantized fp32 values, and the output dtypes stay
    as in the int8 modes."""

    def __init__(self, linear: QuantModule, dynamic: bool):
        super().__init__()
        self.linear, self.dynamic = linear, dynamic

    def forward(self, x):
        if x.dtype == torch.int8 and not self.dynamic:
            return self.linear(x)
        if self.simulate:
            scale = per_token_scales(x) if self.dynamic else self.linear.scales["in_scale"]
            y = self.linear(fake_quantize(x, scale))
            return y.to(x.dtype) if self.dynamic else y
        if self.dynamic:
            return self._per_token(x)
        return self.linear(quantize_per_tensor(x, self.linear.scales["in_scale"],
                                               backend_name=self.backend))

    def of_activation(self, activation: str, x, up=None):
        """``self(activated(x, activation, up))``; a per-token input quantizer applies the
        activation as it reads x (and up)."""
        if self.dynamic and not self.simulate:
            return self._per_token(x, activation, up)
        return self(activated(x, activation, up))

    def _per_token(self, x, activation=None, up=None):
        codes, scales = quantize_per_token(x, backend_name=self.backend, activation=activation,
                                           up=up)
        out = self.linear(codes)
        return torch.mul(out, scales, out=torch.empty(out.shape, dtype=x.dtype, device=out.device))

    def extra_repr(self) -> str:
        return f"input={'per-token dynamic' if self.dynamic else 'static'}"


def empty_linear(fp_linear: nn.Linear, dynamic: bool, w_bits: int, a_bits: int, group_size: int,
                 in_scale: float = 1.0) -> nn.Module:
    """The quantized form of ``fp_linear`` (its input per token if ``dynamic``), weights still
    zero."""
    shape = (fp_linear.in_features, fp_linear.out_features)
    device = fp_linear.weight.device
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

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> AttentionState:
        return AttentionState.empty(batch_size, self.num_kv_heads, max_seqlen, self.head_dim,
                                    device or next(self.buffers()).device, self.kv_dtype)


def activated_down_proj(down_proj, activation: str, x, up=None):
    """down_proj of the activation of x (and up), the activation inside its input quantizer
    unless hooks watch down_proj (calibration, GPTQ: they read the activation's output) or it
    takes a float input (W4A16)."""
    if isinstance(down_proj, QInputLinear) and not watched(down_proj):
        return down_proj.of_activation(activation, x, up)
    return down_proj(activated(x, activation, up))


class QMLP(MLP):
    """Nemotron-H's MLP with quantized linears: relu² in down_proj's input quantizer."""

    def forward(self, h, state=None, step: bool = False):
        return activated_down_proj(self.down_proj, "relu2", self.up_proj(h))


class QGatedMLP(GatedMLP):
    """A SwiGLU MLP with quantized linears: silu(gate) · up in down_proj's input quantizer."""

    def forward(self, h, state=None, step: bool = False):
        return activated_down_proj(self.down_proj, "swiglu", self.gate_proj(h), self.up_proj(h))


def quantize_linears_(layer: nn.Module, w_bits: int, a_bits: int, group_size: int,
                      ranges: dict | None = None, load: bool = True,
                      dynamic_inputs: tuple | None = None) -> nn.Module:
    """Replace every nn.Linear of ``layer`` (attention, MLP or MoE, or a block holding them) but
    a router (quantized_linears) in place by its quantized form (quantized_linear), each
    Attention in it by a QAttention and each MLP or GatedMLP (an expert's too) by a QMLP or
    QGatedMLP."""
    for module in layer.modules():
        if isinstance(module, Attention):
            module.__class__, module.kv_dtype = QAttention, module.k_proj.weight.dtype
        elif type(module) in (MLP, GatedMLP):
            module.__class__ = QMLP if type(module) is MLP else QGatedMLP
    for name, fp_linear in quantized_linears(layer):
        layer.set_submodule(name, quantized_linear(fp_linear, name, w_bits, a_bits, group_size,
                                                   ranges, load, dynamic_inputs))
    return layer


def quantized_linear(fp_linear: nn.Linear, name: str, w_bits: int, a_bits: int,
                     group_size: int, ranges: dict | None = None, load: bool = True,
                     dynamic_inputs: tuple | None = None) -> nn.Module:
    """The quantized form of ``fp_linear`` (named ``name`` in its layer), its weights quantized
    if ``load``, its static input scale from ``ranges`` (the layer's calibrated clipping ranges;
    None for W4A16 or an empty layer), per token where is_dynamic(name, ``dynamic_inputs``)."""
    if fp_linear.bias is not None:
        raise ValueError(f"{name}: quantized linears of hybrid layers take no bias")
    scale, dynamic = 1.0, is_dynamic(name, dynamic_inputs)
    if ranges is not None and a_bits != 16 and not dynamic:
        scale = scale_from_range(ranges[input_kind(name)])
    linear = empty_linear(fp_linear, dynamic, w_bits, a_bits, group_size, scale)
    if load:
        inner = linear if a_bits == 16 else linear.linear
        inner.load_float_weight(fp_linear.weight.detach())
    return linear
