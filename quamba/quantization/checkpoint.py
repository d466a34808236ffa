"""Quantized checkpoints: safetensors of int8 codes and fp32 scales + config.json + tokenizer
(Vision Mamba classifiers: no tokenizer; their model config has ``"model_type": "vision_mamba"``).

W4A16 checkpoints (format 3) hold packed 4-bit codes with fp16 group scales for in_proj, x_proj
and out_proj, and every other tensor of the FP model in its float dtype.

Format 5 adds the quantized ends of the model (quantization_config's ``lm_head`` and
``quantize_embedding``, quamba.layers.qhead): an int8 lm_head stores ``lm_head.weight`` int8
[vocab, d_model], ``lm_head.weight_scale`` fp32 [vocab] and ``lm_head.in_scale``, its final norm
``backbone.norm_f.out_scale`` (and ``weight`` without rotation); an int4 lm_head packed codes
``lm_head.weight`` uint8 [vocab, d_model / 2] and ``lm_head.scales`` fp16; an int8 embedding
``backbone.embedding.weight`` int8 and ``backbone.embedding.weight_scale`` fp32 [vocab]. A
quantized head or embedding is never tied: ``lm_head`` is stored even where the model config ties
them. Older formats have neither field and load as the float head and embedding they hold.

config.json holds the model config (``"model"``), the format version and the quantization
recipe with its calibration record (``"quantization_config"``). Tensors are stored in a
layout-independent form (weights [out, in] row-major, conv weight [d_inner, width]); kernels may
repack them at load.
"""
from __future__ import annotations

import json

import torch

from quamba.errors import CheckpointError
from quamba.layers.base import QuantModule
from quamba.layers.qhead import QEmbedding
from quamba.layers.qlinear import W4A16Linear, W8A8Linear
from quamba.layers.qmixer import MIXER_NORM_WEIGHTS
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import QInputLinear
from quamba.models.config import MambaConfig
from quamba.models.hub import (is_quamba_checkpoint, load_tokenizer, parse_dtype,
                               quantized_format, resolve_model_dir)
from quamba.models.bamba import BambaConfig
from quamba.models.falcon_h1 import FalconH1Config
from quamba.models.jamba import JambaConfig
from quamba.models.nemotron_h import NemotronHConfig
from quamba.models.quantized import QuantizedMambaLM
from quamba.models.quantized_hybrid import (QuantizedBambaLM, QuantizedFalconH1LM,
                                            QuantizedJambaLM, QuantizedNemotronHLM,
                                            QuantizedZamba2LM)
from quamba.models.quantized_vision import QuantizedVisionMamba
from quamba.models.vision import VisionMambaConfig
from quamba.models.zamba2 import Zamba2Config
from quamba.quantization.config import QuantConfig
from quamba.utils.io import atomic_directory
from quamba.version import __version__

FORMAT_NAME = "quamba"
# 2: 4-bit weights (W4A8); 3: weight-only W4A16; 4: Mamba2 (Quamba2) layers and per-layer mixed
# precision (quantization_config's layer_bits); 5: quantized lm_head and embedding
# (quantization_config's lm_head, quantize_embedding). Versions 1 (W8A8) to 4 load unchanged.
# A checkpoint is written as FORMAT_VERSION, or as NEWEST_FORMAT_VERSION, 6, where the model has
# the norms of dt, B and C (the model config's mixer_rms_eps: Falcon-Mamba), so that a quamba
# that knows no such norms refuses it rather than loads it without them. A Nemotron-H hybrid
# (the model config's "model_type": "nemotron_h"; its attention, MLP and MoE linears as
# quamba.layers.qtransformer stores them) is written as 7, which older quambas refuse; a Bamba
# hybrid ("model_type": "bamba": two blocks a layer, RoPE attention, GatedMLP) or a Granite-4.0-H
# one ("granitemoehybrid": MoE of GatedMLPs, µP multipliers) as 8, which a quamba that knows
# Nemotron-H only refuses. A Jamba hybrid ("jamba": two blocks a layer, Mamba1 mixers whose norms
# of dt, B and C carry weights, stored in the float dtype as each mixer's dt_norm_weight,
# B_norm_weight and C_norm_weight, W4A16: dt_layernorm.weight, b_layernorm.weight and
# c_layernorm.weight; attention, GatedMLP, MoE of GatedMLPs) is written as 9, which a quamba that
# knows 8 at most refuses. A Falcon-H1 hybrid ("falcon_h1": two blocks a layer, the first a
# parallel mixer whose tensors are ``mixer.mamba.*``, a QMamba2Mixer's without ``norm.weight``
# where it has no gated norm, and ``mixer.self_attn.*``, the quantized linears', behind the
# norm's ``out_scale``, which both read; µP multipliers in the model config) is written as 10. A
# Zamba2 hybrid ("zamba2": Mamba2 layers, shared transformer blocks stored once under
# backbone.shared_blocks with quantized linears, each hybrid layer's float LoRA adapters and
# quantized linear) is written as 11, which older quambas refuse. A Hadamard-rotated hybrid (any of
# these with ``hadamard`` in its quantization config: its Mamba mixers rotate y online, its int8
# mixers' norms carry no weight) is written as 12, which older quambas, that would read it
# unrotated, refuse.
FORMAT_VERSION = 5
MIXER_NORMS_FORMAT_VERSION = 6
ROTATED_HYBRID_FORMAT_VERSION = 12
NEWEST_FORMAT_VERSION = 12
# quantized hybrid class → the format version it is written as
HYBRID_FORMAT_VERSIONS = {QuantizedNemotronHLM: 7, QuantizedBambaLM: 8, QuantizedJambaLM: 9,
                          QuantizedFalconH1LM: 10, QuantizedZamba2LM: 11}
