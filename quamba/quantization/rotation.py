"""Hadamard rotation of the residual stream of an FP Mamba1, Mamba2 or hybrid model
(function-preserving).

Row-vector convention, as ``nn.Linear`` computes it: ``linear(x) = x @ W.T + b``. Let
H = hadamard_matrix(d_model) and G = hadamard_matrix(d_inner), both orthonormal (H Hᵀ = I), and
let the rotated residual be r̃ = r H.

Key identity: an orthonormal rotation keeps the norm, so rms(r H) = rms(r) and the unit-weight
RMSNorm commutes with it, N₁(r H) = N₁(r) H. An RMSNorm with weight w is N₁(r) diag(w), so once w
is folded into the next linear layer the norm can run on the rotated residual:

    in_proj:   N_w(r) W_inᵀ = N₁(r̃) Hᵀ diag(w) W_inᵀ     ⇒  W̃_in  = W_in diag(w) H   (norm w → 1)
    lm_head:   N_wf(r) W_lmᵀ = N₁(r̃) Hᵀ diag(w_f) W_lmᵀ  ⇒  W̃_lm  = W_lm diag(w_f) H
    embedding: r₀ = E[token]                            ⇒  Ẽ     = E H
    out_proj:  (y W_outᵀ + b) H = (y G) Gᵀ W_outᵀ H + b H ⇒  W̃_out = Hᵀ W_out G,  b̃_out = b H

The mixer output lands in the rotated basis, so every residual add stays rotated; y G is computed
online (``mixer.online_hadamard``), which is what lets out_proj's input be quantized per tensor.
in_proj's bias is unchanged (its output basis is not rotated). A Mamba2 mixer's y is the output of
its gated RMSNorm, whose weight w_g is first folded into out_proj: W_out ← W_out diag(w_g).

A hybrid's attention, MLP and MoE blocks read the residual through an RMSNorm too, so the same
rotation is exact across them (QuaRot's construction): the norm's weight folds into every linear
that reads it, and

    q/k/v, up/gate, router:   W̃_in = W_in diag(w) H          (MoE: every expert's, the router's)
    o_proj, down_proj:        W̃_out = Hᵀ W_out,  b̃_out = b H

RoPE, attention scores, SwiGLU, the KV cache and the routing are untouched: the rotation acts on
the residual dimension only (a router's logits equal up to float rounding). Falcon-H1's parallel
Mamba2 and attention read one norm, so both take its weight; its remaining µP multipliers, like
Granite's embedding multiplier and logits scaling, are scalars and commute. Zamba2's shared
blocks read RMSNorm([h, e]) of the residual h and the token embeddings e, both rotated, so their
concatenation is rotated by blockdiag(H, H) (orthonormal): the norm's weight folds into q, k, v
and the q, k, v LoRA adapters, W̃ = W diag(w) blockdiag(H, H); each layer's ``linear`` that
brings the block's output t back into the residual width is rotated on its output side, Hᵀ W.

A Vision Mamba classifier (quamba.models.vision) is rotated the same way; its residual stream
starts at the patch embedding, the class token and the position embedding, and ends in the head:

    patch embedding (conv, out channels × rest): W̃ = Hᵀ W,  b̃ = b H;   cls, pos: c̃ = c H
    head:      N_wf(r) W_headᵀ + b  ⇒  W̃_head = W_head diag(w_f) H   (bias unchanged)

Pooling (the class token, the mean of the tokens) is linear, so it commutes with the rotation.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.errors import QuambaError
from quamba.models.falcon_h1 import ParallelMixer
from quamba.models.mamba import Block, MambaLMHeadModel, MambaMixer, RMSNorm
from quamba.models.mamba2 import GatedRMSNorm, Mamba2Mixer
from quamba.models.transformer_layers import MLP, Attention, GatedMLP, GraniteMoE, MoE
from quamba.models.zamba2 import Zamba2Layer, Zamba2LM
from quamba.ops.norm.hadamard import HadamardTransform, hadamard_factors, hadamard_matrix

# Each mixer part: (the modules whose weight reads the block's normed input, the linears that
# write the residual). A Mamba mixer's out_proj also reads its rotated y (_rotate_block).
_RESIDUAL_LINEARS = {
    MambaMixer: (("in_proj",), ()),
    Mamba2Mixer: (("in_proj",), ()),
    Attention: (("q_proj", "k_proj", "v_proj"), ("o_proj",)),
    MLP: (("up_proj",), ("down_proj",)),
    GatedMLP: (("gate_proj", "up_proj"), ("down_proj",)),
    MoE: (("gate",), ()),  # its router (experts and shared expert: MLPs)
    GraniteMoE: (("router",), ()),
}
# The mixers whose every part is in _RESIDUAL_LINEARS, so the rotation is exact across them
_ROTATABLE_MIXERS = (MambaMixer, Mamba2Mixer, Attention, MLP, GatedMLP, MoE, GraniteMoE,
                     ParallelMixer)


def rotate_model_(model: MambaLMHeadModel) -> MambaLMHeadModel:
    """Rotate ``model``'s residual stream by the Hadamard matrix in place (see the module
    docstring); the FP function is unchanged. Unties lm_head from the embedding and sets
    ``config.tie_embeddings = False`` and ``model.rotated = True``. Folding runs in float64 on the
    model's device; each parameter keeps its dtype. Returns the model."""
    _check_rotatable(model)
    backbone = model.backbone
    device = backbone.embedding.weight.device
    rotation = hadamard_matrix(model.config.d_model, device=device)
    with torch.no_grad():
        _untie_and_rotate_lm_head(model, rotation)
        _assign(backbone.embedding.weight, backbone.embedding.weight.double() @ rotation)
        for block in backbone.layers:
            _rotate_block(block, rotation)
        if isinstance(model, Zamba2LM):
            _rotate_shared_blocks(model, rotation)
    model.config.tie_embeddings = False
    model.rotated = True
    return model


