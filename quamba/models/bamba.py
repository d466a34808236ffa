"""Bamba (transformers ``BambaForCausalLM``, model_type ``bamba``) and Granite-4.0-H
(``GraniteMoeHybridForCausalLM``, model_type ``granitemoehybrid``): hybrids whose layers are
Mamba2 mixers or attention, each followed by a feed-forward:
``h += mixer(RMSNorm(h)); h += feed_forward(RMSNorm(h))``.

quamba builds each transformers layer as two of its Blocks (the mixer's, then the
feed-forward's), so the model is a MambaLMHeadModel over 2 × num_hidden_layers blocks: the same
forward, cache, decode and ``generate``. The Mamba2 layers are Nemotron-H's mixer (Δ floored at
``time_step_limit[0]``, as transformers' prefill clamps it); attention has RoPE on all or part of
each head (``partial_rotary_factor``; Granite's may have none); the feed-forward is GatedMLP, or
Granite's MoE. Granite's µP multipliers: the embedding's and the logits' at run time, the
residual one folded into the output linear of every block on load. Tensor names are quamba's,
read from the checkpoint's by from_transformers_names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from quamba.models.config import ConfigError, _first_id
from quamba.models.mamba import Block, MambaLMHeadModel, RMSNorm
from quamba.models.nemotron_h import HybridConfig, NemotronHMamba2Mixer
from quamba.models.transformer_layers import Attention, GatedMLP, GraniteMoE, RotaryEmbedding

BAMBA_TYPES = ("bamba", "granitemoehybrid")


@dataclass
class BambaConfig(HybridConfig):
    """Shape of a Bamba or Granite-4.0-H model. ``layer_types`` has one entry a transformers
    layer, "mamba" or "attention"; the Mamba2 fields carry Mamba2Mixer's names. The feed-forward
    is a GatedMLP of ``intermediate_size``, or with ``num_experts`` Granite's MoE (its shared
    MLP of ``intermediate_size``). The µP multipliers are 1 (None: 1/sqrt(head_dim)) for Bamba."""

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
    num_experts: int = 0
    num_experts_per_tok: int = 2
    expert_size: int = 0
    # Granite's µP multipliers
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    model_type: str = "bamba"

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
        """From a transformers BambaConfig or GraniteMoeHybridConfig config.json; options that
        quamba cannot honour are refused by name."""
        _check_supported(cfg)
        granite = cfg.get("model_type") == "granitemoehybrid"
        return cls(**_shared_fields(cfg), **(_granite_fields(cfg) if granite else
                                             _bamba_fields(cfg)))


def _shared_fields(cfg: dict) -> dict:
    get = cfg.get
    heads, d_model = cfg["num_attention_heads"], cfg["hidden_size"]
    nheads = get("mamba_n_heads", 128)
    headdim = get("mamba_d_head", "auto")
    if headdim == "auto":
        headdim = get("mamba_expand", 2) * d_model // nheads
    return dict(
        d_model=d_model, vocab_size=cfg["vocab_size"], norm_epsilon=get("rms_norm_eps", 1e-5),
        tie_embeddings=get("tie_word_embeddings", False),
        bos_token_id=_first_id(get("bos_token_id"), 1),
        eos_token_id=_first_id(get("eos_token_id"), 2),
        pad_token_id=_first_id(get("pad_token_id"), 0),
        d_state=get("mamba_d_state", 256), d_conv=get("mamba_d_conv", 4), nheads=nheads,
        headdim=headdim, ngroups=get("mamba_n_groups", 1),
        chunk_size=get("mamba_chunk_size", 256), conv_bias=get("mamba_conv_bias", True),
        bias=get("mamba_proj_bias", False), dt_min=_time_step_limit(cfg)[0],
        num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads") or heads,
        attention_bias=get("attention_bias", False))


def _bamba_fields(cfg: dict) -> dict:
    theta, rotary_dim = _rope(cfg, 0.5)
    return dict(layer_types=_layer_types(cfg), rope_theta=theta, rotary_dim=rotary_dim,
                intermediate_size=cfg.get("intermediate_size", 14336),
                mlp_bias=cfg.get("mlp_bias", False))


def _granite_fields(cfg: dict) -> dict:
    get = cfg.get
    position = get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ConfigError(f"position_embedding_type {position!r} is not supported (only None, "
                          "'nope', 'rope')")
    theta, rotary_dim = _rope(cfg, 1.0) if position == "rope" else (10000.0, 0)
    experts = get("num_local_experts", 8) or 0
    if experts and not 0 < get("num_experts_per_tok", 2) <= experts:
        raise ConfigError(f"num_experts_per_tok {get('num_experts_per_tok')} is not in 1.."
                          f"{experts}")
    return dict(
        model_type="granitemoehybrid", layer_types=_granite_layer_types(cfg),
        rope_theta=theta, rotary_dim=rotary_dim,
        intermediate_size=get("shared_intermediate_size", 1024), num_experts=experts,
        num_experts_per_tok=get("num_experts_per_tok", 2),
        expert_size=get("intermediate_size", 11008),
        embedding_multiplier=get("embedding_multiplier", 1.0),
        residual_multiplier=get("residual_multiplier", 1.0),
        attention_multiplier=get("attention_multiplier", 1.0),
        logits_scaling=get("logits_scaling", 1.0))


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


def _rope(cfg: dict, partial_default: float) -> tuple[float, int]:
    """(rope_theta, rotary_dim) of the default RoPE; other RoPE types refused.
    partial_rotary_factor defaults to 0.5 for Bamba, as transformers' BambaConfig sets it."""
    params = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0),
                                            **(cfg.get("rope_scaling") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
    partial = params.get("partial_rotary_factor", partial_default)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return params.get("rope_theta", 10000.0), int(head_dim * partial)


def _layer_types(cfg: dict) -> tuple:
    attention = set(cfg.get("attn_layer_indices") or ())
    n_layers = cfg["num_hidden_layers"]
    outside = sorted(i for i in attention if not 0 <= i < n_layers)
    if outside:
        raise ConfigError(f"attn_layer_indices {outside} are outside the {n_layers} layers")
    return tuple("attention" if i in attention else "mamba" for i in range(n_layers))


# Granite's layer_types, old names and transformers 5's
_GRANITE_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
                  "full_attention": "attention"}


