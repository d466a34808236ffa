"""Mistral's layout of Mamba2 models (mistralai/Mamba-Codestral-7B-v0.1): ``params.json`` and
``consolidated.safetensors``, as mistral-inference's ``Mamba.from_folder`` reads them.

params.json holds the fields of mistral-inference's ``MambaArgs``; the model is mamba_ssm's
``MambaLMHeadModel`` with a Mamba2 layer, ``ngroups`` from ``n_groups`` and mamba_ssm's Mamba2
defaults for everything else (d_state 128, headdim 64, expand 2, d_conv 4, chunk 256, gated RMSNorm
after the gate). The tensors are that model's names under the prefix ``model.``
(``model.backbone.layers.0.mixer.in_proj.weight`` ...), the names quamba uses, so the mapping is
the prefix removed.
"""
from __future__ import annotations

import json
from pathlib import Path

from quamba.errors import CheckpointError
from quamba.models.config import ConfigError, MambaConfig
from quamba.models.hub import TOKENIZER_FILES

PARAMS_FILE, WEIGHTS_FILE, PREFIX = "params.json", "consolidated.safetensors", "model."
# MambaArgs' fields: the required ones, then those read with a default
REQUIRED = ("dim", "n_layers", "vocab_size", "n_groups", "rms_norm", "residual_in_fp32",
            "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings")
OPTIONAL = ("model_type",)
INT_FIELDS = ("dim", "n_layers", "vocab_size", "n_groups", "pad_vocab_size_multiple")


def is_mistral_dir(model_dir: Path) -> bool:
    """Mistral's layout: params.json and no config.json (the Hub repository holds both layouts;
    config.json, transformers' layout, then wins)."""
    return (model_dir / PARAMS_FILE).is_file() and not (model_dir / "config.json").is_file()


def read_params(model_dir: Path) -> MambaConfig:
    """The model config of a Mistral-layout directory; a field quamba cannot honour is refused by
    name before any weight is read."""
    path = model_dir / PARAMS_FILE
    try:
        params = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    try:
        return _to_config(params)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _to_config(params: dict) -> MambaConfig:
    unknown = sorted(set(params) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ConfigError(f"field {unknown[0]!r} is not one of mistral-inference's MambaArgs "
                          f"({', '.join(REQUIRED + OPTIONAL)})")
    missing = [key for key in REQUIRED if key not in params]
    if missing:
        raise ConfigError(f"lacks the field {missing[0]!r}")
    _check_types(params)
    if params.get("model_type", "mamba") != "mamba":
        raise ConfigError(f"model_type is {params['model_type']!r}; only Mistral's 'mamba' "
                          "(Mamba2) models are supported")
    if not params["rms_norm"]:
        raise ConfigError("rms_norm is false (LayerNorm blocks); only RMSNorm is supported")
    return MambaConfig(
        d_model=params["dim"], n_layer=params["n_layers"], vocab_size=params["vocab_size"],
        d_state=128, layer="Mamba2", headdim=64, ngroups=params["n_groups"],
        residual_in_fp32=params["residual_in_fp32"],
        pad_vocab_size_multiple=params["pad_vocab_size_multiple"],
        tie_embeddings=params["tie_embeddings"])


def _check_types(params: dict) -> None:
    for key in INT_FIELDS:
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    for key in set(REQUIRED) - set(INT_FIELDS):
        if not isinstance(params[key], bool):
            raise ConfigError(f"{key} must be true or false, got {params[key]!r}")


def check_tokenizer(model_dir: Path, tokenizer) -> None:
    """Refuse the GPT-NeoX default for a Mistral-layout directory without a transformers tokenizer:
    Codestral's vocabulary is Mistral's (tokenizer.model.v3, read by mistral-common)."""
    if tokenizer is None and not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{model_dir} (Mistral layout) has no transformers tokenizer "
                              f"({', '.join(TOKENIZER_FILES)}), and GPT-NeoX's default would be "
                              "wrong for it; pass tokenizer= (e.g. the tokenizer.json of "
                              "mistralai/Mamba-Codestral-7B-v0.1) or tokenizer=False")


def from_mistral_names(state: dict) -> dict:
    """consolidated.safetensors' tensors under quamba's names (the ``model.`` prefix removed); a
    tensor without the prefix keeps its name, and loading names it as unexpected."""
    return {key.removeprefix(PREFIX): value for key, value in state.items()}


def weight_file(model_dir: Path) -> Path:
    path = model_dir / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{model_dir} (Mistral layout, {PARAMS_FILE}) has no {WEIGHTS_FILE}")
    return path
