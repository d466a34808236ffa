"""Loading and saving Mamba1 checkpoints in the two Hub layouts.

* ``mamba_ssm`` (state-spaces/mamba-130m): config.json with d_model / n_layer / ssm_cfg ...,
  weights in pytorch_model.bin, keys ``backbone.embedding.weight`` ...
* ``transformers`` (state-spaces/mamba-130m-hf): MambaConfig config.json, weights in
  model.safetensors (possibly sharded) or pytorch_model.bin, keys ``backbone.embeddings.weight`` ...

The layout is detected from config.json, never from the directory name.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from quamba.errors import CheckpointError, ModelNotFoundError, QuambaError
from quamba.models.config import ConfigError, MambaConfig
from quamba.models.mamba import MambaLMHeadModel
from quamba.models.vision_loading import is_vision_config, load_vision_model

log = logging.getLogger("quamba")

DEFAULT_TOKENIZER = "EleutherAI/gpt-neox-20b"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_HUB_PATTERNS = ["config.json", "*.safetensors", "*.bin", "*.index.json", "*.json", "*.txt",
                 "tokenizer.model"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise QuambaError(f"unknown dtype {dtype!r}; use fp32, fp16 or bf16")
    return _DTYPES[dtype]


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local directory as is, or a Hub repository id downloaded (or found in the cache)."""
    name = str(name_or_path)
    if not name.strip():  # Path("") is the current directory
        raise ModelNotFoundError("model name or path is empty")
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"model path {name!r} is a file, not a model directory")
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep + os.sep in name
    if looks_like_path:
        raise ModelNotFoundError(f"model directory {name!r} does not exist")
    return _download(name)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except HFValidationError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither a local directory nor a valid Hub repository id") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory and no such Hub repository exists") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory and is not in the Hub cache "
            "(offline, or the Hub is unreachable)") from None


def detect_layout(config: dict) -> str:
    """'mamba_ssm' or 'transformers', from the keys of config.json."""
    if "d_model" in config and "n_layer" in config:
        return "mamba_ssm"
    if config.get("model_type") == "mamba" or ("hidden_size" in config and "state_size" in config):
        return "transformers"
    model_type = config.get("model_type")
    hint = f" (model_type {model_type!r})" if model_type else ""
    raise CheckpointError(f"config.json is not a Mamba1 config in the mamba_ssm or transformers layout{hint}")


def _read_config_json(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; not a model directory")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path} does not hold a JSON object")
    return raw


def read_config(model_dir: Path) -> tuple[dict, str, MambaConfig]:
    raw = _read_config_json(model_dir)
    config_path = model_dir / "config.json"
    layout = detect_layout(raw)
    try:
        config = (MambaConfig.from_mamba_ssm(raw) if layout == "mamba_ssm"
                  else MambaConfig.from_transformers(raw))
    except KeyError as exc:
        raise CheckpointError(f"{config_path} ({layout} layout) lacks the field {exc.args[0]!r}") from None
    except ConfigError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    return raw, layout, config


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
    """Rename a checkpoint's tensors to this package's (mamba_ssm) names."""
    if layout == "mamba_ssm":
        return dict(state)
    renamed = {}
    for key, value in state.items():
        if key.startswith("backbone.embeddings."):
            key = "backbone.embedding." + key[len("backbone.embeddings."):]
        renamed[key] = value
    return renamed


def load_state_into(model, state: dict, source: str) -> None:
    """Copy ``state`` into ``model`` (an LM or a Vision Mamba classifier) checking every
    tensor's presence and shape."""
    expected = model.state_dict()
    if getattr(model.config, "tie_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        expected.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: tensor {key} has shape {tuple(state[key].shape)}, "
                                  f"config.json implies {tuple(tensor.shape)}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]} for this config")
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key in state:
                tensor.copy_(state[key])


def load_tokenizer(model_dir: Path | None, tokenizer=None):
    """The tokenizer given (hub id, directory or tokenizer.json path), else the model directory's,
    else GPT-NeoX-20B (the tokenizer of every state-spaces/mamba checkpoint)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    source = tokenizer
    if source is None:
        has_own = model_dir is not None and any((model_dir / f).is_file() for f in TOKENIZER_FILES)
        source = str(model_dir) if has_own else DEFAULT_TOKENIZER
    source = str(source)
    if source.endswith(".json") and Path(source).is_file():
        return PreTrainedTokenizerFast(tokenizer_file=source, bos_token="<|endoftext|>",
                                       eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        hint = " (pass tokenizer= a directory, Hub id or tokenizer.json)" if tokenizer is None else ""
        raise ModelNotFoundError(f"cannot load tokenizer {source!r}{hint}: "
                                 f"{str(exc).splitlines()[0]}") from None


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
        from quamba.quantization.checkpoint import from_pretrained
        return from_pretrained(model_dir, device=device, dtype=dtype, tokenizer=tokenizer)
    raw = _read_config_json(model_dir)
    if is_vision_config(raw):
        return load_vision_model(model_dir, raw, parse_dtype(dtype), device, name_or_path), None
    _, layout, config = read_config(model_dir)
    state = to_internal_names(read_state_dict(model_dir), layout)
    model = MambaLMHeadModel(config)
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


def is_quamba_checkpoint(config: dict) -> bool:
    """True for the config.json of a quantized quamba checkpoint."""
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and quant.get("format") == "quamba"


def _is_quantized(model_dir: Path) -> bool:
    try:
        return is_quamba_checkpoint(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def cast_model(model, dtype: torch.dtype):
    """Cast to ``dtype`` keeping the SSM parameters (A_log, D) in fp32."""
    model.to(dtype)
    for mixer in model.mixers():
        for name in ("A_log", "D", "A_b_log", "D_b", "dt_bias"):
            param = getattr(mixer, name, None)
            if isinstance(param, torch.nn.Parameter):
                param.data = param.data.float()
    return model


def save_model(model: MambaLMHeadModel, out_dir, layout: str = "transformers", tokenizer=None):
    """Write ``model`` in a Hub layout (atomically: into a temporary directory, then renamed)."""
    from quamba.utils.io import atomic_directory
    if getattr(model, "rotated", False):
        raise CheckpointError("a Hadamard-rotated FP model cannot be saved in a Hub layout (the "
                              "online Hadamard would be lost); save the quantized model instead")
    config = model.config
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
