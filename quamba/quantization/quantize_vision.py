"""quantize() for Vision Mamba classifiers: FP VisionMamba → QuantizedVisionMamba (W8A8 or W4A8).

The Quamba recipe as for the LMs: Hadamard rotation of the residual stream, static per-tensor
scales calibrated on images (the SSM input of each direction with the percentile observer), and
every block replaced by QRMSNorm + QBiMambaMixer. Calibration images come from a tensor (already
normalized as the model takes them), an ImageSet, or an image-set name (quamba.eval.images:
``digits`` takes its train split, or an ImageFolder directory), by default
``config.calib_source``; the first ``config.calib_num_samples`` are used.
"""
from __future__ import annotations

import copy
import hashlib
import logging

import torch

from quamba.calibrate import BACKWARD_KINDS, calibrate_images
from quamba.calibrate.calibrate import base_kind
from quamba.errors import QuambaError
from quamba.layers.qbimixer import BACKWARD, QBiMambaMixer
from quamba.layers.qmixer import suffixed
from quamba.models.quantized_vision import QuantizedVisionMamba
from quamba.models.vision import VisionMamba
from quamba.ops.quant import scale_from_range
from quamba.quantization.blocks import SCALE_OF_KIND as LM_SCALE_OF_KIND
from quamba.quantization.blocks import quantized_norm
from quamba.quantization.config import QuantConfig
from quamba.quantization.rotation import rotate_vision_model_

log = logging.getLogger("quamba")

# Calibrated tensor kind → the bidirectional mixer's scale it sets: the LM's kinds but the SSM
# state, and the backward branch's kinds with its suffixed scales.
_SCALE_OF_KIND = {kind: name for kind, name in LM_SCALE_OF_KIND.items() if kind != "ssm_state"}
_SCALE_OF_KIND.update({kind: suffixed(LM_SCALE_OF_KIND[base_kind(kind)], BACKWARD)
                       for kind in BACKWARD_KINDS})


def quantize_vision(model: VisionMamba, config: QuantConfig, calib_data,
                    progress: bool = True) -> QuantizedVisionMamba:
    """See :func:`quamba.quantization.quantize`; ``model`` itself is not modified."""
    _check_quantizable(model, config)
    work = copy.deepcopy(model)
    if config.hadamard:
        rotate_vision_model_(work)
    images, record = calibration_images(calib_data, model.config, config)
    ranges = calibrate_images(work, images, observers=config.observer_specs(),
                              batch_size=config.calib_batch_size, progress=progress)
    qmodel = build_quantized_vision_model(work, ranges, config)
    qmodel.calibration = record
    qmodel.base_model = getattr(model, "source", {}).get("name_or_path")
    qmodel.__dict__["fp_model"] = model
    qmodel.set_ssm_mode(config.ssm_mode, config.backend)
    log.info("quantized %d bidirectional layers (W%dA%d, hadamard %s, ssm mode %s)",
             model.config.n_layer, config.w_bits, config.a_bits, config.hadamard, config.ssm_mode)
    return qmodel


def _check_quantizable(model: VisionMamba, config: QuantConfig) -> None:
    if isinstance(model, QuantizedVisionMamba):
        raise QuambaError("quantize needs an FP VisionMamba, got a quantized one")
    if config.weight_only:
        raise QuambaError("Vision Mamba models are quantized W8A8 or W4A8; W4A16 is not supported")
    if config.apply_gptq:
        raise QuambaError("GPTQ is not supported for Vision Mamba models (round-to-nearest only)")
    if model.config.bimamba != "v2":
        raise QuambaError(f"only bimamba 'v2' Vision Mamba models can be quantized, not "
                          f"{model.config.bimamba!r}")


def calibration_images(calib_data, model_config, config: QuantConfig) -> tuple[torch.Tensor, dict]:
    """(the first ``config.calib_num_samples`` calibration images, normalized; their record)."""
    from quamba.eval.images import ImageSet, load_image_set, normalize
    if calib_data is None:
        calib_data = config.calib_source
        if calib_data == QuantConfig.calib_source:  # the LMs' default text set
            raise QuambaError("a Vision Mamba model is calibrated on images: give calib_data (or "
                              "--calib_data): an image tensor, an ImageSet, 'digits' or an "
                              "ImageFolder directory")
    if isinstance(calib_data, torch.Tensor):
        name, images = "image tensor", calib_data
    else:
        if not isinstance(calib_data, ImageSet):
            calib_data = load_image_set(str(calib_data), "train", model_config.img_size,
                                        model_config.channels)
        name, images = calib_data.name, normalize(calib_data.images, model_config)
    images = images[:config.calib_num_samples].float()
    digest = hashlib.sha256(images.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
    return images, {"source": name, "num_samples": len(images), "seed": config.seed,
                    "content_hash": digest}


@torch.no_grad()
def build_quantized_vision_model(fp_model: VisionMamba, ranges: dict, config: QuantConfig):
    """QuantizedVisionMamba from an FP classifier (rotated when ``config.hadamard``) and its
    calibrated clipping ranges ``ranges[layer][kind]``."""
    dtype = fp_model.dtype
    qmodel = QuantizedVisionMamba(copy.deepcopy(fp_model.config), config, dtype=dtype,
                                  device=fp_model.pos_embed.device)
    for name in ("patch_embed", "norm_f", "head"):
        getattr(qmodel, name).load_state_dict(getattr(fp_model, name).state_dict())
    for name in ("cls_token", "pos_embed"):
        if hasattr(fp_model, name):
            getattr(qmodel, name).copy_(getattr(fp_model, name))
    for i, (block, fp_block) in enumerate(zip(qmodel.layers, fp_model.layers)):
        h_scale = scale_from_range(ranges[i]["in_proj.input"])
        scales = {name: scale_from_range(ranges[i][kind]) for kind, name in _SCALE_OF_KIND.items()}
        block.norm = quantized_norm(fp_block.norm, h_scale, keep_weight=not config.hadamard)
        block.mixer = QBiMambaMixer.from_float(fp_block.mixer, h_scale, scales, config.hadamard,
                                               config.w_bits, config.group_size)
    return qmodel
