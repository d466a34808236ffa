"""Falcon-H1 (transformers ``FalconH1ForCausalLM``, model_type ``falcon_h1``): a hybrid whose
every layer runs attention and a Mamba2 mixer in parallel on the same normed input, then a
SwiGLU feed-forward: ``h += mamba(n) + attention(n)`` with ``n = RMSNorm(h)``;
``h += feed_forward(RMSNorm(h))``.

quamba builds each transformers layer as two of its Blocks (the parallel mixer's, then the
feed-forward's), so the model is a MambaLMHeadModel over 2 × num_hidden_layers blocks: the same
forward, cache, decode and ``generate``. The Mamba2 mixer is Nemotron-H's (Δ floored at
``time_step_limit[0]``), its output gated by SiLU(z) without a norm unless ``mamba_rms_norm``;
attention has RoPE on all of each head. The µP multipliers: the embedding's and the logits' at
run time, all others folded into the weights on load (from_falcon_h1_names): ssm_in and
ssm_multipliers into in_proj, ssm_out into out_proj, attention_in into q/k/v, key_multiplier into
k_proj, attention_out into o_proj, mlp_multipliers into gate_proj and down_proj. Quantized, it
is quamba.models.quantized_hybrid's QuantizedFalconH1LM (the folded multipliers quantized with
their weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from quamba.models.bamba import ScaledEmbedding, _rope, _time_step_limit
from quamba.models.config import ConfigError, _first_id
from quamba.models.mamba import Block, MambaLMHeadModel, RMSNorm
from quamba.models.mamba2 import init_mamba2_parameters
from quamba.models.nemotron_h import HybridConfig, NemotronHMamba2Mixer
from quamba.models.state import DEFAULT_MAX_SEQLEN
from quamba.models.transformer_layers import Attention, GatedMLP, RotaryEmbedding
from quamba.ops.quant import dequantize


@dataclass
class FalconH1Config(HybridConfig):
    """Shape of a Falcon-H1 model; the Mamba2 fields carry Mamba2Mixer's names. The multipliers
    other than the embedding's and lm_head's are folded into the weights on load."""

    num_hidden_layers: int
    d_model: int
    vocab_size: int
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # Mamba2 mixers
    d_inner: int = 1024
    d_state: int = 256
    d_conv: int = 4
    nheads: int = 128
    headdim: int = 8
    ngroups: int = 1
    chunk_size: int = 256
    conv_bias: bool = True
    bias: bool = False
    dt_min: float = 0.0  # Δ's floor (time_step_limit[0])
    mamba_rms_norm: bool = False
    # attention
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    rope_theta: float = 10000.0
    # feed-forward
    intermediate_size: int = 14336
    mlp_bias: bool = False
    # µP multipliers
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_multipliers: tuple = (1.0, 1.0, 1.0, 1.0, 1.0)
    ssm_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    mlp_multipliers: tuple = (1.0, 1.0)
    model_type = "falcon_h1"
    # o_proj's input (the attention output) too: per token 1.7 to 2.4 times less error than static
    # (W8A8, that linear alone quantized, three random models; the whole model 0.052 against
    # 0.059; tests/quantization/test_quantize_falcon_h1.py)
    dynamic_inputs = ("down_proj", "o_proj")

    def __post_init__(self):
        if self.nheads * self.headdim != self.d_inner or self.nheads % self.ngroups:
            raise ConfigError(f"{self.nheads} Mamba heads of {self.headdim} do not make "
                              f"mamba_d_ssm {self.d_inner} in {self.ngroups} groups")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{self.num_attention_heads} attention heads do not split into "
                              f"{self.num_key_value_heads} KV heads")

    @property
    def n_layer(self) -> int:
        """quamba's blocks: two a transformers layer."""
        return 2 * self.num_hidden_layers

    @classmethod
    def from_transformers(cls, cfg: dict) -> "FalconH1Config":
        """From a transformers FalconH1Config config.json; options that quamba cannot honour are
        refused by name."""
        _check_supported(cfg)
        return cls(**_model_fields(cfg), **_mamba_fields(cfg), **_multipliers(cfg))


def _check_supported(cfg: dict) -> None:
    get = cfg.get
    if get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if get("mamba_rms_norm", False) and get("mamba_norm_before_gate", True):
        raise ConfigError("mamba_norm_before_gate with mamba_rms_norm is not supported (only "
                          "the norm after the gate, Mamba2's)")
    if get("mamba_proj_bias", False) != get("projectors_bias", False):
        raise ConfigError("mamba_proj_bias and projectors_bias differ; not supported (in_proj "
                          "and out_proj take a bias together)")


