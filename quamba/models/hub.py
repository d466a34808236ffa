"""Model directories, whatever model they hold (FP LM, Vision Mamba, quantized): a name resolved
to a local directory (a Hub id downloaded), config.json read, the float dtype named, the tokenizer
loaded, and a state dict copied into a model. The loaders (quamba.models.loading,
quamba.models.vision_loading, quamba.quantization.checkpoint) build on these."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from quamba.errors import CheckpointError, ModelNotFoundError, QuambaError
from quamba.models.sentencepiece_tokenizer import SentencePieceTokenizer, sentencepiece_file

DEFAULT_TOKENIZER = "EleutherAI/gpt-neox-20b"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# the last two: SentencePiece tokenizers, and Megatron-LM's checkpoints (quamba.models.megatron),
# every rank's, so that a split model is refused rather than read in part
_HUB_PATTERNS = ["config.json", "*.safetensors", "*.bin", "*.index.json", "*.json", "*.txt",
                 "*.model", "*mp_rank_*/model_optim_rng.pt"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16}

# The quantized-checkpoint format's reader and writer, registered by
# quamba.quantization.checkpoint when it loads (quamba's __init__ imports it): "load", its
# from_pretrained, and "save", its save_quantized. load_model and QuantizedModel.save_pretrained
# reach the format through here: models/ lies below quantization/ and never imports it.
quantized_format: dict[str, Callable] = {}


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
    looks_like_path = (name.startswith((".", "/", "~")) or name.count("/") > 1
                       or os.sep + os.sep in name)
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
        raise ModelNotFoundError(f"model {repo_id!r} is neither a local directory nor a valid "
                                 "Hub repository id") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"model {repo_id!r} is not a local directory and no such Hub "
                                 "repository exists") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory and is not in the Hub cache "
            "(offline, or the Hub is unreachable)") from None


def read_config_json(model_dir: Path) -> dict:
    """The JSON object of ``model_dir``'s config.json; a CheckpointError if there is none."""
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


def is_quamba_checkpoint(config: dict) -> bool:
    """True for the config.json of a quantized quamba checkpoint."""
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and quant.get("format") == "quamba"


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
    """The tokenizer given (hub id, directory, tokenizer.json or SentencePiece ``.model`` path),
    else the model directory's (a transformers tokenizer, or a SentencePiece model:
    quamba.models.sentencepiece_tokenizer), else GPT-NeoX-20B (the tokenizer of every
    state-spaces/mamba checkpoint)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    source = tokenizer
    if source is None:
        has_own = has_tokenizer(model_dir)
        source = str(model_dir) if has_own else DEFAULT_TOKENIZER
    source = str(source)
    sentencepiece = sentencepiece_model(Path(source))
    if sentencepiece is not None:
        return SentencePieceTokenizer(sentencepiece)
    if source.endswith(".json") and Path(source).is_file():
        return PreTrainedTokenizerFast(tokenizer_file=source, bos_token="<|endoftext|>",
                                       eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        hint = (" (pass tokenizer= a directory, Hub id or tokenizer.json)" if tokenizer is None
                else "")
        raise ModelNotFoundError(f"cannot load tokenizer {source!r}{hint}: "
                                 f"{str(exc).splitlines()[0]}") from None


def has_tokenizer(model_dir: Path | None) -> bool:
    """Whether a model directory holds a tokenizer: a transformers one's files, or a
    SentencePiece model (sentencepiece_file)."""
    return model_dir is not None and (any((model_dir / f).is_file() for f in TOKENIZER_FILES)
                                      or sentencepiece_file(model_dir) is not None)


def sentencepiece_model(source: Path) -> Path | None:
    """The SentencePiece model a tokenizer source names: a ``.model`` file, or a directory
    without a transformers tokenizer that holds one (quamba.models.sentencepiece_tokenizer's
    sentencepiece_file); else None."""
    if source.suffix == ".model" and source.is_file():
        return source
    if source.is_dir() and not any((source / f).is_file() for f in TOKENIZER_FILES):
        return sentencepiece_file(source)
    return None


def check_token_ids(ids, vocab_size: int, what: str) -> None:
    """A one-line error where token ids (a list or an integer tensor) reach past the model's
    vocabulary, as another model's tokenizer gives them: the embedding would otherwise fail with
    an IndexError on the CPU, a device-side assert on a GPU."""
    if len(ids) == 0:
        return
    largest = int(ids.max()) if isinstance(ids, torch.Tensor) else max(ids)
    if largest >= vocab_size:
        raise QuambaError(f"{what}: token id {largest} is outside the model's vocabulary of "
                          f"{vocab_size}: the tokenizer is another model's (give its own)")


def cast_model(model, dtype: torch.dtype):
    """Cast to ``dtype`` keeping the SSM parameters (A_log, D) in fp32, also those of mixers
    inside a block's mixer (Falcon-H1's parallel one), and every module that says
    ``keeps_fp32`` (an MoE router)."""
    model.to(dtype)
    for module in model.modules():
        if getattr(module, "keeps_fp32", False):
            module.float()
    for mixer in model.modules():
        for name in ("A_log", "D", "A_b_log", "D_b", "dt_bias"):
            param = getattr(mixer, name, None)
            if isinstance(param, torch.nn.Parameter):
                param.data = param.data.float()
    return model
