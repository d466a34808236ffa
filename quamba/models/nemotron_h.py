"""Nemotron-H (transformers ``NemotronHForCausalLM``, model_type ``nemotron_h``): a hybrid whose
layers are, as ``hybrid_override_pattern`` (or ``layers_block_type``) says, Mamba2 mixers (M),
attention (*), MLPs (-) or MoE layers (E), each as ``h + layer(RMSNorm(h))``.

The Mamba2 layers are quamba's Mamba2Mixer (its grouped gated RMSNorm is Nemotron-H's) with Δ
floored at ``time_step_min`` as transformers' prefill does; the others are the plain nn.Linear
modules of quamba.models.transformer_layers. The model is a MambaLMHeadModel over these blocks:
the same forward, cache, decode and ``generate``. Its residual stream stays in the model dtype,
as transformers keeps it. Tensor names are the checkpoint's (``backbone.layers.{i}.mixer...``,
routed experts as ``experts.{j}.up_proj``), with ``backbone.embedding`` for
``backbone.embeddings``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from quamba.models.config import ConfigError, _first_id
from quamba.models.mamba import Block, MambaLMHeadModel, RMSNorm
from quamba.models.mamba2 import Mamba2Mixer
from quamba.models.transformer_layers import MLP, Attention, MoE, TopkRouter

# hybrid_override_pattern's letters and layers_block_type's names of each layer kind
LAYER_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# transformers model types of hybrid models that quamba cannot load (yet)
UNSUPPORTED_HYBRIDS = ("zamba",)


class HybridConfig:
    """What the hybrids' dataclass configs share: QuantizedMambaLM's fields of a MambaConfig,
    and the quantized checkpoint's dict (``model_type`` names the family)."""

    model_type: str
    # The quantized linears whose input is quantized per token (by the end of the name); None:
    # quamba.layers.qtransformer.DYNAMIC_INPUTS
    dynamic_inputs: tuple | None = None

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def residual_in_fp32(self) -> bool:
        return False

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v
                      for k, v in values.items() if k in known})


@dataclass
class NemotronHConfig(HybridConfig):
    """Shape of a Nemotron-H model. ``pattern`` has one letter a layer (LAYER_KINDS). The Mamba2
    fields carry Mamba2Mixer's names (d_inner = nheads · headdim, whatever ``expand`` says)."""

    pattern: str
    d_model: int
    vocab_size: int
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # Mamba2 layers
    d_state: int = 128
    d_conv: int = 4
    nheads: int = 128
    headdim: int = 64
    ngroups: int = 8
    chunk_size: int = 128
    conv_bias: bool = True
    bias: bool = False
    dt_min: float = 1e-3  # Δ's floor (time_step_min)
    # attention layers
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    attention_head_dim: int = 128
    # MLP and MoE layers
    intermediate_size: int = 21504
    mlp_bias: bool = False
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    model_type = "nemotron_h"

    def __post_init__(self):
        unknown = sorted(set(self.pattern) - set(LAYER_KINDS))
        if not self.pattern or unknown:
            raise ConfigError(f"layer types {unknown or 'none'} are not supported; supported: "
                              + ", ".join(f"{k} ({v})" for k, v in LAYER_KINDS.items()))
        if self.nheads % self.ngroups:
            raise ConfigError(f"{self.nheads} Mamba heads do not split into n_groups "
                              f"{self.ngroups}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{self.num_attention_heads} attention heads do not split into "
                              f"{self.num_key_value_heads} KV heads")
        if "E" in self.pattern:
            self._check_moe()

    def _check_moe(self) -> None:
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups or experts // groups < 2 or not 0 < self.topk_group <= groups:
            raise ConfigError(f"{experts} experts in n_group {groups} with topk_group "
                              f"{self.topk_group}: each group needs 2 experts or more")
        if not 0 < self.num_experts_per_tok <= self.topk_group * experts // groups:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} is more than the "
                              "experts of the chosen groups")

    @property
    def n_layer(self) -> int:
        return len(self.pattern)

    @property
    def d_inner(self) -> int:
        return self.nheads * self.headdim

    @classmethod
    def from_transformers(cls, cfg: dict) -> "NemotronHConfig":
        """From a transformers NemotronHConfig config.json; options that quamba cannot honour are
        refused by name (_check_supported)."""
        cfg = {_RENAMED.get(key, key): value for key, value in cfg.items()}
        _check_supported(cfg)
        get = cfg.get
        return cls(
            pattern=_pattern(cfg), d_model=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
            norm_epsilon=get("layer_norm_epsilon", 1e-5),
            tie_embeddings=get("tie_word_embeddings", False),
            bos_token_id=_first_id(get("bos_token_id"), 1),
            eos_token_id=_first_id(get("eos_token_id"), 2),
            pad_token_id=_first_id(get("pad_token_id"), 0),
            d_state=get("ssm_state_size", 128), d_conv=get("conv_kernel", 4),
            nheads=get("mamba_num_heads", 128), headdim=get("mamba_head_dim", 64),
            ngroups=get("n_groups", 8), chunk_size=get("chunk_size", 128),
            conv_bias=get("use_conv_bias", True), bias=get("use_bias", False),
            dt_min=get("time_step_min", 1e-3),
            num_attention_heads=get("num_attention_heads", 32),
            num_key_value_heads=get("num_key_value_heads") or get("num_attention_heads", 32),
            attention_head_dim=get("head_dim", 128),
            intermediate_size=get("intermediate_size", 21504), mlp_bias=get("mlp_bias", False),
            n_routed_experts=get("n_routed_experts", 8),
            num_experts_per_tok=get("num_experts_per_tok", 2),
            moe_intermediate_size=get("moe_intermediate_size", 7688),
            moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size", 7688),
            n_group=get("n_group", 1), topk_group=get("topk_group", 1),
            norm_topk_prob=get("norm_topk_prob", True),
            routed_scaling_factor=get("routed_scaling_factor", 1.0))