def _model_fields(cfg: dict) -> dict:
    get = cfg.get
    heads, d_model = cfg["num_attention_heads"], cfg["hidden_size"]
    return dict(
        num_hidden_layers=cfg["num_hidden_layers"], d_model=d_model,
        vocab_size=cfg["vocab_size"], norm_epsilon=get("rms_norm_eps", 1e-5),
        tie_embeddings=get("tie_word_embeddings", False),
        bos_token_id=_first_id(get("bos_token_id"), 1),
        eos_token_id=_first_id(get("eos_token_id"), 2),
        pad_token_id=_first_id(get("pad_token_id"), 0),
        num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or d_model // heads, attention_bias=get("attention_bias", False),
        rope_theta=_rope(cfg, 1.0)[0], intermediate_size=get("intermediate_size", 14336),
        mlp_bias=get("mlp_bias", False))


def _mamba_fields(cfg: dict) -> dict:
    get = cfg.get
    d_inner = get("mamba_d_ssm") or get("mamba_expand", 2) * cfg["hidden_size"]
    nheads = get("mamba_n_heads", 128)
    headdim = get("mamba_d_head", "auto")
    return dict(
        d_inner=d_inner, d_state=get("mamba_d_state", 256), d_conv=get("mamba_d_conv", 4),
        nheads=nheads, headdim=d_inner // nheads if headdim == "auto" else headdim,
        ngroups=get("mamba_n_groups", 1), chunk_size=get("mamba_chunk_size", 256),
        conv_bias=get("mamba_conv_bias", True), bias=get("mamba_proj_bias", False),
        dt_min=_time_step_limit(cfg)[0], mamba_rms_norm=get("mamba_rms_norm", False))


def _multipliers(cfg: dict) -> dict:
    names = ("embedding_multiplier", "lm_head_multiplier", "ssm_in_multiplier",
             "ssm_out_multiplier", "attention_in_multiplier", "key_multiplier",
             "attention_out_multiplier")
    fields = {name: cfg.get(name) or 1.0 for name in names}
    fields["ssm_multipliers"] = tuple(cfg.get("ssm_multipliers") or (1.0,) * 5)
    fields["mlp_multipliers"] = tuple(cfg.get("mlp_multipliers") or (1.0,) * 2)
    return fields


class SiluGate(nn.Module):
    """y · SiLU(z), in fp32, returned in ``out_dtype`` (default y's dtype): Falcon-H1's gate where
    it has no norm. Called as GatedRMSNorm is, so that the quantized Mamba2 mixer (QMamba2Mixer)
    takes it in its place: z float, or int8 codes of ``z_scale``; torch ops on every backend
    (``backend_name`` is not read)."""

    def forward(self, y, z, z_scale=None, out_dtype=None, backend_name=None):
        z = dequantize(z, z_scale) if z.dtype == torch.int8 else z.float()
        return (y.float() * F.silu(z)).to(out_dtype or y.dtype)


class FalconH1Mamba2Mixer(NemotronHMamba2Mixer):
    """Nemotron-H's Mamba2 mixer (Δ floored at dt_min); without ``mamba_rms_norm`` its gated
    norm is a plain SiLU gate."""

    def __init__(self, config: FalconH1Config, device=None, dtype=None):
        super().__init__(config, device, dtype)
        if not config.mamba_rms_norm:
            self.norm = SiluGate()


class ParallelMixer(nn.Module):
    """mamba(h) + self_attn(h) (their µP multipliers folded into their weights); its decode
    state is the pair of theirs."""

    def __init__(self, config: FalconH1Config, device=None, dtype=None):
        super().__init__()
        c = config
        self.mamba = FalconH1Mamba2Mixer(c, device, dtype)
        self.self_attn = Attention(c.d_model, c.num_attention_heads, c.num_key_value_heads,
                                   c.head_dim, c.attention_bias,
                                   RotaryEmbedding(c.head_dim, c.rope_theta), None, device, dtype)

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> tuple:
        return (self.mamba.allocate_state(batch_size, device),
                self.self_attn.allocate_state(batch_size, device, max_seqlen))

    def forward(self, h, state: tuple | None = None, step: bool = False):
        mamba_state, attention_state = state if state is not None else (None, None)
        return (self.mamba(h, state=mamba_state, step=step)
                + self.self_attn(h, state=attention_state, step=step))


