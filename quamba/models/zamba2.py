"""Zamba2 (transformers ``Zamba2ForCausalLM``, model_type ``zamba2``): a hybrid whose layers are
each a Mamba2 mixer, ``h += mamba(RMSNorm(h))``, or "hybrid": one of ``num_mem_blocks`` SHARED
transformer blocks (attention, then a gated MLP) runs on RMSNorm([h, embedding]) (the hidden
state beside the token embeddings, 2 · d_model wide), a per-layer linear projects its output t,
and ``h += mamba(RMSNorm(h + t))``. The shared blocks take turns (use u runs block
u mod num_mem_blocks); each use adds its own LoRA adapters (two linears through
``adapter_rank``) to the block's gate_up projection, and with use_shared_attention_adapter to
q, k and v.

quamba holds each shared block once (``backbone.shared_blocks``); a hybrid layer holds its
adapters, its linear and its Mamba2 mixer, and points to its block. Each use keeps its own KV
cache. The Mamba2 layers are Nemotron-H's mixer (Δ floored at ``time_step_min``, as
transformers' prefill clamps it). Tensor names are quamba's, read by from_zamba2_names. The
quantized model is quamba.models.quantized_hybrid.QuantizedZamba2LM.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from quamba.models.config import ConfigError, _first_id
from quamba.models.mamba import MambaLMHeadModel, RMSNorm
from quamba.models.nemotron_h import HybridConfig, NemotronHMamba2Mixer
from quamba.models.state import DEFAULT_MAX_SEQLEN, AttentionState, InferenceCache, MixerState
from quamba.models.transformer_layers import Attention, RotaryEmbedding

# transformers' layer kinds, old names and transformers 5's
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}


@dataclass
class Zamba2Config(HybridConfig):
    """Shape of a Zamba2 model. ``layer_types`` has one entry a layer, "mamba" or "hybrid"; the
    Mamba2 fields carry Mamba2Mixer's names; attention heads are 2 · d_model / heads wide."""

    layer_types: tuple
    d_model: int
    vocab_size: int
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = True  # always: from_transformers refuses untied ones
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # Mamba2 layers
    d_state: int = 64
    d_conv: int = 4
    nheads: int = 8
    headdim: int = 640
    ngroups: int = 1
    chunk_size: int = 256
    conv_bias: bool = True
    bias: bool = False
    dt_min: float = 0.001  # Δ's floor (time_step_min)
    # shared transformer blocks
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    use_rope: bool = False
    rope_theta: float = 10000.0
    intermediate_size: int = 10240
    num_mem_blocks: int = 1
    adapter_rank: int = 128
    attention_adapters: bool = False
    model_type: str = "zamba2"

    @property
    def n_layer(self) -> int:
        return len(self.layer_types)

    @property
    def d_inner(self) -> int:
        return self.nheads * self.headdim

    @property
    def head_dim(self) -> int:
        return 2 * self.d_model // self.num_attention_heads

    @classmethod
    def from_transformers(cls, cfg: dict) -> "Zamba2Config":
        """From a transformers Zamba2Config config.json; options that quamba cannot honour are
        refused by name."""
        _check_supported(cfg)
        get = cfg.get
        return cls(
            layer_types=_layer_types(cfg), d_model=cfg["hidden_size"],
            vocab_size=cfg["vocab_size"], norm_epsilon=get("rms_norm_eps", 1e-5),
            tie_embeddings=get("tie_word_embeddings", True),
            bos_token_id=_first_id(get("bos_token_id"), 1),
            eos_token_id=_first_id(get("eos_token_id"), 2),
            pad_token_id=_first_id(get("pad_token_id"), 0),
            d_state=get("mamba_d_state", 64), d_conv=get("mamba_d_conv", 4),
            nheads=get("n_mamba_heads", 8), headdim=_mamba_d_inner(cfg) // get("n_mamba_heads", 8),
            ngroups=get("mamba_ngroups", 1), chunk_size=get("chunk_size", 256),
            dt_min=get("time_step_min", 0.001), num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=get("num_key_value_heads") or cfg["num_attention_heads"],
            use_rope=get("use_mem_rope", False), rope_theta=_rope_theta(cfg),
            intermediate_size=get("intermediate_size") or 4 * cfg["hidden_size"],
            num_mem_blocks=get("num_mem_blocks", 1), adapter_rank=get("adapter_rank", 128),
            attention_adapters=get("use_shared_attention_adapter", False))


