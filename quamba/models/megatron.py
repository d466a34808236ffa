"""Megatron-LM checkpoints of pure Mamba2 language models: NVIDIA's Mamba2-8B
(``nvidia/mamba2-8b-3t-4k``, the model of Quamba2's headline), as Megatron-LM writes them.

The directory holds ``latest_checkpointed_iteration.txt`` ("release" or an iteration number) and,
in ``release/`` or ``iter_NNNNNNN/``, one ``mp_rank_00/model_optim_rng.pt`` per tensor-parallel
rank: a pickled dict whose ``"model"`` entry is the state dict and ``"args"`` Megatron's
arguments (an argparse Namespace), beside RNG states and enums of Megatron's own classes.

Reading: the pickle is unpickled by :class:`_CheckpointUnpickler`, which builds only tensors,
ordered dicts, Namespaces and torch dtypes; every other class or function the pickle names
(Megatron's enums, numpy's RNG states, ...) becomes an inert :class:`_Opaque` placeholder, so no
code the checkpoint names runs (``torch.load(weights_only=True)`` refuses such checkpoints).

Mapping onto quamba's (mamba_ssm's) names:

* ``embedding.word_embeddings.weight`` → ``backbone.embedding.weight``;
* ``decoder.layers.{i}.norm.weight``, or ``decoder.layers.{i}.mixer.in_proj.layer_norm_weight``
  (the norm fused into in_proj by TransformerEngine) → ``backbone.layers.{i}.norm.weight``;
* ``decoder.layers.{i}.mixer.<name>`` → ``backbone.layers.{i}.mixer.<name>``;
* ``decoder.final_norm.weight`` → ``backbone.norm_f.weight``;
* ``output_layer.weight`` → ``lm_head.weight`` (absent: the embedding is tied).

The mixer's tensors keep their names (in_proj with rows z, x, B, C, dt; conv1d; dt_bias; A_log;
D; norm, the gated RMSNorm; out_proj); TransformerEngine's ``_extra_state`` entries are dropped.
The shape comes from the tensors (d_model, layers, d_inner, heads, conv width, vocabulary) and
from ``args`` (``mamba_state_dim``, ``mamba_num_groups``, ``norm_epsilon``,
``mamba_chunk_size``; Megatron-LM's defaults 128, 8, 1e-5 and 128 where ``args`` lacks them).
"""
from __future__ import annotations

import argparse
import collections
import pickle
import re
import types
from pathlib import Path

import torch

from quamba.errors import CheckpointError
from quamba.models.config import ConfigError, MambaConfig
from quamba.models.hub import has_tokenizer

ITERATION_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILE = "model_optim_rng.pt"
# Megatron-LM's argument defaults for a Mamba2 model (megatron/training/arguments.py)
DEFAULT_STATE_DIM, DEFAULT_GROUPS, DEFAULT_EPS = 128, 8, 1e-5
DEFAULT_CHUNK = 128  # the chunk Megatron-LM's Mamba2 mixer scans in, unless mamba_chunk_size

_TOP_LEVEL = {"embedding.word_embeddings.weight": "backbone.embedding.weight",
              "decoder.final_norm.weight": "backbone.norm_f.weight",
              "output_layer.weight": "lm_head.weight"}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MIXER_TENSORS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                  "norm.weight", "out_proj.weight")


def is_megatron_dir(model_dir: Path) -> bool:
    """Megatron-LM's layout: its iteration file or a release checkpoint, and no config.json."""
    if (model_dir / "config.json").is_file():
        return False
    return ((model_dir / ITERATION_FILE).is_file()
            or (model_dir / "release" / "mp_rank_00" / CHECKPOINT_FILE).is_file())


def read_megatron(model_dir: Path) -> tuple[MambaConfig, dict[str, torch.Tensor]]:
    """(config, tensors under quamba's names) of a Megatron-LM Mamba2 checkpoint directory; what
    quamba cannot read (several tensor-parallel ranks, attention or MLP layers, a missing tensor)
    is refused in one line before the model is built."""
    path = checkpoint_path(model_dir)
    checkpoint = load_checkpoint(path)
    state = checkpoint.get("model") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no 'model' state dict")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    renamed = to_quamba_names(tensors, path)  # first: a hybrid is refused by its tensors' names
    args = checkpoint.get("args")
    try:
        config = _config(tensors, args if isinstance(args, argparse.Namespace) else None)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return config, renamed


def checkpoint_path(model_dir: Path) -> Path:
    """The rank-0 checkpoint of the iteration ``latest_checkpointed_iteration.txt`` names
    ("release" when the file is absent); refused where the model is split over ranks."""
    iteration_file = model_dir / ITERATION_FILE
    iteration = iteration_file.read_text().strip() if iteration_file.is_file() else "release"
    if iteration != "release":
        if not iteration.isdigit():
            raise CheckpointError(f"{iteration_file} names neither 'release' nor an iteration: "
                                  f"{iteration[:40]!r}")
        iteration = f"iter_{int(iteration):07d}"
    iteration_dir = model_dir / iteration
    ranks = sorted(p.name for p in iteration_dir.glob("mp_rank_*"))
    if len(ranks) > 1:
        raise CheckpointError(
            f"{iteration_dir} is split over {len(ranks)} model-parallel ranks "
            f"({', '.join(ranks)}); quamba reads one: merge them with Megatron-LM's "
            "tools/checkpoint/hybrid_conversion.py (--target-tp-size 1 --target-pp-size 1)")
    path = iteration_dir / "mp_rank_00" / CHECKPOINT_FILE
    if any(iteration_dir.glob("*.distcp")):
        raise CheckpointError(
            f"{iteration_dir} is in Megatron-LM's distributed format (torch_dist), which quamba "
            "does not read; save it in Megatron-LM's torch format (--ckpt-format torch) first")
    if not path.is_file():
        raise CheckpointError(f"{model_dir} is a Megatron-LM checkpoint without "
                              f"{path.relative_to(model_dir)}")
    return path