def rotate_vision_model_(model) -> None:
    """Rotate a VisionMamba's residual stream in place (see the module docstring); the FP function
    is unchanged. Sets ``model.rotated = True``."""
    _check_rotatable(model)
    device = model.pos_embed.device
    rotation = hadamard_matrix(model.config.d_model, device=device)
    with torch.no_grad():
        proj = model.patch_embed.proj
        _assign(proj.weight, (rotation.T @ proj.weight.double().flatten(1)).view(proj.weight.shape))
        _assign(proj.bias, proj.bias.double() @ rotation)
        for name in ("cls_token", "pos_embed"):
            if hasattr(model, name):
                _assign(getattr(model, name), getattr(model, name).double() @ rotation)
        for block in model.layers:
            _rotate_block(block, rotation)
        _assign(model.head.weight, _fold_norm(model.head.weight, model.norm_f, rotation))
    model.rotated = True


def _rotate_block(block, rotation: torch.Tensor) -> None:
    """Fold the block's norm into the linears that read it and rotate their input side, rotate
    the output side of those that write the residual; a Mamba mixer's y is rotated online."""
    inputs, outputs, mambas = _residual_linears(block.mixer)
    _fold_into_readers(inputs, block.norm, rotation)
    for linear in outputs:
        _rotate_output(linear, rotation.T @ linear.weight.double(), rotation)
    for mixer in mambas:
        if isinstance(getattr(mixer, "norm", None), GatedRMSNorm):  # Mamba2's, not SiluGate
            fold_gated_norm_(mixer)
        inner_rotation = hadamard_matrix(mixer.d_inner, device=rotation.device)
        out_proj = mixer.out_proj
        _rotate_output(out_proj, rotation.T @ out_proj.weight.double() @ inner_rotation, rotation)
        mixer.online_hadamard = HadamardTransform(mixer.d_inner)


def _rotate_shared_blocks(model: Zamba2LM, rotation: torch.Tensor) -> None:
    """Zamba2: each shared block reads RMSNorm([h, e]) of the rotated h and embeddings e, i.e.
    [h, e] times blockdiag(H, H), orthonormal: its input norm's weight folds into q, k, v and the
    first linear of every use's q, k, v adapters, whose inputs rotate by blockdiag(H, H). Its
    output t is no residual (each layer adds linear(t) to h inside its norm), so each layer's
    ``linear`` rotates its output side; the block's inside stays unrotated."""
    both_halves = torch.block_diag(rotation, rotation)
    for block in model.backbone.shared_blocks:
        attention = block.attention
        readers = [attention.q_proj, attention.k_proj, attention.v_proj]
        for layer in model.backbone.layers:
            if layer.shared is block and layer.adapters.qkv is not None:
                readers += [lora[0] for lora in layer.adapters.qkv]
        _fold_into_readers(readers, block.input_norm, both_halves)
    for layer in model.backbone.layers:
        if layer.shared is not None:
            _rotate_output(layer.linear, rotation.T @ layer.linear.weight.double(), rotation)


def _fold_into_readers(readers: list, norm: RMSNorm, rotation: torch.Tensor) -> None:
    """W ← W diag(w) R for each module that reads ``norm``'s output, then w ← 1 (in float64)."""
    norm_weight = norm.weight.double()
    for linear in readers:
        _assign(linear.weight, (linear.weight.double() * norm_weight) @ rotation)
    norm.weight.fill_(1.0)


