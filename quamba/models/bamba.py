"""Bamba (transformers ``BambaForCausalLM``, model_type ``bamba``): a hybrid whose layers are Mamba2
mixers, or attention at ``attn_layer_indices``, each followed by a SwiGLU feed-forward:
``h += mixer(RMSNorm(h)); h += feed_forward(RMSNorm(h))``.

quamba builds each transformers layer as two of its Blocks (the mixer's, then the
feed-forward's), so the model is a MambaLMHeadModel over 2 × num_hidden_layers blocks: the same
forward, cache, decode and ``generate``. The Mamba2 layers are Nemotron-H's mixer (Δ floored at
``time_step_limit[0]``, as transformers' prefill clamps it); attention has RoPE on part of each
head (``partial_rotary_factor``); the feed-forward is GatedMLP. Tensor names are quamba's, read
from the checkpoint's by from_transformers_names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from quamba.models.config import ConfigError, _first_id
from quamba.models.mamba import Block, MambaLMHeadModel, RMSNorm
from quamba.models.mamba2 import Mamba2Mixer, init_mamba2_parameters
from quamba.models.nemotron_h import NemotronHMamba2Mixer
from quamba.models.transformer_layers import Attention, GatedMLP, RotaryEmbedding

BAMBA_TYPES = ("bamba",)


@dataclass
class BambaConfig:
    """Shape of a Bamba model. ``layer_types`` has one entry a transformers layer, "mamba" or
    "attention"; the Mamba2 fields carry Mamba2Mixer's names."""

    layer_types: tuple
    d_model: int
    vocab_size: int
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # Mamba2 layers
    d_state: int = 256
    d_conv: int = 4
    nheads: int = 128
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    conv_bias: bool = True
    bias: bool = False
    dt_min: float = 0.0  # Δ's floor (time_step_limit[0])
    # attention layers
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rotary_dim: int = 64
    # feed-forward
    intermediate_size: int = 14336
    mlp_bias: bool = False

    def __post_init__(self):
        if self.nheads % self.ngroups:
            raise ConfigError(f"{self.nheads} Mamba heads do not split into n_groups "
                              f"{self.ngroups}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{self.num_attention_heads} attention heads do not split into "
                              f"{self.num_key_value_heads} KV heads")

    @property
    def n_layer(self) -> int:
        """quamba's blocks: two a transformers layer."""
        return 2 * len(self.layer_types)

    @property
    def d_inner(self) -> int:
        return self.nheads * self.headdim

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_attention_heads

    @classmethod
    def from_transformers(cls, cfg: dict) -> "BambaConfig":
        """From a transformers BambaConfig config.json; options that quamba cannot honour are
        refused by name."""
        _check_supported(cfg)
        get = cfg.get
        heads, d_model = cfg["num_attention_heads"], cfg["hidden_size"]
        nheads = get("mamba_n_heads", 128)
        headdim = get("mamba_d_head", "auto")
        if headdim == "auto":
            headdim = get("mamba_expand", 2) * d_model // nheads
        theta, partial = _rope(cfg)
        return cls(
            layer_types=_layer_types(cfg), d_model=d_model, vocab_size=cfg["vocab_size"],
            norm_epsilon=get("rms_norm_eps", 1e-5),
            tie_embeddings=get("tie_word_embeddings", False),
            bos_token_id=_first_id(get("bos_token_id"), 1),
            eos_token_id=_first_id(get("eos_token_id"), 2),
            pad_token_id=_first_id(get("pad_token_id"), 0),
            d_state=get("mamba_d_state", 256), d_conv=get("mamba_d_conv", 4), nheads=nheads,
            headdim=headdim, ngroups=get("mamba_n_groups", 1),
            chunk_size=get("mamba_chunk_size", 256), conv_bias=get("mamba_conv_bias", True),
            bias=get("mamba_proj_bias", False), dt_min=_time_step_limit(cfg)[0],
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            attention_bias=get("attention_bias", False), rope_theta=theta,
            rotary_dim=int(d_model // heads * partial),
            intermediate_size=get("intermediate_size", 14336), mlp_bias=get("mlp_bias", False))


def _check_supported(cfg: dict) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("head_dim") not in (None, cfg["hidden_size"] // cfg["num_attention_heads"]):
        raise ConfigError(f"head_dim {cfg['head_dim']!r} is not supported (only hidden_size / "
                          "num_attention_heads)")


def _time_step_limit(cfg: dict) -> tuple:
    """(low, high); transformers 5 writes inf as {"__float__": "Infinity"}."""
    low, high = (float(v["__float__"]) if isinstance(v, dict) else v
                 for v in cfg.get("time_step_limit") or (0.0, math.inf))
    if high != math.inf:
        raise ConfigError(f"time_step_limit {[low, high]} is not supported (only an upper "
                          "bound of inf)")
    return low, high


def _rope(cfg: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of the default RoPE; other RoPE types refused.
    partial_rotary_factor defaults to 0.5, as transformers' BambaConfig sets it."""
    params = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0),
                                            **(cfg.get("rope_scaling") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
    return params.get("rope_theta", 10000.0), params.get("partial_rotary_factor", 0.5)


def _layer_types(cfg: dict) -> tuple:
    attention = set(cfg.get("attn_layer_indices") or ())
    n_layers = cfg["num_hidden_layers"]
    outside = sorted(i for i in attention if not 0 <= i < n_layers)
    if outside:
        raise ConfigError(f"attn_layer_indices {outside} are outside the {n_layers} layers")
    return tuple("attention" if i in attention else "mamba" for i in range(n_layers))


def bamba_mixer(kind: str, config: BambaConfig, device=None, dtype=None) -> nn.Module:
    """The mixer of a transformers layer of kind ``kind`` ("mamba" or "attention")."""
    c = config
    if kind == "mamba":
        return NemotronHMamba2Mixer(c, device, dtype)
    rotary = RotaryEmbedding(c.rotary_dim, c.rope_theta) if c.rotary_dim else None
    return Attention(c.d_model, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                     c.attention_bias, rotary, device=device, dtype=dtype)


class BambaBackbone(nn.Module):
    def __init__(self, config: BambaConfig, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        c = config
        self.embedding = nn.Embedding(c.vocab_size, c.d_model, **kw)
        self.layers = nn.ModuleList()
        for kind in c.layer_types:
            self.layers.append(Block(RMSNorm(c.d_model, c.norm_epsilon, False, **kw),
                                     bamba_mixer(kind, c, **kw)))
            self.layers.append(Block(RMSNorm(c.d_model, c.norm_epsilon, False, **kw),
                                     GatedMLP(c.d_model, c.intermediate_size, c.mlp_bias, **kw)))
        self.norm_f = RMSNorm(c.d_model, c.norm_epsilon, False, **kw)


class BambaLM(MambaLMHeadModel):
    """Bamba LM: embedding → two blocks a layer → final RMSNorm → lm_head (untied by default).
    Forward, cache, decode and generate are MambaLMHeadModel's; the cache holds each Mamba
    layer's MixerState, each attention layer's KV cache, None for the feed-forwards."""

    model_type = "bamba"

    def __init__(self, config: BambaConfig, device=None, dtype=None):
        nn.Module.__init__(self)  # not MambaLMHeadModel's: other blocks, no Mamba1 init
        self.config = config
        self.backbone = BambaBackbone(config, device, dtype)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, device=device,
                                 dtype=dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight
        with torch.no_grad():
            for mixer in self.mixers():
                if isinstance(mixer, Mamba2Mixer):
                    init_mamba2_parameters(mixer)


# each transformers sub-layer: (which of the layer's two blocks, its name there)
_SUBLAYERS = {"input_layernorm": (0, "norm"), "mamba": (0, "mixer"), "self_attn": (0, "mixer"),
              "pre_ff_layernorm": (1, "norm"), "feed_forward": (1, "mixer")}
_TOP_NAMES = {"model.embed_tokens.weight": "backbone.embedding.weight",
              "model.final_layernorm.weight": "backbone.norm_f.weight"}


def from_transformers_names(state: dict) -> dict:
    """A transformers Bamba checkpoint's tensors under quamba's names: ``model.layers.{i}.mamba``
    → ``backbone.layers.{2i}.mixer``, ``model.layers.{i}.feed_forward`` →
    ``backbone.layers.{2i+1}.mixer`` ... (unknown names pass unchanged, and are refused as
    unexpected)."""
    renamed = {}
    for key, value in state.items():
        parts = key.split(".")
        if key.startswith("model.layers.") and parts[3] in _SUBLAYERS:
            block, name = _SUBLAYERS[parts[3]]
            key = ".".join(["backbone.layers", str(2 * int(parts[2]) + block), name, *parts[4:]])
        renamed[_TOP_NAMES.get(key, key)] = value
    return renamed