def _mamba_d_inner(cfg: dict) -> int:
    return int(cfg.get("mamba_expand", 2) * cfg["hidden_size"])


def _check_supported(cfg: dict) -> None:
    get = cfg.get
    refused = {"hidden_act": (get("hidden_act", "gelu"), ("gelu",)),
               "add_bias_linear": (get("add_bias_linear", False), (False,)),
               "use_long_context": (get("use_long_context", False), (False,)),
               "rms_norm_eps": (get("rms_norm_eps", 1e-5), (1e-5,)),
               # transformers ties the shared blocks' uses only with tied embeddings
               "tie_word_embeddings": (get("tie_word_embeddings", True), (True,))}
    for name, (value, allowed) in refused.items():
        if value not in allowed:
            raise ConfigError(f"{name} {value!r} is not supported (only "
                              f"{', '.join(map(repr, allowed))})")
    heads, kv_heads = cfg["num_attention_heads"], get("num_key_value_heads") or 0
    if 2 * cfg["hidden_size"] % heads or (kv_heads and heads % kv_heads):
        raise ConfigError(f"{heads} attention heads do not split 2 · hidden_size "
                          f"{2 * cfg['hidden_size']} over {kv_heads or heads} KV heads")
    if get("use_shared_attention_adapter") and kv_heads not in (0, heads):
        raise ConfigError("use_shared_attention_adapter with num_key_value_heads "
                          f"{kv_heads} is not supported (only num_attention_heads {heads})")
    if _mamba_d_inner(cfg) % get("n_mamba_heads", 8):
        raise ConfigError(f"mamba_expand · hidden_size {_mamba_d_inner(cfg)} does not split "
                          f"into {get('n_mamba_heads', 8)} Mamba heads")


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0),
                                            **(cfg.get("rope_scaling") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if cfg.get("use_mem_rope", False) and rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
    return params.get("rope_theta", 10000.0)


def _layer_types(cfg: dict) -> tuple:
    names = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not names:
        raise ConfigError("layers_block_type is missing")
    unknown = sorted(set(names) - set(_KINDS))
    if unknown:
        raise ConfigError(f"layer types {unknown} are not supported; supported: "
                          + ", ".join(_KINDS))
    return tuple(_KINDS[name] for name in names)


def adapter(d_in: int, rank: int, d_out: int, **kw) -> nn.Sequential:
    """LoRA: d_in → rank → d_out, no bias."""
    return nn.Sequential(nn.Linear(d_in, rank, bias=False, **kw),
                         nn.Linear(rank, d_out, bias=False, **kw))


class Zamba2Adapters(nn.Module):
    """One use's adapters: gate_up, and with attention adapters q, k and v."""

    def __init__(self, config: Zamba2Config, device=None, dtype=None):
        super().__init__()
        c, kw = config, dict(device=device, dtype=dtype)
        width = 2 * c.d_model
        self.gate_up = adapter(c.d_model, c.adapter_rank, 2 * c.intermediate_size, **kw)
        self.qkv = (nn.ModuleList(adapter(width, c.adapter_rank, width, **kw) for _ in range(3))
                    if c.attention_adapters else None)


class Zamba2SharedBlock(nn.Module):
    """A shared transformer block: RMSNorm of [h, embedding] → attention (scale
    1/sqrt(head_dim / 2), RoPE on whole heads where use_rope) → RMSNorm → gated MLP
    (act(gate) · up, GELU), no residual; a use's adapters add to the projections."""

    def __init__(self, config: Zamba2Config, device=None, dtype=None):
        super().__init__()
        c, kw = config, dict(device=device, dtype=dtype)
        width = 2 * c.d_model
        self.input_norm = RMSNorm(width, c.norm_epsilon, False, **kw)
        rotary = RotaryEmbedding(c.head_dim, c.rope_theta) if c.use_rope else None
        self.attention = Attention(width, c.num_attention_heads, c.num_key_value_heads,
                                   c.head_dim, False, rotary, (c.head_dim / 2) ** -0.5,
                                   d_out=c.d_model, **kw)
        self.pre_ff_norm = RMSNorm(c.d_model, c.norm_epsilon, False, **kw)
        self.gate_up_proj = nn.Linear(c.d_model, 2 * c.intermediate_size, bias=False, **kw)
        self.down_proj = nn.Linear(c.intermediate_size, c.d_model, bias=False, **kw)

    def forward(self, h, embedding, adapters: Zamba2Adapters, state, step: bool):
        x, _ = self.input_norm(torch.cat([h, embedding], dim=-1))
        attn = self.attention
        qkv = [proj(x) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]
        if adapters.qkv is not None:
            qkv = [out + lora(x) for out, lora in zip(qkv, adapters.qkv)]
        x, _ = self.pre_ff_norm(attn.attend(*qkv, state, step))
        gate, up = (self.gate_up_proj(x) + adapters.gate_up(x)).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate) * up)


