"""Mamba1 model configuration, and conversion from the two Hub config layouts."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from quamba.ops.scan.discretization import DEFAULT as DEFAULT_DISCRETIZATION
from quamba.ops.scan.discretization import METHODS as DISCRETIZATIONS


class ConfigError(ValueError):
    """A model configuration that quamba cannot build."""


# The transformers model types of Mamba1 LMs; falcon_mamba adds the norms of dt, B and C.
TRANSFORMERS_MAMBA1_TYPES = ("mamba", "falcon_mamba")
FALCON_MAMBA_MIXER_RMS_EPS = 1e-6  # transformers' FalconMambaConfig default
# transformers' Mamba2Config defaults (Mamba-Codestral-7B's shape), for the fields a config.json
# omits. transformers has no norm_before_gate or rms_norm field: its gated norm is always
# RMSNorm(y * SiLU(z)) over groups, whatever a config.json says about them.
MAMBA2_TRANSFORMERS_DEFAULTS = dict(
    hidden_size=4096, num_hidden_layers=64, vocab_size=32768, state_size=128, expand=2,
    num_heads=128, head_dim=64, n_groups=8, conv_kernel=4, chunk_size=256, use_bias=False,
    use_conv_bias=True, layer_norm_epsilon=1e-5, residual_in_fp32=True, hidden_act="silu",
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=1)


@dataclass
class MambaConfig:
    """Shape and numerics of a Mamba language model (names follow mamba_ssm).

    ``layer`` is the block type: "Mamba1" (dt_rank used) or "Mamba2" (multi-head SSD: ``headdim``
    channels per head, ``ngroups`` groups of B and C shared by heads, scan in chunks of
    ``chunk_size`` tokens; its gated RMSNorm normalizes each group of d_inner / ngroups channels).
    ``discretization``: how the Mamba1 selective scan discretizes its ODE ("zoh", mamba_ssm's, by
    default; see quamba.ops.scan.discretization); Mamba2 runs zoh only. ``mixer_rms_eps``
    (Falcon-Mamba, Mamba1 only): the eps of the weightless RMS norms of dt_low, B and C after
    x_proj (quamba.ops.norm.mixer_norm); None: no such norms.
    """

    d_model: int = 768
    n_layer: int = 24
    vocab_size: int = 50277
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int = 0  # 0 means "auto": ceil(d_model / 16)
    conv_bias: bool = True
    bias: bool = False  # bias of in_proj and out_proj
    norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 0
    pad_token_id: int = 0
    layer: str = "Mamba1"
    headdim: int = 64  # Mamba2
    ngroups: int = 1  # Mamba2
    chunk_size: int = 256  # Mamba2
    discretization: str = DEFAULT_DISCRETIZATION
    mixer_rms_eps: float | None = None

    def __post_init__(self):
        if self.dt_rank in (0, "auto", None):
            self.dt_rank = math.ceil(self.d_model / 16)
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand", "dt_rank",
                     "headdim", "ngroups", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.layer not in ("Mamba1", "Mamba2"):
            raise ConfigError(f"layer must be Mamba1 or Mamba2, got {self.layer!r}")
        if self.discretization not in DISCRETIZATIONS:
            raise ConfigError(f"discretization must be one of {', '.join(DISCRETIZATIONS)}, "
                              f"got {self.discretization!r}")
        if self.layer == "Mamba2" and self.discretization != DEFAULT_DISCRETIZATION:
            raise ConfigError(f"Mamba2's SSD scan implements only the {DEFAULT_DISCRETIZATION!r} "
                              f"discretization, not {self.discretization!r}")
        self._check_mixer_rms_eps()
        if self.layer == "Mamba2":
            if self.d_inner % self.headdim:
                raise ConfigError(f"d_inner {self.d_inner} is not a multiple of headdim {self.headdim}")
            if self.nheads % self.ngroups:
                raise ConfigError(f"{self.nheads} heads do not split into ngroups {self.ngroups}")

    def _check_mixer_rms_eps(self) -> None:
        eps = self.mixer_rms_eps
        if eps is None:
            return
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ConfigError(f"mixer_rms_eps must be a positive number, got {eps!r}")
        if self.layer != "Mamba1":
            raise ConfigError("mixer_rms_eps (norms of dt, B and C) applies to Mamba1 layers only")

    @property
    def nheads(self) -> int:
        """Mamba2: the number of SSM heads."""
        return self.d_inner // self.headdim

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def padded_vocab_size(self) -> int:
        multiple = max(1, self.pad_vocab_size_multiple)
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "MambaConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    # --- Hub layouts -------------------------------------------------------------------------

    @classmethod
    def from_mamba_ssm(cls, cfg: dict) -> "MambaConfig":
        """From a mamba_ssm config.json (state-spaces/mamba-130m)."""
        ssm_cfg = dict(cfg.get("ssm_cfg") or {})
        layer = ssm_cfg.pop("layer", "Mamba1")
        if layer not in ("Mamba1", "Mamba2"):
            raise ConfigError(f"ssm_cfg.layer is {layer!r}; Mamba1 and Mamba2 models are supported")
        if layer == "Mamba2":
            _check_mamba2_options(ssm_cfg, cfg["d_model"])
        if cfg.get("attn_layer_idx"):
            raise ConfigError("hybrid models with attention layers (attn_layer_idx) are not supported")
        if cfg.get("d_intermediate", 0):
            raise ConfigError("models with MLP layers (d_intermediate > 0) are not supported")
        if not cfg.get("rms_norm", True):
            raise ConfigError("rms_norm is false (LayerNorm blocks); only RMSNorm models are supported")
        mamba2 = layer == "Mamba2"
        return cls(
            d_model=cfg["d_model"],
            n_layer=cfg["n_layer"],
            vocab_size=cfg["vocab_size"],
            d_state=ssm_cfg.get("d_state", 128 if mamba2 else 16),
            d_conv=ssm_cfg.get("d_conv", 4),
            expand=ssm_cfg.get("expand", 2),
            dt_rank=ssm_cfg.get("dt_rank", 0),
            conv_bias=ssm_cfg.get("conv_bias", True),
            bias=ssm_cfg.get("bias", False),
            residual_in_fp32=cfg.get("residual_in_fp32", True),
            pad_vocab_size_multiple=cfg.get("pad_vocab_size_multiple", 8),
            tie_embeddings=cfg.get("tie_embeddings", True),
            layer=layer,
            headdim=ssm_cfg.get("headdim", 64),
            ngroups=ssm_cfg.get("ngroups", 1),
            chunk_size=ssm_cfg.get("chunk_size", 256),
            discretization=ssm_cfg.get("discretization", DEFAULT_DISCRETIZATION),
        )

    @classmethod
    def from_transformers(cls, cfg: dict) -> "MambaConfig":
        """From a transformers MambaConfig, FalconMambaConfig or Mamba2Config config.json
        (state-spaces/mamba-130m-hf, tiiuae/falcon-mamba-7b)."""
        model_type = cfg.get("model_type", "mamba")
        if model_type == "mamba2":
            return cls._from_transformers_mamba2(cfg)
        if model_type not in TRANSFORMERS_MAMBA1_TYPES:
            raise ConfigError(f"model_type is {model_type!r}; supported: "
                              f"{', '.join(TRANSFORMERS_MAMBA1_TYPES)}, mamba2")
        hidden = cfg["hidden_size"]
        if model_type == "falcon_mamba":
            expand, mixer_rms_eps = _falcon_mamba_options(cfg, hidden)
        else:
            expand, mixer_rms_eps = cfg.get("expand", 2), None
            intermediate = cfg.get("intermediate_size", expand * hidden)
            if intermediate != expand * hidden:
                raise ConfigError(f"intermediate_size {intermediate} is not expand * hidden_size")
        return cls(
            d_model=hidden,
            n_layer=cfg["num_hidden_layers"],
            vocab_size=cfg["vocab_size"],
            d_state=cfg.get("state_size", 16),
            d_conv=cfg.get("conv_kernel", 4),
            expand=expand,
            dt_rank=cfg.get("time_step_rank", 0),
            conv_bias=cfg.get("use_conv_bias", True),
            bias=cfg.get("use_bias", False),
            norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
            residual_in_fp32=cfg.get("residual_in_fp32", True),
            pad_vocab_size_multiple=1,
            tie_embeddings=cfg.get("tie_word_embeddings", True),
            bos_token_id=_first_id(cfg.get("bos_token_id"), 0),
            eos_token_id=_first_id(cfg.get("eos_token_id"), 0),
            pad_token_id=_first_id(cfg.get("pad_token_id"), 0),
            discretization=cfg.get("discretization", DEFAULT_DISCRETIZATION),
            mixer_rms_eps=mixer_rms_eps,
        )

    @classmethod
    def _from_transformers_mamba2(cls, raw: dict) -> "MambaConfig":
        """A transformers Mamba2Config; a field it omits takes transformers' default (those are
        Mamba-Codestral-7B's shape, not mamba2-130m's)."""
        cfg = {**MAMBA2_TRANSFORMERS_DEFAULTS, **raw}
        hidden, expand = cfg["hidden_size"], cfg["expand"]
        heads, headdim = cfg["num_heads"], cfg["head_dim"]
        if heads * headdim != expand * hidden:
            raise ConfigError(f"num_heads {heads} x head_dim {headdim} is not expand x hidden_size "
                              f"{expand * hidden}")
        if cfg["hidden_act"] != "silu":
            raise ConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        limit = [_json_float(v) for v in cfg.get("time_step_limit") or (0.0, float("inf"))]
        if limit[0] > 0 or limit[1] != float("inf"):
            raise ConfigError(f"time_step_limit {tuple(limit)} is not supported (only no limit)")
        if cfg.get("layer_types") and set(cfg["layer_types"]) != {"mamba"}:
            raise ConfigError("hybrid models with attention layers (layer_types) are not supported")
        return cls(
            d_model=hidden, n_layer=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"],
            d_state=cfg["state_size"], d_conv=cfg["conv_kernel"], expand=expand,
            conv_bias=cfg["use_conv_bias"], bias=cfg["use_bias"],
            norm_epsilon=cfg["layer_norm_epsilon"], residual_in_fp32=cfg["residual_in_fp32"],
            pad_vocab_size_multiple=1, tie_embeddings=cfg["tie_word_embeddings"],
            bos_token_id=_first_id(cfg["bos_token_id"], 0),
            eos_token_id=_first_id(cfg["eos_token_id"], 0),
            pad_token_id=_first_id(cfg["pad_token_id"], 0),
            layer="Mamba2", headdim=headdim, ngroups=cfg["n_groups"], chunk_size=cfg["chunk_size"])

    def to_transformers(self) -> dict:
        """The transformers MambaConfig (Mamba2Config) fields of this model (vocabulary padded),
        with quamba's ``discretization`` where it is not the default (transformers runs zoh)."""
        if self.layer == "Mamba2":
            return {
                "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"],
                "vocab_size": self.padded_vocab_size, "hidden_size": self.d_model,
                "num_hidden_layers": self.n_layer, "state_size": self.d_state, "expand": self.expand,
                "conv_kernel": self.d_conv, "num_heads": self.nheads, "head_dim": self.headdim,
                "n_groups": self.ngroups, "chunk_size": self.chunk_size,
                "use_conv_bias": self.conv_bias, "use_bias": self.bias,
                "layer_norm_epsilon": self.norm_epsilon, "residual_in_fp32": self.residual_in_fp32,
                "tie_word_embeddings": self.tie_embeddings, "hidden_act": "silu",
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id,
            }
        return {
            **self._mamba1_type_entries(),
            "vocab_size": self.padded_vocab_size,
            "hidden_size": self.d_model,
            "intermediate_size": self.d_inner,
            "state_size": self.d_state,
            "num_hidden_layers": self.n_layer,
            "conv_kernel": self.d_conv,
            "expand": self.expand,
            "time_step_rank": self.dt_rank,
            "use_bias": self.bias,
            "use_conv_bias": self.conv_bias,
            "layer_norm_epsilon": self.norm_epsilon,
            "residual_in_fp32": self.residual_in_fp32,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            **self._discretization_entry(),
        }

    def _mamba1_type_entries(self) -> dict:
        """A Mamba1 model's transformers type: FalconMamba's (with mixer_rms_eps) where it has the
        norms of dt, B and C, else Mamba's."""
        if self.mixer_rms_eps is None:
            return {"model_type": "mamba", "architectures": ["MambaForCausalLM"]}
        return {"model_type": "falcon_mamba", "architectures": ["FalconMambaForCausalLM"],
                "mixer_rms_eps": self.mixer_rms_eps}

    def to_mamba_ssm(self) -> dict:
        """The mamba_ssm config.json fields of this model, with quamba's ``discretization`` in
        ssm_cfg where it is not the default (mamba_ssm, which runs zoh only, then refuses it)."""
        return {
            "d_model": self.d_model,
            "n_layer": self.n_layer,
            "vocab_size": self.vocab_size,
            "ssm_cfg": ({"layer": "Mamba2", "d_state": self.d_state, "d_conv": self.d_conv,
                         "expand": self.expand, "headdim": self.headdim, "ngroups": self.ngroups,
                         "chunk_size": self.chunk_size} if self.layer == "Mamba2" else
                        {"d_state": self.d_state, "d_conv": self.d_conv, "expand": self.expand,
                         "dt_rank": self.dt_rank, **self._discretization_entry()}),
            "rms_norm": True,
            "residual_in_fp32": self.residual_in_fp32,
            "fused_add_norm": True,
            "pad_vocab_size_multiple": self.pad_vocab_size_multiple,
            "tie_embeddings": self.tie_embeddings,
        }

    def _discretization_entry(self) -> dict:
        """{"discretization": ...} for a model that does not run the default, else {}: the config
        files of zoh models stay what mamba_ssm and transformers write."""
        if self.discretization == DEFAULT_DISCRETIZATION:
            return {}
        return {"discretization": self.discretization}


