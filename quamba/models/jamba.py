"""Jamba (transformers ``JambaForCausalLM``, model_type ``jamba``): a hybrid whose layers are each
``h + mixer(RMSNorm(h))`` then ``h + feed_forward(RMSNorm(h))``. The mixer is attention where
``i % attn_layer_period == attn_layer_offset``, else a Mamba1 mixer whose dt_low, B and C are
RMS-normalized with a weight each after x_proj; the feed-forward is an MoE where
``i % expert_layer_period == expert_layer_offset`` (and num_experts > 1), else a gated MLP.

quamba builds each Jamba layer as two Blocks of a MambaLMHeadModel (the mixer's, the
feed-forward's), so forward, cache, decode and ``generate`` are the Mamba LM's: the Mamba mixers
are quamba's MambaMixer with the weighted norms (quamba.ops.norm.mixer_norm), the others the
plain nn.Linear modules of quamba.models.transformer_layers. The residual stream stays in the
model dtype, as transformers keeps it. Layer i of the checkpoint is blocks 2i and 2i + 1
(from_jamba_names).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from quamba.models.config import ConfigError, MambaConfig, _first_id
from quamba.models.mamba import Block, MambaLMHeadModel, MambaMixer, RMSNorm
from quamba.models.nemotron_h import HybridConfig
from quamba.models.transformer_layers import Attention, GatedMLP, MoE, SoftmaxTopkRouter


@dataclass
class JambaConfig(HybridConfig):
    """Shape of a Jamba model: ``num_hidden_layers`` Jamba layers, ``n_layer`` quamba Blocks
    (two a layer)."""

    d_model: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # Mamba layers
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int = 0  # 0: ceil(d_model / 16)
    conv_bias: bool = True
    bias: bool = False  # in_proj's and out_proj's
    # attention layers
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attn_layer_period: int = 8
    attn_layer_offset: int = 4
    # MLP and MoE layers
    intermediate_size: int = 14336
    num_experts: int = 16
    num_experts_per_tok: int = 2
    expert_layer_period: int = 2
    expert_layer_offset: int = 1
    model_type = "jamba"
    # o_proj's input (the attention output) too: per token measured 0.029 against 0.039 static
    # (the attention layers alone W8A8, random model; tests/quantization/test_quantize_jamba.py)
    dynamic_inputs = ("down_proj", "o_proj")

    def __post_init__(self):
        for kind in ("attn", "expert"):
            period, offset = (getattr(self, f"{kind}_layer_{n}") for n in ("period", "offset"))
            if not 0 <= offset < period:
                raise ConfigError(f"{kind}_layer_offset {offset} is not in [0, {kind}_layer_period"
                                  f" {period})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{self.num_attention_heads} attention heads do not split into "
                              f"{self.num_key_value_heads} KV heads")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} is not in "
                              f"[1, num_experts {self.num_experts}]")

    @property
    def n_layer(self) -> int:
        return 2 * self.num_hidden_layers

    @property
    def norm_epsilon(self) -> float:
        """The blocks' RMSNorm eps (the quantized model's name for it)."""
        return self.rms_norm_eps

    def is_attention(self, layer: int) -> bool:
        return layer % self.attn_layer_period == self.attn_layer_offset

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 1 and layer % self.expert_layer_period == self.expert_layer_offset

    @property
    def mamba(self) -> MambaConfig:
        """The Mamba mixers' config (mixer_rms_eps: the eps of their norms of dt, B and C)."""
        return MambaConfig(d_model=self.d_model, n_layer=self.n_layer, vocab_size=self.vocab_size,
                           d_state=self.d_state, d_conv=self.d_conv, expand=self.expand,
                           dt_rank=self.dt_rank, conv_bias=self.conv_bias, bias=self.bias,
                           norm_epsilon=self.rms_norm_eps, residual_in_fp32=False,
                           mixer_rms_eps=self.rms_norm_eps)

    @classmethod
    def from_transformers(cls, cfg: dict) -> "JambaConfig":
        """From a transformers JambaConfig config.json; options that quamba cannot honour are
        refused by name."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        get, hidden = cfg.get, cfg["hidden_size"]
        heads = get("num_attention_heads", 32)
        dt_rank = get("mamba_dt_rank", "auto")
        return cls(
            d_model=hidden, num_hidden_layers=cfg["num_hidden_layers"],
            vocab_size=cfg["vocab_size"], rms_norm_eps=get("rms_norm_eps", 1e-6),
            tie_embeddings=get("tie_word_embeddings", False),
            bos_token_id=_first_id(get("bos_token_id"), 1),
            eos_token_id=_first_id(get("eos_token_id"), 2),
            pad_token_id=_first_id(get("pad_token_id"), 0),
            d_state=get("mamba_d_state", 16), d_conv=get("mamba_d_conv", 4),
            expand=get("mamba_expand", 2), dt_rank=0 if dt_rank == "auto" else dt_rank,
            conv_bias=get("mamba_conv_bias", True), bias=get("mamba_proj_bias", False),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            attn_layer_period=get("attn_layer_period", 8),
            attn_layer_offset=get("attn_layer_offset", 4),
            intermediate_size=get("intermediate_size", 14336),
            num_experts=get("num_experts", 16), num_experts_per_tok=get("num_experts_per_tok", 2),
            expert_layer_period=get("expert_layer_period", 2),
            expert_layer_offset=get("expert_layer_offset", 1))


class NormWeight(nn.Module):
    """The weight of one of the Mamba mixer's norms of dt_low, B and C (Jamba's dt_layernorm,
    b_layernorm, c_layernorm: the checkpoint's names)."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))