class FalconH1Backbone(nn.Module):
    def __init__(self, config: FalconH1Config, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        c = config
        self.embedding = (nn.Embedding(c.vocab_size, c.d_model, **kw)
                          if c.embedding_multiplier == 1 else
                          ScaledEmbedding(c.vocab_size, c.d_model, c.embedding_multiplier, **kw))
        self.layers = nn.ModuleList()
        for _ in range(c.num_hidden_layers):
            self.layers.append(Block(RMSNorm(c.d_model, c.norm_epsilon, False, **kw),
                                     ParallelMixer(c, **kw)))
            self.layers.append(Block(RMSNorm(c.d_model, c.norm_epsilon, False, **kw),
                                     GatedMLP(c.d_model, c.intermediate_size, c.mlp_bias, **kw)))
        self.norm_f = RMSNorm(c.d_model, c.norm_epsilon, False, **kw)


class LMHeadMultiplier:
    """The LM head's logits times ``config.lm_head_multiplier`` (Falcon-H1's µP), for the FP and
    the quantized model."""

    def _head(self, hidden, residual):
        logits = super()._head(hidden, residual)
        multiplier = self.config.lm_head_multiplier
        return logits if multiplier == 1 else logits * multiplier


class FalconH1LM(LMHeadMultiplier, MambaLMHeadModel):
    """Falcon-H1 LM: embedding (times embedding_multiplier) → two blocks a layer → final RMSNorm
    → lm_head (logits times lm_head_multiplier). Forward, cache, decode and generate are
    MambaLMHeadModel's; the cache holds each parallel mixer's (MixerState, AttentionState), None
    for the feed-forwards."""

    def __init__(self, config: FalconH1Config, device=None, dtype=None):
        nn.Module.__init__(self)  # MambaLMHeadModel's parts around other blocks
        self._assemble(config, FalconH1Backbone(config, device, dtype), config.vocab_size,
                       device, dtype)
        with torch.no_grad():
            for block in self.backbone.layers[::2]:
                init_mamba2_parameters(block.mixer.mamba)


# each transformers sub-layer: (which of the layer's two blocks, its name there)
_SUBLAYERS = {"input_layernorm": (0, "norm"), "mamba": (0, "mixer.mamba"),
              "self_attn": (0, "mixer.self_attn"), "pre_ff_layernorm": (1, "norm"),
              "feed_forward": (1, "mixer")}
_TOP_NAMES = {"model.embed_tokens.weight": "backbone.embedding.weight",
              "model.final_layernorm.weight": "backbone.norm_f.weight"}


def from_falcon_h1_names(state: dict, config: FalconH1Config) -> dict:
    """A transformers Falcon-H1 checkpoint's tensors under quamba's names
    (``model.layers.{i}.mamba`` → ``backbone.layers.{2i}.mixer.mamba``,
    ``model.layers.{i}.feed_forward`` → ``backbone.layers.{2i+1}.mixer`` ...), the µP multipliers
    folded in. Unknown names pass unchanged, and are refused as unexpected."""
    renamed = {}
    for key, value in state.items():
        parts = key.split(".")
        if key.startswith("model.layers.") and parts[3] in _SUBLAYERS:
            block, name = _SUBLAYERS[parts[3]]
            key = f"backbone.layers.{2 * int(parts[2]) + block}.{name}.{'.'.join(parts[4:])}"
        key = _TOP_NAMES.get(key, key)
        renamed[key] = _folded(key, value, config)
    return renamed


def _mup_vector(c: FalconH1Config) -> torch.Tensor:
    """ssm_multipliers over in_proj's rows: z, x, B, C, dt."""
    groups = c.ngroups * c.d_state
    sizes = (c.d_inner, c.d_inner, groups, groups, c.nheads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, c.ssm_multipliers)])


def linear_multipliers(c: FalconH1Config) -> tuple[dict, dict]:
    """(multipliers of each linear's output, its weight and bias; of its input, its weight
    only), by the linear's name in its block."""
    gate, down = c.mlp_multipliers
    outputs = {"mixer.mamba.in_proj": _mup_vector(c),
               "mixer.mamba.out_proj": c.ssm_out_multiplier,
               "mixer.self_attn.k_proj": c.key_multiplier,
               "mixer.self_attn.o_proj": c.attention_out_multiplier,
               "mixer.gate_proj": gate, "mixer.down_proj": down}
    inputs = {"mixer.mamba.in_proj": c.ssm_in_multiplier,
              **{f"mixer.self_attn.{p}_proj": c.attention_in_multiplier for p in "qkv"}}
    return outputs, inputs


def _folded(key: str, value: torch.Tensor, config: FalconH1Config) -> torch.Tensor:
    if not key.startswith("backbone.layers."):
        return value
    linear, kind = key.split(".", 3)[3].rsplit(".", 1)
    outputs, inputs = linear_multipliers(config)
    scale = torch.as_tensor(outputs.get(linear, 1.0), dtype=torch.float32)
    if kind == "weight":
        scale = scale.reshape(-1, 1) * inputs.get(linear, 1.0)
    if bool((scale == 1).all()):
        return value
    return value.float() * scale


def to_falcon_h1_names(state: dict) -> dict:
    """quamba's tensors of a Falcon-H1 model under the checkpoint's names (from_falcon_h1_names
    reversed, without the multipliers: quamba.export unfolds them). Any suffix is kept."""
    top = {quamba: hf for hf, quamba in _TOP_NAMES.items()}
    return {top.get(key) or _falcon_h1_name(key): value for key, value in state.items()}


def _falcon_h1_name(key: str) -> str:
    parts = key.split(".")
    if not key.startswith("backbone.layers."):
        return key
    layer, second = divmod(int(parts[2]), 2)
    for sublayer, (block, name) in _SUBLAYERS.items():
        prefix = name.split(".")
        if block == second and parts[3:3 + len(prefix)] == prefix:
            return ".".join(["model.layers", str(layer), sublayer, *parts[3 + len(prefix):]])
    return key
