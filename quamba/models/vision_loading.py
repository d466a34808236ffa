"""Loading and saving Vision Mamba classifiers.

A model directory holds ``config.json`` and one weight file. config.json is quamba's own
(``VisionMambaConfig.to_dict``, ``"model_type": "vision_mamba"``) or the keyword arguments of
hustvl/Vim's ``VisionMamba`` (``embed_dim``, ``depth``, ``if_cls_token``, ...). The weights are
``model.safetensors``, ``pytorch_model.bin`` or Vim's training checkpoint (a single ``*.pth``
whose ``"model"`` entry is the state dict), with Vim's tensor names. The checkpoint's own
structure is read from its keys (backward branch ``A_b_log``: bimamba v2; ``in_proj_b``: separate
branches; ``cls_token``: a class token) and must agree with config.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch

from quamba.errors import CheckpointError
from quamba.models.config import ConfigError
from quamba.models.hub import cast_model, load_state_into
from quamba.models.vision import VisionMamba, VisionMambaConfig

log = logging.getLogger("quamba")

WEIGHTS_SAFETENSORS, WEIGHTS_BIN = "model.safetensors", "pytorch_model.bin"


def is_vision_config(config: dict) -> bool:
    """True for a config.json of a Vision Mamba classifier (quamba's or Vim's arguments)."""
    return isinstance(config, dict) and (config.get("model_type") == "vision_mamba"
                                         or ("embed_dim" in config and "depth" in config))


def read_vision_config(raw: dict, source: str) -> VisionMambaConfig:
    try:
        return VisionMambaConfig.from_dict(raw)
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{source}/config.json: {exc}") from None


def read_vision_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The state dict of the directory's weight file (see the module docstring), on the CPU."""
    candidates = [model_dir / WEIGHTS_SAFETENSORS, model_dir / WEIGHTS_BIN]
    found = [path for path in candidates if path.is_file()] or sorted(model_dir.glob("*.pth"))
    if not found:
        raise CheckpointError(f"{model_dir} has no weight file ({WEIGHTS_SAFETENSORS}, {WEIGHTS_BIN} "
                              "or a Vim *.pth checkpoint)")
    if len(found) > 1 and found[0].suffix == ".pth":
        raise CheckpointError(f"{model_dir} holds several *.pth files; keep the one to load")
    path = found[0]
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(path))
        else:
            # Vim's training checkpoints also hold its argparse arguments
            with torch.serialization.safe_globals([argparse.Namespace]):
                state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or truncated files raise many different types
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"cannot read weight file {path}: {reason}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return state


def check_structure(config: VisionMambaConfig, state: dict, source: str) -> None:
    """The structure the keys show (bimamba type, class token) must be the config's."""
    if "layers.0.mixer.in_proj_b.weight" in state:
        bimamba = "separate"
    elif "layers.0.mixer.A_b_log" in state:
        bimamba = "v2"
    else:
        raise CheckpointError(f"{source}: no backward branch (layers.0.mixer.A_b_log): not a "
                              "bidirectional Vision Mamba checkpoint")
    if bimamba != config.bimamba:
        raise CheckpointError(f"{source}: the weights are bimamba {bimamba!r}, config.json says "
                              f"{config.bimamba!r}")
    if ("cls_token" in state) != (config.cls_token != "none"):
        raise CheckpointError(f"{source}: config.json says cls_token {config.cls_token!r} but the "
                              f"weights {'have' if 'cls_token' in state else 'lack'} a cls_token")


def load_vision_model(model_dir: Path, raw_config: dict, dtype: torch.dtype = torch.float32,
                      device="cpu", name_or_path=None) -> VisionMamba:
    """The FP classifier of ``model_dir`` (config.json already read as ``raw_config``), in eval
    mode, on ``device``, in ``dtype`` (A and D stay fp32)."""
    source = str(model_dir)
    config = read_vision_config(raw_config, source)
    state = read_vision_state(model_dir)
    check_structure(config, state, source)
    model = VisionMamba(config)
    load_state_into(model, state, source)
    model = cast_model(model, dtype).to(device).eval()
    local = name_or_path is None or Path(os.path.expanduser(str(name_or_path))).is_dir()
    model.source = {"name_or_path": str(model_dir.resolve()) if local else str(name_or_path),
                    "layout": "vim"}
    log.info("loaded %s (Vision Mamba, %d layers, d_model %d, %d classes) as %s on %s", source,
             config.n_layer, config.d_model, config.num_classes, dtype, device)
    return model


def save_vision_model(model: VisionMamba, out_dir) -> Path:
    """Write ``model`` as config.json (quamba's) and model.safetensors (Vim's tensor names),
    atomically (into a temporary directory, then renamed)."""
    from safetensors.torch import save_file

    from quamba.utils.io import atomic_directory
    if getattr(model, "rotated", False):
        raise CheckpointError("a Hadamard-rotated FP model cannot be saved (the online Hadamard "
                              "would be lost); save the quantized model instead")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_directory(out_dir) as tmp:
        save_file(state, str(tmp / WEIGHTS_SAFETENSORS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    return Path(out_dir)