@dataclass
class HybridState:
    """Decode state of a hybrid layer: its Mamba2 mixer's and its use's KV cache."""

    mixer: MixerState
    attention: AttentionState

    @property
    def conv(self) -> torch.Tensor:
        """The mixer's conv state (InferenceCache reads the batch size from it)."""
        return self.mixer.conv


class Zamba2Layer(nn.Module):
    """A layer: ``h += mixer(norm(h))``, or, given a shared block (a hybrid layer),
    ``h += mixer(norm(h + linear(shared(h, embedding))))``. Called as a Block: (hidden,
    residual) in, (mixer output, h) out."""

    def __init__(self, config: Zamba2Config, shared: Zamba2SharedBlock | None = None,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm = RMSNorm(config.d_model, config.norm_epsilon, False, **kw)
        self.mixer = NemotronHMamba2Mixer(config, **kw)
        self._shared = (shared,)  # a tuple: the block is registered once, in the backbone
        if shared is not None:
            self.adapters = Zamba2Adapters(config, **kw)
            self.linear = nn.Linear(config.d_model, config.d_model, bias=False, **kw)

    @property
    def shared(self) -> Zamba2SharedBlock | None:
        return self._shared[0]

    def set_shared(self, block: Zamba2SharedBlock) -> None:
        """Point to ``block`` (a hybrid layer's; not registered here, nn.Module would)."""
        self._shared = (block,)

    def allocate_state(self, batch_size: int, device=None, max_seqlen: int = DEFAULT_MAX_SEQLEN):
        state = self.mixer.allocate_state(batch_size, device)
        if self.shared is None:
            return state
        return HybridState(state, self.shared.attention.allocate_state(batch_size, device,
                                                                       max_seqlen))

    def forward(self, hidden, residual=None, state=None, step=False, ssm_A=None,
                embedding=None):
        h = hidden if residual is None else hidden + residual
        kw = {} if ssm_A is None else {"ssm_A": ssm_A}
        if self.shared is None:
            return self.mixer(self.norm(h)[0], state=state, step=step, **kw), h
        mixer_state, attention_state = (None, None) if state is None else (state.mixer,
                                                                           state.attention)
        t = self.shared(h, embedding, self.adapters, attention_state, step)
        normed, _ = self.norm(h, self.linear(t))
        return self.mixer(normed, state=mixer_state, step=step, **kw), h


class Zamba2Backbone(nn.Module):
    def __init__(self, config: Zamba2Config, device=None, dtype=None):
        super().__init__()
        c, kw = config, dict(device=device, dtype=dtype)
        self.embedding = nn.Embedding(c.vocab_size, c.d_model, **kw)
        self.shared_blocks = nn.ModuleList(Zamba2SharedBlock(c, **kw)
                                           for _ in range(num_shared_blocks(c)))
        self.layers = nn.ModuleList(
            Zamba2Layer(c, self.shared_blocks[shared_block_of(c, i)] if kind == "hybrid"
                        else None, **kw)
            for i, kind in enumerate(c.layer_types))
        self.norm_f = RMSNorm(c.d_model, c.norm_epsilon, False, **kw)


def _use(config: Zamba2Config, layer: int) -> int:
    """Which use of the shared blocks the hybrid layer ``layer`` is (0, 1, ...)."""
    return config.layer_types[:layer].count("hybrid")


def num_shared_blocks(config: Zamba2Config) -> int:
    return min(config.num_mem_blocks, config.layer_types.count("hybrid"))


def shared_block_of(config: Zamba2Config, layer: int) -> int:
    """The index of the shared block that the hybrid layer ``layer`` runs."""
    return _use(config, layer) % config.num_mem_blocks


def shared_block_users(config: Zamba2Config, block: int) -> list[int]:
    """The hybrid layers that run shared block ``block``."""
    return [i for i, kind in enumerate(config.layer_types)
            if kind == "hybrid" and shared_block_of(config, i) == block]


class Zamba2LM(MambaLMHeadModel):
    """Zamba2 LM: embedding → the layers → final RMSNorm → lm_head (tied by default). Forward,
    cache, decode and generate are MambaLMHeadModel's, each layer given the token embeddings;
    the cache holds each Mamba layer's MixerState and each hybrid layer's HybridState."""

    def __init__(self, config: Zamba2Config, device=None, dtype=None):
        nn.Module.__init__(self)  # MambaLMHeadModel's parts around other blocks
        self._assemble(config, Zamba2Backbone(config, device, dtype), config.vocab_size, device,
                       dtype)

    @property
    def model_type(self) -> str:
        return "zamba2"

    def allocate_cache(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> InferenceCache:
        return self.new_cache([layer.allocate_state(batch_size, device, max_seqlen)
                               for layer in self.backbone.layers], max_seqlen)

    def _layer_kwargs(self, embedding) -> dict:
        return {"embedding": embedding}


# transformers' names under a layer → quamba's
_LAYER_NAMES = (("mamba_decoder.mamba.", "mixer."), ("mamba_decoder.input_layernorm.", "norm."),
                ("mamba.", "mixer."), ("input_layernorm.", "norm."), ("linear.", "linear."))
_SHARED_NAMES = (("self_attn.", "attention."), ("input_layernorm.", "input_norm."),
                 ("pre_ff_layernorm.", "pre_ff_norm."), ("feed_forward.", ""))
_ADAPTER = re.compile(r"(?:self_attn\.linear_([qkv])_adapter_list|feed_forward\."
                      r"gate_up_proj_adapter_list)\.(\d+)\.(.*)")
_TOP_NAMES = {"model.embed_tokens.weight": "backbone.embedding.weight",
              "model.final_layernorm.weight": "backbone.norm_f.weight"}


def from_zamba2_names(state: dict, config: Zamba2Config) -> dict:
    """A transformers Zamba2 checkpoint's tensors under quamba's names: ``model.layers.{i}.mamba``
    and ``.mamba_decoder.mamba`` → ``backbone.layers.{i}.mixer``; a use's shared transformer
    (which transformers saves under every layer that uses it) → ``backbone.shared_blocks.{b}``,
    its adapter of use u → ``backbone.layers.{the u-th hybrid layer}.adapters``. Unknown names
    pass unchanged, and are refused as unexpected."""
    renamed = {}
    for key, value in state.items():
        renamed[_rename(key, config)] = value
    return renamed


def _rename(key: str, config: Zamba2Config) -> str:
    parts = key.split(".", 3)
    if not key.startswith("model.layers.") or len(parts) < 4:
        return _TOP_NAMES.get(key, key)
    layer, tail = int(parts[2]), parts[3]
    if tail.startswith("shared_transformer."):
        return _shared_name(layer, tail[len("shared_transformer."):], config)
    for old, new in _LAYER_NAMES:
        if tail.startswith(old):
            return f"backbone.layers.{layer}.{new}{tail[len(old):]}"
    return key


def _shared_name(layer: int, tail: str, config: Zamba2Config) -> str:
    match = _ADAPTER.fullmatch(tail)
    if match:
        which, use, rest = match.groups()
        hybrid = [i for i, kind in enumerate(config.layer_types) if kind == "hybrid"][int(use)]
        where = f"qkv.{'qkv'.index(which)}" if which else "gate_up"
        return f"backbone.layers.{hybrid}.adapters.{where}.{rest}"
    block = shared_block_of(config, layer)
    for old, new in _SHARED_NAMES:
        if tail.startswith(old):
            return f"backbone.shared_blocks.{block}.{new}{tail[len(old):]}"
    return f"model.layers.{layer}.shared_transformer.{tail}"


def to_zamba2_names(state: dict, config: Zamba2Config) -> dict:
    """quamba's tensors of a Zamba2 model under the checkpoint's names (from_zamba2_names
    reversed): a shared block under the first hybrid layer that runs it, as transformers saves
    it, with every use's adapters in its adapter lists; the layers' Mamba mixers as ``mamba`` or
    (hybrid layers) ``mamba_decoder.mamba``. Any suffix (weight, weight_scale ...) is kept."""
    owners = {}  # shared block → the first hybrid layer that runs it
    for layer, kind in enumerate(config.layer_types):
        if kind == "hybrid":
            owners.setdefault(shared_block_of(config, layer), layer)
    top = {quamba: hf for hf, quamba in _TOP_NAMES.items()}
    return {top.get(key) or _zamba2_name(key, config, owners): value
            for key, value in state.items()}


def _zamba2_name(key: str, config: Zamba2Config, owners: dict) -> str:
    parts = key.split(".")
    if key.startswith("backbone.shared_blocks."):
        return f"model.layers.{owners[int(parts[2])]}.shared_transformer." + \
            _shared_tail(".".join(parts[3:]))
    if not key.startswith("backbone.layers."):
        return key
    layer, part, rest = int(parts[2]), parts[3], parts[4:]
    if part == "adapters":
        return _adapter_name(layer, rest, config, owners)
    hybrid = config.layer_types[layer] == "hybrid"
    prefix = {"mixer": "mamba_decoder.mamba" if hybrid else "mamba",
              "norm": "mamba_decoder.input_layernorm" if hybrid else "input_layernorm",
              "linear": "linear"}[part]
    return ".".join([f"model.layers.{layer}", prefix, *rest])


def _shared_tail(tail: str) -> str:
    for hf, quamba in _SHARED_NAMES:
        if quamba and tail.startswith(quamba):
            return hf + tail[len(quamba):]
    return "feed_forward." + tail  # the block's gate_up_proj and down_proj


def _adapter_name(layer: int, rest: list, config: Zamba2Config, owners: dict) -> str:
    """Hybrid layer ``layer``'s adapter ``rest`` (qkv.{j}... or gate_up...) in its shared
    block's adapter list, at the layer's use."""
    use, owner = _use(config, layer), owners[shared_block_of(config, layer)]
    if rest[0] == "qkv":
        name, rest = f"self_attn.linear_{'qkv'[int(rest[1])]}_adapter_list.{use}", rest[2:]
    else:
        name, rest = f"feed_forward.gate_up_proj_adapter_list.{use}", rest[1:]
    return ".".join([f"model.layers.{owner}.shared_transformer.{name}", *rest])