# model_type in the model config → (config class, quantized model class); absent: Mamba1/Mamba2
MODEL_TYPES = {"vision_mamba": (VisionMambaConfig, QuantizedVisionMamba),
               "nemotron_h": (NemotronHConfig, QuantizedNemotronHLM),
               "bamba": (BambaConfig, QuantizedBambaLM),
               "granitemoehybrid": (BambaConfig, QuantizedBambaLM),
               "jamba": (JambaConfig, QuantizedJambaLM),
               "falcon_h1": (FalconH1Config, QuantizedFalconH1LM),
               "zamba2": (Zamba2Config, QuantizedZamba2LM)}
WEIGHTS_FILE = "model.safetensors"
# A W4A16 Jamba mixer's norms of dt, B and C (the FP mixer's modules)
JAMBA_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")
# The float routers of the MoE layers (MoE's gate, GraniteMoE's router), cast with the float
# parts unless they keep fp32 (Nemotron-H's)
MOE_ROUTERS = ("gate", "router")


def save_quantized(model: QuantizedMambaLM, out_dir, tokenizer=None):
    """Write ``model`` to ``out_dir`` atomically (temporary directory, then rename)."""
    from safetensors.torch import save_file
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if _ties_lm_head(model):
        state.pop("lm_head.weight", None)
    quant = {
        "format": FORMAT_NAME,
        "format_version": _format_version(model),
        "quamba_version": __version__,
        **model.quant_config.to_dict(),
        "ssm_mode": model.ssm_mode if model.ssm_mode != "fp16" else model.quant_config.ssm_mode,
        "observer_specs": {k: vars(v) for k, v in model.quant_config.observer_specs().items()},
        "float_dtype": str(model.dtype).replace("torch.", ""),
        "calibration": model.calibration,
        "base_model": model.base_model,
    }
    config = {"model": model.config.to_dict(), "quantization_config": quant}
    with atomic_directory(out_dir) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out_dir


def _format_version(model) -> int:
    if type(model) in HYBRID_FORMAT_VERSIONS:
        return (ROTATED_HYBRID_FORMAT_VERSION if model.quant_config.hadamard
                else HYBRID_FORMAT_VERSIONS[type(model)])
    if getattr(model.config, "mixer_rms_eps", None) is not None:
        return MIXER_NORMS_FORMAT_VERSION
    return FORMAT_VERSION


@torch.inference_mode(False)  # ordinary tensors under inference_mode too, as quantize() makes
def from_pretrained(name_or_path, device="cpu", dtype=None, backend: str | None = None,
                    ssm_mode: str | None = None, tokenizer=None):
    """Load a quantized checkpoint (local directory or Hub id). Returns ``(model, tokenizer)``.

    Every tensor's name, shape and dtype is checked; problems raise a one-line CheckpointError.
    ``dtype`` casts the float parts (embedding, norm, lm_head, out_proj output); ``ssm_mode`` and
    ``backend`` override the recorded ones. ``tokenizer=False`` skips the tokenizer.
    """
    model_dir = resolve_model_dir(name_or_path)
    raw = _read_json(model_dir / "config.json")
    if not is_quamba_checkpoint(raw):
        raise CheckpointError(f"{model_dir} is not a quantized quamba checkpoint "
                              "(config.json has no quantization_config)")
    quant = raw["quantization_config"]
    version = quant.get("format_version")
    if not isinstance(version, int) or version > NEWEST_FORMAT_VERSION:
        raise CheckpointError(f"{model_dir}: checkpoint format version {version!r} is newer than "
                              f"this quamba supports ({NEWEST_FORMAT_VERSION}); upgrade quamba")
    model_type = raw["model"].get("model_type") if isinstance(raw.get("model"), dict) else None
    config_class, model_class = MODEL_TYPES.get(model_type, (MambaConfig, QuantizedMambaLM))
    vision = model_class is QuantizedVisionMamba
    try:
        config = config_class.from_dict(raw["model"])
        quant_config = QuantConfig.from_dict(quant)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{model_dir}/config.json is malformed: {exc}") from None
    float_dtype = parse_dtype(quant.get("float_dtype", "float16"))
    model = model_class(config, quant_config, dtype=float_dtype)
    load_checked(model, model_dir / WEIGHTS_FILE)
    model.calibration = quant.get("calibration", {})
    model.base_model = quant.get("base_model")
    if dtype is not None:
        _cast_float_parts(model, parse_dtype(dtype))
    model.to(device).eval()
    model.set_ssm_mode(ssm_mode or quant_config.ssm_mode, backend)
    if vision:  # a classifier has no tokenizer
        return model, None
    model.set_state_cache(quant_config.state_cache)
    model.tokenizer = None if tokenizer is False else load_tokenizer(model_dir, tokenizer)
    return model, model.tokenizer