def load_checkpoint(path: Path):
    """The unpickled checkpoint, built by :class:`_CheckpointUnpickler` (tensors on the CPU)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_RestrictedPickle)
    except Exception as exc:  # an untrusted file: whatever it makes the unpickler raise
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"cannot read {path}: {reason}") from None


def check_tokenizer(model_dir: Path, tokenizer) -> None:
    """Refuse the GPT-NeoX default where the directory holds no tokenizer: the model's vocabulary
    is its own (NVIDIA's SentencePiece model, a ``.model`` file beside the checkpoint)."""
    if tokenizer is None and not has_tokenizer(model_dir):
        raise CheckpointError(f"{model_dir} (Megatron-LM layout) holds no tokenizer (a "
                              "SentencePiece .model file or a transformers tokenizer), and "
                              "GPT-NeoX's default would be wrong for it; pass tokenizer= (the "
                              "model's .model file) or tokenizer=False")


def to_quamba_names(tensors: dict, path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under quamba's names (the table above); a tensor of another kind
    of layer (attention, MLP) is refused by name."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_extra_state"):
            continue
        if name in _TOP_LEVEL:
            out[_TOP_LEVEL[name]] = tensor
            continue
        match = _LAYER.fullmatch(name)
        part = match.group(2) if match else None
        if part is None or not (part in ("norm.weight", "mixer.in_proj.layer_norm_weight")
                                or part.removeprefix("mixer.") in _MIXER_TENSORS):
            raise CheckpointError(f"{path}: tensor {name!r} is not one of a pure Mamba2 model's "
                                  "(hybrid Megatron-LM checkpoints are not supported)")
        prefix = f"backbone.layers.{match.group(1)}."
        out[prefix + ("norm.weight" if part.endswith("norm_weight") else part)] = tensor
    return out


def _config(tensors: dict, args: argparse.Namespace | None) -> MambaConfig:
    """The model's shape from its tensors; d_state, the groups, eps and chunk from its args."""
    def shape(name):
        if name not in tensors:
            raise ConfigError(f"lacks the tensor {name!r}")
        return tuple(tensors[name].shape)

    vocab, d_model = shape("embedding.word_embeddings.weight")
    layers = sorted({int(m.group(1)) for m in map(_LAYER.fullmatch, tensors) if m})
    if not layers or layers != list(range(len(layers))):
        raise ConfigError("its decoder layers are not numbered 0, 1, ...")
    nheads = shape("decoder.layers.0.mixer.A_log")[0]
    d_inner = shape("decoder.layers.0.mixer.norm.weight")[0]
    conv_dim, _, d_conv = shape("decoder.layers.0.mixer.conv1d.weight")
    state_dim = int(getattr(args, "mamba_state_dim", None) or DEFAULT_STATE_DIM)
    groups = int(getattr(args, "mamba_num_groups", None) or DEFAULT_GROUPS)
    if conv_dim != d_inner + 2 * groups * state_dim:
        raise ConfigError(f"conv1d's {conv_dim} channels are not d_inner {d_inner} + 2 · "
                          f"{groups} groups · d_state {state_dim}")
    if d_inner % d_model or d_inner % nheads:
        raise ConfigError(f"d_inner {d_inner} is not a multiple of d_model {d_model} and of the "
                          f"{nheads} heads")
    return MambaConfig(
        d_model=d_model, n_layer=len(layers), vocab_size=vocab, layer="Mamba2", d_state=state_dim,
        d_conv=d_conv, expand=d_inner // d_model, headdim=d_inner // nheads, ngroups=groups,
        chunk_size=int(getattr(args, "mamba_chunk_size", None) or DEFAULT_CHUNK),
        norm_epsilon=float(getattr(args, "norm_epsilon", DEFAULT_EPS)),
        pad_vocab_size_multiple=1, tie_embeddings="output_layer.weight" not in tensors)


class _Opaque:
    """What a checkpoint's object of a class quamba does not build becomes: its arguments, state
    and items are kept as given (a list's or dict's subclass is filled through them), and no code
    of the class runs."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args, self.items = args, []

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):
        self.items.append((key, value))

    def append(self, value):
        self.items.append(value)

    def extend(self, values):
        self.items.extend(values)


# What the checkpoint may build for real: containers, Megatron's arguments, torch's dtypes and the
# tensor rebuilders that torch.save writes (storages are torch.load's own: its persistent_load).
_ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
            ("argparse", "Namespace"): argparse.Namespace,
            ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
            ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
            ("torch._tensor", "_rebuild_from_type_v2"): torch._tensor._rebuild_from_type_v2,
            ("torch", "Tensor"): torch.Tensor,
            ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
            ("torch", "Size"): torch.Size}


class _CheckpointUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return _Opaque


def _load(file, **kwargs):
    return _CheckpointUnpickler(file, **kwargs).load()


# The pickle module torch.load is given: its Unpickler is _CheckpointUnpickler.
_RestrictedPickle = types.ModuleType("quamba_checkpoint_pickle")
_RestrictedPickle.Unpickler, _RestrictedPickle.load = _CheckpointUnpickler, _load
