"""Hadamard rotation of the residual stream of an FP Mamba1 or Mamba2 model (function-preserving).

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
from quamba.models.mamba import MambaLMHeadModel, MambaMixer, RMSNorm
from quamba.models.mamba2 import GatedRMSNorm, Mamba2Mixer
from quamba.ops.norm.hadamard import HadamardTransform, hadamard_factors, hadamard_matrix


def rotate_model_(model: MambaLMHeadModel) -> MambaLMHeadModel:
    """Rotate ``model``'s residual stream by the Hadamard matrix in place (see the module
    docstring); the FP function is unchanged. Unties lm_head from the embedding and sets
    ``config.tie_embeddings = False`` and ``model.rotated = True``. Folding runs in float64 on the
    model's device; each parameter keeps its dtype. Returns the model."""
    _check_rotatable(model)
    backbone = model.backbone
    device = backbone.embedding.weight.device
    rotation = hadamard_matrix(model.config.d_model, device=device)
    inner_rotation = hadamard_matrix(model.config.d_inner, device=device)
    with torch.no_grad():
        _untie_and_rotate_lm_head(model, rotation)
        _assign(backbone.embedding.weight, backbone.embedding.weight.double() @ rotation)
        for block in backbone.layers:
            _rotate_block(block, rotation, inner_rotation, model.config.d_inner)
    model.config.tie_embeddings = False
    model.rotated = True
    return model


def rotate_vision_model_(model) -> None:
    """Rotate a VisionMamba's residual stream in place (see the module docstring); the FP function
    is unchanged. Sets ``model.rotated = True``."""
    _check_rotatable(model)
    device = model.pos_embed.device
    rotation = hadamard_matrix(model.config.d_model, device=device)
    inner_rotation = hadamard_matrix(model.config.d_inner, device=device)
    with torch.no_grad():
        proj = model.patch_embed.proj
        _assign(proj.weight, (rotation.T @ proj.weight.double().flatten(1)).view(proj.weight.shape))
        _assign(proj.bias, proj.bias.double() @ rotation)
        for name in ("cls_token", "pos_embed"):
            if hasattr(model, name):
                _assign(getattr(model, name), getattr(model, name).double() @ rotation)
        for block in model.layers:
            _rotate_block(block, rotation, inner_rotation, model.config.d_inner)
        _assign(model.head.weight, _fold_norm(model.head.weight, model.norm_f, rotation))
    model.rotated = True


def _rotate_block(block, rotation: torch.Tensor, inner_rotation: torch.Tensor, d_inner: int) -> None:
    """Fold the block's norm into in_proj, rotate out_proj, and rotate y online."""
    _assign(block.mixer.in_proj.weight, _fold_norm(block.mixer.in_proj.weight, block.norm, rotation))
    if isinstance(block.mixer, Mamba2Mixer):
        fold_gated_norm_(block.mixer)
    _rotate_out_proj(block.mixer, rotation, inner_rotation)
    block.mixer.online_hadamard = HadamardTransform(d_inner)


def _check_rotatable(model: MambaLMHeadModel) -> None:
    if getattr(model, "rotated", False):
        raise ValueError("model is already Hadamard-rotated: the rotation runs once per model")
    for name in ("d_model", "d_inner"):
        try:
            hadamard_factors(getattr(model.config, name))
        except ValueError as exc:
            raise QuambaError(f"the Hadamard rotation cannot rotate {name}: {exc}; quantize "
                              "without it (QuantConfig(hadamard=False), --no_hadamard)") from None
    layers = model.backbone.layers if hasattr(model, "backbone") else model.layers
    for i, block in enumerate(layers):
        if not (isinstance(block.norm, RMSNorm) and isinstance(block.mixer, (MambaMixer, Mamba2Mixer))
                and isinstance(block.mixer.online_hadamard, nn.Identity)):
            raise ValueError(f"the rotation needs an FP Mamba model; block {i} is "
                             f"{type(block.norm).__name__}/{type(block.mixer).__name__}")
        if getattr(block.mixer, "bimamba", "v2") != "v2":
            raise ValueError(f"block {i} has separate backward in_proj/out_proj (bimamba "
                             f"{block.mixer.bimamba!r}); only 'v2' mixers are rotated")


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


def _rotate_out_proj(mixer: MambaMixer, rotation: torch.Tensor, inner_rotation: torch.Tensor):
    out_proj = mixer.out_proj
    _assign(out_proj.weight, rotation.T @ out_proj.weight.double() @ inner_rotation)
    if out_proj.bias is not None:
        _assign(out_proj.bias, out_proj.bias.double() @ rotation)


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))
