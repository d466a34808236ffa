"""Loading and saving Mamba1 checkpoints in the two Hub layouts.

* ``mamba_ssm`` (state-spaces/mamba-130m): config.json with d_model / n_layer / ssm_cfg ...,
  weights in pytorch_model.bin, keys ``backbone.embedding.weight`` ...
* ``transformers`` (state-spaces/mamba-130m-hf): MambaConfig config.json, weights in
  model.safetensors (possibly sharded) or pytorch_model.bin, keys ``backbone.embeddings.weight`` ...
  Falcon-Mamba (tiiuae/falcon-mamba-7b, model_type falcon_mamba) has the same keys; its norms of
  dt, B and C have no weights.
* ``mistral`` (mistralai/Mamba-Codestral-7B-v0.1): params.json and consolidated.safetensors, no
  config.json (quamba.models.mistral).
* ``megatron`` (nvidia/mamba2-8b-3t-4k): Megatron-LM's checkpoint of a pure Mamba2 model, no
  config.json (quamba.models.megatron).

The layout is detected from config.json (params.json), never from the directory name.
load_model also loads Vision Mamba classifiers (quamba.models.vision_loading) and quantized
checkpoints (the format that quamba.quantization.checkpoint registers in
quamba.models.hub.quantized_format).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from quamba.errors import CheckpointError
from quamba.models.config import TRANSFORMERS_MAMBA1_TYPES, ConfigError, MambaConfig
from quamba.models.hub import (cast_model, is_quamba_checkpoint, load_state_into, load_tokenizer,
                               parse_dtype, quantized_format, read_config_json, resolve_model_dir)
from quamba.models.bamba import BAMBA_TYPES, BambaConfig, BambaLM, from_transformers_names
from quamba.models.falcon_h1 import FalconH1Config, FalconH1LM, from_falcon_h1_names
from quamba.models.jamba import JambaConfig, JambaLM, from_jamba_names
from quamba.models import megatron
from quamba.models.mamba import MambaLMHeadModel
from quamba.models.zamba2 import Zamba2Config, Zamba2LM, from_zamba2_names
from quamba.models.nemotron_h import UNSUPPORTED_HYBRIDS, NemotronHConfig, NemotronHLM
from quamba.models.mistral import (check_tokenizer, from_mistral_names, is_mistral_dir,
                                   read_params, weight_file)
from quamba.models.vision_loading import is_vision_config, load_vision_model

log = logging.getLogger("quamba")

# transformers model types that load_model reads
SUPPORTED_MODEL_TYPES = (*TRANSFORMERS_MAMBA1_TYPES, "mamba2", "nemotron_h", *BAMBA_TYPES, "jamba",
                         "falcon_h1", "zamba2")
# each transformers model_type's config class besides Mamba1 / Mamba2's MambaConfig, and each
# config class's LM
_FAMILY_CONFIGS = {"nemotron_h": NemotronHConfig, **dict.fromkeys(BAMBA_TYPES, BambaConfig),
                   "jamba": JambaConfig, "zamba2": Zamba2Config, "falcon_h1": FalconH1Config}
_FAMILY_LMS = {NemotronHConfig: NemotronHLM, BambaConfig: BambaLM, JambaConfig: JambaLM,
               Zamba2Config: Zamba2LM, FalconH1Config: FalconH1LM}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def detect_layout(config: dict) -> str:
    """'mamba_ssm' or 'transformers', from the keys of config.json."""
    if "d_model" in config and "n_layer" in config:
        return "mamba_ssm"
    if (config.get("model_type") in SUPPORTED_MODEL_TYPES
            or ("hidden_size" in config and "state_size" in config)):
        return "transformers"
    model_type = config.get("model_type")
    if model_type in UNSUPPORTED_HYBRIDS:
        raise CheckpointError(f"model_type {model_type!r} (a hybrid model) is not supported; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    hint = f" (model_type {model_type!r})" if model_type else ""
    raise CheckpointError(f"config.json is not a Mamba1 config in the mamba_ssm or transformers layout{hint}")


def read_config(model_dir: Path) -> tuple[dict, str, MambaConfig | NemotronHConfig]:
    raw = read_config_json(model_dir)
    config_path = model_dir / "config.json"
    layout = detect_layout(raw)
    try:
        config = config_from_dict(raw, layout)
    except KeyError as exc:
        raise CheckpointError(f"{config_path} ({layout} layout) lacks the field {exc.args[0]!r}") from None
    except ConfigError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    return raw, layout, config


def config_from_dict(raw: dict, layout: str = "transformers"):
    """The model config of a config.json's fields in ``layout``: its family's (by model_type in
    the transformers layout). Raises KeyError for a missing field, ConfigError for a value quamba
    cannot build."""
    if layout == "mamba_ssm":
        return MambaConfig.from_mamba_ssm(raw)
    family = _FAMILY_CONFIGS.get(raw.get("model_type"), MambaConfig)
    return family.from_transformers(raw)


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint's weight files (safetensors preferred), on the CPU."""
    for name in WEIGHT_FILES:
        path = model_dir / name
        if path.is_file():
            files = _index_files(path) if name.endswith(".index.json") else [path]
            state = {}
            for file in files:
                state.update(_read_weight_file(file))
            return state
    raise CheckpointError(f"{model_dir} has no weight file (looked for {', '.join(WEIGHT_FILES)})")


def _index_files(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = [index_path.parent / f for f in sorted(set(weight_map.values()))]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index_path} is not a valid shard index") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index_path} names missing shard file {missing[0]}")
    return files


def _read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or truncated files raise many different types
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"cannot read weight file {path}: {reason}") from None