def _check_mamba2_options(ssm_cfg: dict, d_model: int) -> None:
    """Refuse the mamba_ssm Mamba2 options this model does not implement, rather than ignore them."""
    unsupported = {"rmsnorm": False, "norm_before_gate": True, "D_has_hdim": True}
    for key, bad in unsupported.items():
        if ssm_cfg.get(key, not bad) == bad:
            raise ConfigError(f"Mamba2 option {key}={bad} is not supported")
    limit = ssm_cfg.get("dt_limit", (0.0, float("inf")))
    if limit[0] > 0 or limit[1] != float("inf"):
        raise ConfigError(f"Mamba2 option dt_limit {tuple(limit)} is not supported (only no limit)")
    if ssm_cfg.get("d_ssm") not in (None, ssm_cfg.get("expand", 2) * d_model):
        raise ConfigError("Mamba2 option d_ssm < d_inner (a gated MLP inside in_proj) is not supported")


def _falcon_mamba_options(cfg: dict, hidden: int) -> tuple[int, float]:
    """(expand, mixer_rms_eps) of a transformers FalconMambaConfig; its options that quamba
    cannot honour are refused by name. As in transformers, intermediate_size (when given) sets
    d_inner whatever ``expand`` says (tiiuae/falcon-mamba-7b: expand 16, intermediate_size 8192).
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    intermediate = cfg.get("intermediate_size", cfg.get("expand", 2) * hidden)
    if not isinstance(intermediate, int) or intermediate <= 0 or intermediate % hidden:
        raise ConfigError(f"intermediate_size {intermediate!r} is not a positive multiple of "
                          f"hidden_size {hidden}")
    eps = cfg.get("mixer_rms_eps", FALCON_MAMBA_MIXER_RMS_EPS)
    if eps is None:
        raise ConfigError("mixer_rms_eps is null; Falcon-Mamba needs the eps of its dt, B, C norms")
    return intermediate // hidden, eps


def _json_float(value) -> float:
    """A float of config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _first_id(value, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return default if value is None else int(value)


# Shapes of the published state-spaces/mamba-* and mamba2-* models, for benchmarks and tests with
# random weights (vocab_size is the unpadded GPT-NeoX size; the embedding has 50280 rows, 50288
# for Mamba2, whose vocabulary is padded to a multiple of 16), and of tiiuae/falcon-mamba-7b
# (its config.json: hidden 4096, intermediate 8192, 64 layers, state 16, time_step_rank 256,
# vocab 65024, untied lm_head; no mixer_rms_eps, so transformers' default 1e-6).
_MAMBA2 = dict(layer="Mamba2", d_state=128, headdim=64, ngroups=1, chunk_size=256,
               pad_vocab_size_multiple=16)
PRESETS = {
    "130m": dict(d_model=768, n_layer=24),
    "370m": dict(d_model=1024, n_layer=48),
    "790m": dict(d_model=1536, n_layer=48),
    "1.4b": dict(d_model=2048, n_layer=48),
    "2.8b": dict(d_model=2560, n_layer=64),
    "mamba2-130m": dict(d_model=768, n_layer=24, **_MAMBA2),
    "mamba2-370m": dict(d_model=1024, n_layer=48, **_MAMBA2),
    "mamba2-780m": dict(d_model=1536, n_layer=48, **_MAMBA2),
    "mamba2-1.3b": dict(d_model=2048, n_layer=48, **_MAMBA2),
    "mamba2-2.7b": dict(d_model=2560, n_layer=64, **_MAMBA2),
    "falcon-mamba-7b": dict(d_model=4096, n_layer=64, dt_rank=256, vocab_size=65024,
                            tie_embeddings=False, mixer_rms_eps=1e-6),
    # mistralai/Mamba-Codestral-7B-v0.1's params.json: dim 4096, 64 layers, n_groups 8, vocab
    # 32768 unpadded, untied head (7,285,403,648 parameters, the count Mistral publishes)
    "codestral-mamba-7b": dict(d_model=4096, n_layer=64, vocab_size=32768, tie_embeddings=False,
                               **{**_MAMBA2, "ngroups": 8, "pad_vocab_size_multiple": 1}),
    # nvidia/mamba2-8b-3t-4k (Megatron-LM: hidden 4096, 56 Mamba2 layers, ngroups 8, chunk 128,
    # SentencePiece vocabulary 256000 padded to 128, untied output layer)
    "mamba2-8b": dict(d_model=4096, n_layer=56, vocab_size=256000, tie_embeddings=False,
                      **{**_MAMBA2, "ngroups": 8, "chunk_size": 128,
                         "pad_vocab_size_multiple": 128}),
}


def preset_config(name: str) -> MambaConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model size {name!r}; choose one of {', '.join(PRESETS)}")
    return MambaConfig(**{"vocab_size": 50277, **PRESETS[name]})