def _read_json(path):
    if not path.is_file():
        raise CheckpointError(f"{path.parent} has no config.json; not a model directory")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def load_checked(model: QuantizedMambaLM, weights_path) -> None:
    """Load safetensors into ``model`` after checking names, shapes and dtypes of every tensor."""
    from safetensors.torch import load_file
    if not weights_path.is_file():
        raise CheckpointError(f"{weights_path.parent} has no {WEIGHTS_FILE}")
    try:
        state = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises several types for truncated or corrupt files
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"cannot read {weights_path} (truncated or corrupt?): {reason}") from None
    expected = model.state_dict()
    if _ties_lm_head(model):
        expected.pop("lm_head.weight", None)
    for name, tensor in expected.items():
        if name not in state:
            raise CheckpointError(f"{weights_path}: missing tensor {name}")
        found = state[name]
        if tuple(found.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{weights_path}: tensor {name} has shape {tuple(found.shape)}, "
                                  f"expected {tuple(tensor.shape)}")
        if found.dtype != tensor.dtype:
            raise CheckpointError(f"{weights_path}: tensor {name} has dtype {found.dtype}, "
                                  f"expected {tensor.dtype}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{weights_path}: unexpected tensor {unexpected[0]}")
    model.load_state_dict(state, strict=False)


def _ties_lm_head(model) -> bool:
    """Whether lm_head's weight is the embedding's (then stored once, as the embedding)."""
    return getattr(model, "ties_lm_head", getattr(model.config, "tie_embeddings", False))


def _cast_float_parts(model, dtype: torch.dtype) -> None:
    """Cast what runs in the float dtype; codes, scales, A_log and D keep theirs."""
    if isinstance(model, QuantizedVisionMamba):
        for module in (model.patch_embed, model.norm_f, model.head):
            module.to(dtype)
        for name in ("cls_token", "pos_embed"):
            if hasattr(model, name):
                getattr(model, name).data = getattr(model, name).data.to(dtype)
        for block in model.layers:
            block.mixer.out_dtype = block.mixer.out_proj.out_dtype = dtype
        return
    for module in (model.backbone.embedding, model.backbone.norm_f, model.lm_head):
        if isinstance(module, (QEmbedding, W8A8Linear)):  # int8 codes, fp32 scales
            module.out_dtype = dtype
        elif not isinstance(module, (QRMSNorm, W4A16Linear)):  # W4A16: y in its input's dtype
            module.to(dtype)
    for module in model.modules():
        if hasattr(module, "kv_dtype"):  # a hybrid's quantized attention: its KV cache
            module.kv_dtype = dtype
        elif isinstance(module, QInputLinear) and not module.dynamic:  # a hybrid's GEMM output
            module.linear.out_dtype = dtype
    for module in getattr(model, "float_modules", list)():  # Zamba2's norms and adapters
        module.to(dtype)
    for block in model.backbone.layers:
        mixer = getattr(block.mixer, "mamba", block.mixer)  # Falcon-H1's parallel mixer's
        if not isinstance(mixer, QuantModule):  # W4A16: the FP parts of its mixer
            block.norm.to(dtype)
            for name in ("conv1d", "dt_proj", "norm", *JAMBA_NORMS, *MOE_ROUTERS):
                module = getattr(mixer, name, None)
                if module is not None and not getattr(module, "keeps_fp32", False):
                    module.to(dtype)
        else:
            mixer.out_dtype = dtype
            mixer.out_proj.out_dtype = dtype
            if getattr(mixer, "mixer_rms_eps", None) is not None:  # a float x_proj output
                mixer.x_proj.out_dtype = dtype
            for name in MIXER_NORM_WEIGHTS:  # Jamba's: applied to the float x_proj output
                if hasattr(mixer, name):
                    setattr(mixer, name, getattr(mixer, name).to(dtype))


# load_model and QuantizedModel.save_pretrained reach this format here (models/ never imports it)
quantized_format.update(load=from_pretrained, save=save_quantized)