def _residual_linears(mixer: nn.Module) -> tuple[list, list, list]:
    """(the modules whose ``weight`` reads the normed residual, the linears that write the
    residual, the Mamba mixers whose out_proj writes it) of a block's mixer, found among its
    modules (a MoE's experts, Falcon-H1's parallel mixer) by _RESIDUAL_LINEARS."""
    inputs, outputs, mambas = [], [], []
    for module in mixer.modules():
        kind = next((cls for cls in type(module).__mro__ if cls in _RESIDUAL_LINEARS), None)
        if kind is None:
            continue
        reading, writing = _RESIDUAL_LINEARS[kind]
        inputs += [getattr(module, name) for name in reading]
        outputs += [getattr(module, name) for name in writing]
        if kind in (MambaMixer, Mamba2Mixer):
            mambas.append(module)
    return inputs, outputs, mambas


def _rotate_output(linear: nn.Linear, weight: torch.Tensor, rotation: torch.Tensor) -> None:
    """Set a residual-writing linear's weight to ``weight`` (its rotated form), its bias to b H."""
    _assign(linear.weight, weight)
    if linear.bias is not None:
        _assign(linear.bias, linear.bias.double() @ rotation)


def _check_rotatable(model: MambaLMHeadModel) -> None:
    if getattr(model, "rotated", False):
        raise ValueError("model is already Hadamard-rotated: the rotation runs once per model")
    reason = _size_obstacle(model)
    if reason is not None:
        raise QuambaError(f"the Hadamard rotation {reason}; quantize without it "
                          "(QuantConfig(hadamard=False), --no_hadamard)")
    layers = model.backbone.layers if hasattr(model, "backbone") else model.layers
    for i, block in enumerate(layers):
        mixer = block.mixer
        if not (isinstance(block, (Block, Zamba2Layer)) and isinstance(block.norm, RMSNorm)
                and isinstance(mixer, _ROTATABLE_MIXERS)
                and all(isinstance(m.online_hadamard, nn.Identity)
                        for m in _residual_linears(mixer)[2])):
            raise ValueError(f"the rotation needs an FP Mamba or hybrid model; block {i} is "
                             f"{type(block.norm).__name__}/{type(mixer).__name__}")
        if getattr(mixer, "bimamba", "v2") != "v2":
            raise ValueError(f"block {i} has separate backward in_proj/out_proj (bimamba "
                             f"{mixer.bimamba!r}); only 'v2' mixers are rotated")


def _size_obstacle(model) -> str | None:
    """Why no Hadamard matrix fits d_model or a Mamba mixer's d_inner (None: they all fit)."""
    inner = {m.d_inner for m in model.modules() if isinstance(m, (MambaMixer, Mamba2Mixer))}
    for name, size in (("d_model", model.config.d_model), *(("d_inner", n) for n in sorted(inner))):
        try:
            hadamard_factors(size)
        except ValueError as exc:
            return f"cannot rotate {name}: {exc}"
    return None


def hybrid_rotation_obstacle(model) -> str | None:
    """Why a hybrid's residual stream is not rotated (None: it is, exactly; see the module
    docstring): a d_model or d_inner without a Hadamard matrix."""
    reason = _size_obstacle(model)
    return None if reason is None else f"{model.config.model_type}: {reason}"


def _fold_norm(weight: torch.Tensor, norm: RMSNorm, rotation: torch.Tensor) -> torch.Tensor:
    """W diag(w) H in float64, and the norm's weight w set to ones."""
    folded = (weight.double() * norm.weight.double()) @ rotation
    norm.weight.fill_(1.0)
    return folded


def quantization_basis_(model: MambaLMHeadModel, hadamard: bool) -> MambaLMHeadModel:
    """Put an FP LM in the basis its quantized model computes in, in place: rotated if
    ``hadamard``, else only the Mamba2 gated-norm weights folded into out_proj (what the
    quantized Mamba2 mixer's out_proj holds; a gate without norm, Falcon-H1's SiluGate, has
    none). Function-preserving; returns the model."""
    if hadamard:
        return rotate_model_(model)
    for mixer in model.modules():  # Falcon-H1's sit inside its parallel mixers
        if isinstance(mixer, Mamba2Mixer) and isinstance(mixer.norm, GatedRMSNorm):
            fold_gated_norm_(mixer)
    return model


@torch.no_grad()
def fold_gated_norm_(mixer: Mamba2Mixer) -> None:
    """Fold a Mamba2 mixer's gated-RMSNorm weight into out_proj (W_out diag(w_g), in float64),
    the norm's weight set to ones; the function is unchanged."""
    out_proj, norm = mixer.out_proj, mixer.norm
    _assign(out_proj.weight, out_proj.weight.double() * norm.weight.double())
    norm.weight.fill_(1.0)


def _untie_and_rotate_lm_head(model: MambaLMHeadModel, rotation: torch.Tensor) -> None:
    """Give lm_head its own weight W_lm diag(w_f) H, computed before the embedding (which it may
    share) is rotated."""
    old = model.lm_head.weight
    folded = _fold_norm(old, model.backbone.norm_f, rotation)
    model.lm_head.weight = nn.Parameter(folded.to(old.dtype), requires_grad=old.requires_grad)


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))