def _granite_layer_types(cfg: dict) -> tuple:
    names = cfg.get("layer_types") or ["mamba"] * cfg["num_hidden_layers"]
    unknown = sorted(set(names) - set(_GRANITE_KINDS))
    if unknown:
        raise ConfigError(f"layer types {unknown} are not supported; supported: "
                          + ", ".join(_GRANITE_KINDS))
    return tuple(_GRANITE_KINDS[name] for name in names)


def bamba_mixer(kind: str, config: BambaConfig, device=None, dtype=None) -> nn.Module:
    """The mixer of a transformers layer of kind ``kind`` ("mamba" or "attention")."""
    c = config
    if kind == "mamba":
        return NemotronHMamba2Mixer(c, device, dtype)
    rotary = RotaryEmbedding(c.rotary_dim, c.rope_theta) if c.rotary_dim else None
    return Attention(c.d_model, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                     c.attention_bias, rotary, c.attention_multiplier, device, dtype)


def block_mixer(config: BambaConfig, block: int, device=None, dtype=None) -> nn.Module:
    """The mixer of quamba's block ``block``: layer block // 2's mixer, then its feed-forward."""
    if block % 2:
        return feed_forward(config, device, dtype)
    return bamba_mixer(config.layer_types[block // 2], config, device, dtype)


def feed_forward(config: BambaConfig, device=None, dtype=None) -> nn.Module:
    c, kw = config, dict(device=device, dtype=dtype)
    if not c.num_experts:
        return GatedMLP(c.d_model, c.intermediate_size, c.mlp_bias, **kw)
    return GraniteMoE(c.d_model, c.num_experts, c.num_experts_per_tok, c.expert_size,
                      c.intermediate_size, **kw)


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding times ``multiplier`` (Granite's embedding_multiplier)."""

    def __init__(self, num_embeddings: int, dim: int, multiplier: float, **kw):
        super().__init__(num_embeddings, dim, **kw)
        self.multiplier = multiplier

    def forward(self, input_ids):
        return super().forward(input_ids) * self.multiplier


class BambaBackbone(nn.Module):
    def __init__(self, config: BambaConfig, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        c = config
        self.embedding = (nn.Embedding(c.vocab_size, c.d_model, **kw)
                          if c.embedding_multiplier == 1 else
                          ScaledEmbedding(c.vocab_size, c.d_model, c.embedding_multiplier, **kw))
        self.layers = nn.ModuleList(Block(RMSNorm(c.d_model, c.norm_epsilon, False, **kw),
                                          block_mixer(c, i, **kw)) for i in range(c.n_layer))
        self.norm_f = RMSNorm(c.d_model, c.norm_epsilon, False, **kw)


class ScaledLogits:
    """The LM head's logits divided by ``config.logits_scaling`` (Granite's µP; 1 for Bamba), for
    the FP and the quantized model."""

    def _head(self, hidden, residual):
        logits = super()._head(hidden, residual)
        scaling = self.config.logits_scaling
        return logits if scaling == 1 else logits / scaling


class BambaLM(ScaledLogits, MambaLMHeadModel):
    """Bamba or Granite-4.0-H LM: embedding (times embedding_multiplier) → two blocks a layer →
    final RMSNorm → lm_head (untied by default; logits divided by logits_scaling). Forward,
    cache, decode and generate are MambaLMHeadModel's; the cache holds each Mamba layer's
    MixerState, each attention layer's KV cache, None for the feed-forwards."""

    def __init__(self, config: BambaConfig, device=None, dtype=None):
        nn.Module.__init__(self)  # MambaLMHeadModel's parts around other blocks
        self._assemble(config, BambaBackbone(config, device, dtype), config.vocab_size, device,
                       dtype)

    @property
    def model_type(self) -> str:
        return self.config.model_type


# each transformers sub-layer: (which of the layer's two blocks, its name there)
_SUBLAYERS = {"input_layernorm": (0, "norm"), "mamba": (0, "mixer"), "self_attn": (0, "mixer"),
              "pre_ff_layernorm": (1, "norm"), "post_attention_layernorm": (1, "norm"),
              "feed_forward": (1, "mixer"), "shared_mlp": (1, "mixer"),
              "block_sparse_moe": (1, "mixer")}
_TOP_NAMES = {"model.embed_tokens.weight": "backbone.embedding.weight",
              "model.final_layernorm.weight": "backbone.norm_f.weight",
              "model.norm.weight": "backbone.norm_f.weight"}
# the tensors of each block's output linear, which residual_multiplier scales
_OUTPUT_LINEARS = ("mixer.out_proj.", "mixer.o_proj.", "down_proj.")


def from_transformers_names(state: dict, config: BambaConfig) -> dict:
    """A transformers Bamba or Granite checkpoint's tensors under quamba's names:
    ``model.layers.{i}.mamba`` → ``backbone.layers.{2i}.mixer``, ``model.layers.{i}.feed_forward``
    → ``backbone.layers.{2i+1}.mixer`` ...; Granite's fused and stacked tensors split
    (_split_gated, _moe_tensors) and its residual_multiplier folded into each block's output
    linear. Unknown names pass unchanged, and are refused as unexpected."""
    renamed = {}
    for key, value in state.items():
        renamed.update(_rename(key, value, config))
    scale = config.residual_multiplier
    if scale == 1:
        return renamed
    return {key: value.float() * scale if any(part in key for part in _OUTPUT_LINEARS)
            else value for key, value in renamed.items()}


def _rename(key: str, value, config: BambaConfig) -> dict:
    parts = key.split(".")
    if not key.startswith("model.layers.") or parts[3] not in _SUBLAYERS:
        return {_TOP_NAMES.get(key, key): value}
    block, name = _SUBLAYERS[parts[3]]
    prefix, tail = f"backbone.layers.{2 * int(parts[2]) + block}.{name}", ".".join(parts[4:])
    if parts[3] == "shared_mlp":
        return _split_gated(prefix + (".shared_mlp" if config.num_experts else ""), tail, value)
    if parts[3] == "block_sparse_moe":
        return _moe_tensors(prefix, tail, value)
    return {f"{prefix}.{tail}": value}


def _split_gated(prefix: str, tail: str, value) -> dict:
    """Granite's fused input_linear (the gate's rows, then the up projection's) as GatedMLP's
    gate_proj and up_proj, its output_linear as down_proj."""
    if tail == "input_linear.weight":
        gate, up = value.chunk(2, dim=0)
        return {f"{prefix}.gate_proj.weight": gate, f"{prefix}.up_proj.weight": up}
    if tail == "output_linear.weight":
        return {f"{prefix}.down_proj.weight": value}
    return {f"{prefix}.{tail}": value}


# transformers 5's names of the stacked expert tensors, as the Hub checkpoints name them
_STACKED = {"experts.gate_up_proj": "input_linear.weight",
            "experts.down_proj": "output_linear.weight"}


def _moe_tensors(prefix: str, tail: str, value) -> dict:
    """The router's weight, and each expert's slice of the stacked expert tensors
    [experts, ...] (transformers 5's experts.gate_up_proj / down_proj or the Hub checkpoints'
    input_linear / output_linear)."""
    if tail in ("router.weight", "router.layer.weight"):
        return {f"{prefix}.router.weight": value}
    tail = _STACKED.get(tail, tail)
    renamed = {}
    for j, expert in enumerate(value.unbind(0)):
        renamed.update(_split_gated(f"{prefix}.experts.{j}", tail, expert))
    return renamed


def to_transformers_names(state: dict, config: BambaConfig) -> dict:
    """quamba's tensors of a Bamba or dense Granite-4.0-H model under transformers' names
    (from_transformers_names reversed): ``backbone.layers.{2i}.mixer`` →
    ``model.layers.{i}.mamba`` or ``.self_attn``, ``backbone.layers.{2i+1}.mixer`` →
    ``model.layers.{i}.feed_forward`` (Granite: ``.shared_mlp``, its gate_proj, up_proj and
    down_proj kept apart), their norms input_layernorm and pre_ff_layernorm (Granite:
    post_attention_layernorm). Any suffix (weight, weight_scale ...) is kept; Granite's fusing
    and residual_multiplier are the caller's."""
    granite = config.model_type == "granitemoehybrid"
    top = {"backbone.embedding.weight": "model.embed_tokens.weight",
           "backbone.norm_f.weight": "model.norm.weight" if granite
           else "model.final_layernorm.weight"}
    return {top.get(key) or _transformers_name(key, config, granite): value
            for key, value in state.items()}


def _transformers_name(key: str, config: BambaConfig, granite: bool) -> str:
    parts = key.split(".")
    if not key.startswith("backbone.layers."):
        return key
    layer, second = divmod(int(parts[2]), 2)
    ff_norm, ff = (("post_attention_layernorm", "shared_mlp") if granite
                   else ("pre_ff_layernorm", "feed_forward"))
    if parts[3] == "norm":
        sublayer = ff_norm if second else "input_layernorm"
    elif second:
        sublayer = ff
    else:
        sublayer = "mamba" if config.layer_types[layer] == "mamba" else "self_attn"
    return ".".join(["model.layers", str(layer), sublayer, *parts[4:]])