# Older config names that transformers' NemotronHConfig still reads
_RENAMED = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
            "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size",
            "mamba_dt_min": "time_step_min"}

# Options whose only supported value is the one given (transformers' default)
_FIXED_OPTIONS = {"mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "attention_bias": False,
                  "sliding_window": None, "residual_in_fp32": False, "moe_latent_size": None}


def _check_supported(cfg: dict) -> None:
    for key, supported in _FIXED_OPTIONS.items():
        if cfg.get(key, supported) != supported:
            raise ConfigError(f"{key} {cfg[key]!r} is not supported (only {supported!r})")


def _pattern(cfg: dict) -> str:
    """One letter a layer, from layers_block_type (transformers 5) or hybrid_override_pattern."""
    kinds = cfg.get("layers_block_type")
    if kinds is None:
        if "hybrid_override_pattern" not in cfg:
            raise ConfigError("config has neither layers_block_type nor hybrid_override_pattern")
        return str(cfg["hybrid_override_pattern"])
    letters = {name: letter for letter, name in LAYER_KINDS.items()}
    unknown = sorted(set(kinds) - set(letters))
    if unknown:
        raise ConfigError(f"layer types {unknown} are not supported; supported: "
                          f"{', '.join(letters)}")
    return "".join(letters[kind] for kind in kinds)


def dt_floor(config: NemotronHConfig) -> float | None:
    """softplus⁻¹(time_step_min): the floor of dt + dt_bias (None without a floor)."""
    return math.log(math.expm1(config.dt_min)) if config.dt_min > 0 else None


class NemotronHMamba2Mixer(Mamba2Mixer):
    """Mamba2Mixer with Δ = softplus(dt + dt_bias) floored at ``config.dt_min``, as transformers'
    NemotronHMamba2Mixer clamps it in a prefill (its decode step does not; quamba floors both, so
    decode follows prefill). The floor is put on dt before the bias and softplus: softplus is
    increasing, so max(dt, softplus⁻¹(dt_min) - dt_bias) gives Δ ≥ dt_min and leaves the SSD ops
    and their kernels as they are."""

    def __init__(self, config: NemotronHConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        self.dt_floor = dt_floor(config)

    def split_in_proj(self, projected):
        z, xbc, dt = super().split_in_proj(projected)
        if self.dt_floor is None:
            return z, xbc, dt
        return z, xbc, torch.maximum(dt, (self.dt_floor - self.dt_bias).to(dt.dtype))


def nemotron_h_layer(kind: str, config: NemotronHConfig, device=None, dtype=None) -> nn.Module:
    """The mixer of one layer of kind ``kind`` (a LAYER_KINDS letter)."""
    kw = dict(device=device, dtype=dtype)
    c = config
    if kind == "M":
        return NemotronHMamba2Mixer(c, **kw)
    if kind == "*":
        return Attention(c.d_model, c.num_attention_heads, c.num_key_value_heads,
                         c.attention_head_dim, **kw)
    if kind == "-":
        return MLP(c.d_model, c.intermediate_size, c.mlp_bias, **kw)
    router = TopkRouter(c.d_model, c.n_routed_experts, c.num_experts_per_tok, c.n_group,
                        c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, device)
    return MoE(c.d_model, c.n_routed_experts, c.moe_intermediate_size,
               c.moe_shared_expert_intermediate_size, router, c.mlp_bias, **kw)


class NemotronHBackbone(nn.Module):
    def __init__(self, config: NemotronHConfig, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embedding = nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.layers = nn.ModuleList(
            Block(RMSNorm(config.d_model, config.norm_epsilon, False, **kw),
                  nemotron_h_layer(kind, config, **kw))
            for kind in config.pattern)
        self.norm_f = RMSNorm(config.d_model, config.norm_epsilon, False, **kw)


class NemotronHLM(MambaLMHeadModel):
    """Nemotron-H LM: embedding → the pattern's blocks → final RMSNorm → lm_head (untied by
    default). Forward, cache, decode and generate are MambaLMHeadModel's; the cache holds each
    Mamba layer's MixerState, each attention layer's KV cache, None for MLP and MoE layers."""

    def __init__(self, config: NemotronHConfig, device=None, dtype=None):
        nn.Module.__init__(self)  # MambaLMHeadModel's parts around other blocks
        self._assemble(config, NemotronHBackbone(config, device, dtype), config.vocab_size,
                       device, dtype)