def to_internal_names(state: dict, layout: str) -> dict:
    """Rename a checkpoint's tensors to this package's (mamba_ssm) names. Nemotron-H's
    multi-token prediction layers (mtp.*) are left out, as transformers leaves them."""
    if layout == "mamba_ssm":
        return dict(state)
    renamed = {}
    for key, value in state.items():
        if key.startswith("mtp."):
            continue
        if key.startswith("backbone.embeddings."):
            key = "backbone.embedding." + key[len("backbone.embeddings."):]
        renamed[key] = value
    return renamed


def load_model(name_or_path, dtype="fp32", device="cpu", tokenizer=None):
    """Load a Mamba1 LM and its tokenizer from a Hub id or a local directory (either layout).

    Returns ``(model, tokenizer)``; the model is in eval mode, on ``device``, in ``dtype``
    (A_log and D stay fp32). A quantized quamba checkpoint loads as a QuantizedMambaLM
    (quamba.quantization.from_pretrained). ``tokenizer`` overrides the tokenizer (hub id, directory, or a
    tokenizer.json file); ``tokenizer=False`` skips it and returns None in its place. A Vision
    Mamba classifier (quamba.models.vision_loading) loads the same way, with None as tokenizer.
    """
    model_dir = resolve_model_dir(name_or_path)
    if _is_quantized(model_dir):
        return quantized_format["load"](model_dir, device=device, dtype=dtype, tokenizer=tokenizer)
    if not (is_mistral_dir(model_dir) or megatron.is_megatron_dir(model_dir)):
        raw = read_config_json(model_dir)
        if is_vision_config(raw):
            return load_vision_model(model_dir, raw, parse_dtype(dtype), device, name_or_path), None
    layout, config, state = _read_lm_checkpoint(model_dir, tokenizer)
    model = lm_class(config)(config)
    load_state_into(model, state, str(model_dir))
    model = cast_model(model, parse_dtype(dtype)).to(device).eval()
    is_local = Path(os.path.expanduser(str(name_or_path))).is_dir()
    # a local model is recorded by absolute path so a saved quantized model finds it again
    model.source = {"name_or_path": str(model_dir.resolve()) if is_local else str(name_or_path),
                    "layout": layout}
    log.info("loaded %s (%s layout, %d layers, d_model %d) as %s on %s", name_or_path, layout,
             config.n_layer, config.d_model, dtype, device)
    tok = None if tokenizer is False else load_tokenizer(model_dir, tokenizer)
    return model, tok


def lm_class(config) -> type:
    """The LM class that builds a model of ``config`` (a config_from_dict result)."""
    return _FAMILY_LMS.get(type(config), MambaLMHeadModel)


def _read_lm_checkpoint(model_dir: Path, tokenizer) -> tuple[str, MambaConfig, dict]:
    """(layout, config, tensors under quamba's names) of an FP language model's directory."""
    if is_mistral_dir(model_dir):
        config = read_params(model_dir)
        check_tokenizer(model_dir, tokenizer)
        return "mistral", config, from_mistral_names(_read_weight_file(weight_file(model_dir)))
    if megatron.is_megatron_dir(model_dir):
        megatron.check_tokenizer(model_dir, tokenizer)
        config, state = megatron.read_megatron(model_dir)
        return "megatron", config, state
    _, layout, config = read_config(model_dir)
    if isinstance(config, BambaConfig):
        return layout, config, from_transformers_names(read_state_dict(model_dir), config)
    if isinstance(config, JambaConfig):
        return layout, config, from_jamba_names(read_state_dict(model_dir))
    if isinstance(config, Zamba2Config):
        return layout, config, from_zamba2_names(read_state_dict(model_dir), config)
    if isinstance(config, FalconH1Config):
        return layout, config, from_falcon_h1_names(read_state_dict(model_dir), config)
    return layout, config, to_internal_names(read_state_dict(model_dir), layout)


def _is_quantized(model_dir: Path) -> bool:
    try:
        return is_quamba_checkpoint(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def save_model(model: MambaLMHeadModel, out_dir, layout: str = "transformers", tokenizer=None):
    """Write ``model`` in a Hub layout (atomically: into a temporary directory, then renamed)."""
    from quamba.utils.io import atomic_directory
    if getattr(model, "rotated", False):
        raise CheckpointError("a Hadamard-rotated FP model cannot be saved in a Hub layout (the "
                              "online Hadamard would be lost); save the quantized model instead")
    config = model.config
    if not isinstance(config, MambaConfig):
        raise CheckpointError(f"saving a {type(model).__name__} in a Hub layout is not "
                              "supported yet")
    if layout == "mamba_ssm" and config.mixer_rms_eps is not None:
        raise CheckpointError("the mamba_ssm layout has no norms of dt, B and C (mixer_rms_eps, "
                              "Falcon-Mamba); save it in the transformers layout")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    with atomic_directory(out_dir) as tmp:
        if layout == "transformers":
            from safetensors.torch import save_file
            state = to_transformers_names(state)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            cfg = config.to_transformers()
        elif layout == "mamba_ssm":
            if config.tie_embeddings:
                state["lm_head.weight"] = state["backbone.embedding.weight"]
            torch.save(state, tmp / "pytorch_model.bin")
            cfg = config.to_mamba_ssm()
        else:
            raise ValueError(f"layout must be 'transformers' or 'mamba_ssm', got {layout!r}")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(out_dir)


def to_transformers_names(state: dict) -> dict:
    return {("backbone.embeddings." + k[len("backbone.embedding."):]
             if k.startswith("backbone.embedding.") else k): v for k, v in state.items()}