class JambaMambaMixer(MambaMixer):
    """MambaMixer whose norms of dt_low, B and C (eps ``config.mixer_rms_eps``) each multiply by
    a weight, as transformers' JambaMambaMixer: x / sqrt(mean(x²) + eps) in fp32, cast back to the
    model dtype, times the weight."""

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        kw = dict(device=device, dtype=dtype)
        self.dt_layernorm = NormWeight(config.dt_rank, **kw)
        self.b_layernorm = NormWeight(config.d_state, **kw)
        self.c_layernorm = NormWeight(config.d_state, **kw)

    @property
    def mixer_norm_weights(self) -> tuple:
        return tuple(norm.weight for norm in
                     (self.dt_layernorm, self.b_layernorm, self.c_layernorm))


def jamba_mixer(layer: int, config: JambaConfig, device=None, dtype=None) -> nn.Module:
    """Layer ``layer``'s attention or Mamba mixer."""
    c = config
    if c.is_attention(layer):
        return Attention(c.d_model, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         device=device, dtype=dtype)
    return JambaMambaMixer(c.mamba, device, dtype)


def jamba_feed_forward(layer: int, config: JambaConfig, device=None, dtype=None) -> nn.Module:
    """Layer ``layer``'s MoE (routed experts only) or gated MLP."""
    c, kw = config, dict(device=device, dtype=dtype)
    if not c.is_moe(layer):
        return GatedMLP(c.d_model, c.intermediate_size, **kw)
    router = SoftmaxTopkRouter(c.d_model, c.num_experts, c.num_experts_per_tok, **kw)
    return MoE(c.d_model, c.num_experts, c.intermediate_size, 0, router, expert=GatedMLP, **kw)


def jamba_block_mixer(block: int, config: JambaConfig, device=None, dtype=None) -> nn.Module:
    """Block ``block``'s mixer: layer block // 2's mixer for an even block, else its
    feed-forward."""
    make = jamba_feed_forward if block % 2 else jamba_mixer
    return make(block // 2, config, device, dtype)


class JambaBackbone(nn.Module):
    def __init__(self, config: JambaConfig, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embedding = nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.layers = nn.ModuleList(
            Block(RMSNorm(config.d_model, config.rms_norm_eps, False, **kw),
                  jamba_block_mixer(block, config, **kw)) for block in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.rms_norm_eps, False, **kw)


class JambaLM(MambaLMHeadModel):
    """Jamba LM: embedding → two blocks a layer → final RMSNorm → lm_head (untied by default).
    Forward, cache, decode and generate are MambaLMHeadModel's; the cache holds each Mamba
    mixer's MixerState, each attention layer's KV cache, None for MLP and MoE blocks."""

    def __init__(self, config: JambaConfig, device=None, dtype=None):
        nn.Module.__init__(self)  # MambaLMHeadModel's parts around other blocks
        self._assemble(config, JambaBackbone(config, device, dtype), config.vocab_size, device, dtype)


_OUTER_NAMES = {"model.embed_tokens.weight": "backbone.embedding.weight",
                "model.final_layernorm.weight": "backbone.norm_f.weight"}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|pre_ff_layernorm|mamba|"
                         r"self_attn|feed_forward)\.(.+)")


def from_jamba_names(state: dict) -> dict:
    """A Jamba checkpoint's tensors under quamba's names: layer i's input_layernorm and mixer
    (mamba or self_attn) as block 2i's norm and mixer, its pre_ff_layernorm and feed_forward as
    block 2i + 1's (the router as the MoE's ``gate``). Other names stay, for load_state_into to
    report."""
    return {_internal_name(key): value for key, value in state.items()}


def _internal_name(key: str) -> str:
    match = _LAYER_NAME.fullmatch(key)
    if match is None:
        return _OUTER_NAMES.get(key, key)
    layer, part, rest = match.groups()
    block = 2 * int(layer) + (part in ("pre_ff_layernorm", "feed_forward"))
    if part.endswith("layernorm"):
        return f"backbone.layers.{block}.norm.{rest}"
    rest = "gate." + rest[len("router."):] if rest.startswith("router.") else rest
    return f"backbone.layers.{block}.mixer.{rest}"


def to_jamba_names(state: dict, config: JambaConfig) -> dict:
    """quamba's tensors of a Jamba model under the checkpoint's names (from_jamba_names
    reversed): block 2i's norm and mixer as layer i's input_layernorm and mamba or self_attn,
    block 2i + 1's as its pre_ff_layernorm and feed_forward (the MoE's ``gate`` as its router).
    Any suffix (weight, weight_scale ...) is kept."""
    outer = {quamba: jamba for jamba, quamba in _OUTER_NAMES.items()}
    return {outer.get(key) or _jamba_name(key, config): value for key, value in state.items()}


def _jamba_name(key: str, config: JambaConfig) -> str:
    parts = key.split(".")
    if not key.startswith("backbone.layers."):
        return key
    layer, feed_forward = divmod(int(parts[2]), 2)
    rest = parts[4:]
    if parts[3] == "norm":
        part = "pre_ff_layernorm" if feed_forward else "input_layernorm"
    elif feed_forward:
        part, rest = "feed_forward", ["router", *rest[1:]] if rest[0] == "gate" else rest
    else:
        part = "self_attn" if config.is_attention(layer) else "mamba"
    return ".".join(["model.layers", str(layer), part, *rest])
