"""quantize(): FP Mamba1 or Mamba2 LM → QuantizedMambaLM (rotate, calibrate, quantize every block:
the Quamba recipe for Mamba1 mixers, Quamba2's for Mamba2 mixers); Vision Mamba classifiers go to
quamba.quantization.quantize_vision.

W4A16 is weight-only: no rotation by default and no calibration, only the 4-bit weights (RTN or
GPTQ) of in_proj, x_proj and out_proj."""
from __future__ import annotations

import copy
import dataclasses
import logging

import torch

from quamba.errors import QuambaError
from quamba.models.bamba import BambaLM
from quamba.models.falcon_h1 import FalconH1LM
from quamba.models.jamba import JambaLM
from quamba.models.mamba import MambaLMHeadModel
from quamba.models.nemotron_h import NemotronHLM
from quamba.models.quantized import QuantizedMambaLM
from quamba.models.quantized_hybrid import (QuantizedBambaLM, QuantizedFalconH1LM,
                                            QuantizedJambaLM, QuantizedNemotronHLM,
                                            QuantizedZamba2LM)
from quamba.models.vision import VisionMamba
from quamba.models.zamba2 import Zamba2LM
from quamba.ops.quant import scale_from_range
from quamba.quantization.blocks import quantize_block_, quantized_norm
from quamba.quantization.config import QuantConfig
from quamba.quantization.shared_blocks import quantize_shared_blocks_

log = logging.getLogger("quamba")
# FP hybrid class → its quantized class (quamba.models.quantized_hybrid)
QUANTIZED_HYBRIDS = {NemotronHLM: QuantizedNemotronHLM, BambaLM: QuantizedBambaLM,
                     JambaLM: QuantizedJambaLM, FalconH1LM: QuantizedFalconH1LM,
                     Zamba2LM: QuantizedZamba2LM}

@torch.inference_mode(False)  # the quantized model's tensors stay ordinary ones (see below)
def quantize(model: MambaLMHeadModel, tokenizer=None, config: QuantConfig | None = None,
             calib_data=None, progress: bool = True) -> QuantizedMambaLM:
    """Quantize an FP Mamba1 or Mamba2 LM (W8A8, W4A8, or weight-only W4A16: the Quamba recipe,
    with Quamba2's scales for Mamba2 mixers, quamba.layers.qmixer2);
    ``model`` itself is not modified. A Vision Mamba classifier is quantized W8A8 or W4A8 on
    calibration images instead (quamba.quantization.quantize_vision; no tokenizer).

    calib_data: a CalibrationSet, a LongTensor of token ids [samples, seqlen], or any source
    ``quamba.calibrate.load_calibration_set`` accepts (hub id, datasets.Dataset, list of
    strings, .txt/.jsonl path); None → ``config.calib_source``. W4A16 calibrates nothing and
    ignores it (GPTQ reads ``config.gptq_source``). The FP model is kept for the fp16 mode.
    Same model, data and seed → bit-identical scales. Called under ``torch.inference_mode``, it
    still builds ordinary tensors: the CUDA backend caches per-weight constants against their
    version counters, which inference tensors lack.
    """
    from quamba.quantization.rotation import quantization_basis_

    config = config or QuantConfig()
    if isinstance(model, VisionMamba):
        if config.learn_scales:
            raise QuambaError("learn_scales supports Mamba1 language models, not Vision Mamba")
        from quamba.quantization.quantize_vision import quantize_vision
        return quantize_vision(model, config, calib_data, progress)
    _check_quantizable(model, config)
    config = _hybrid_config(model, config)
    work = quantization_basis_(copy.deepcopy(model), config.hadamard)
    if config.weight_only:
        ranges, record, tokens = None, {}, None
    else:
        ranges, record, tokens = _calibrate(work, tokenizer, config, calib_data, progress)
    if config.learn_scales:
        from quamba.quantization.learn_scales import learn_ranges
        ranges, record["learned_scales"] = learn_ranges(work, ranges, tokens, config, progress)
    qmodel = build_quantized_model(work, ranges, config)
    if config.mixed_precision is not None and config.layer_bits is None:
        config, record["layer_sensitivity"] = _mixed_precision_(qmodel, work, ranges, config, tokens)
    qmodel.calibration = record
    qmodel.base_model = getattr(model, "source", {}).get("name_or_path")
    qmodel.tokenizer = tokenizer
    qmodel.__dict__["fp_model"] = model
    qmodel.set_ssm_mode(config.ssm_mode, config.backend)
    qmodel.set_state_cache(config.state_cache)
    if config.apply_gptq:
        _apply_gptq(qmodel, work, tokenizer, config, progress)
    log.info("quantized %d layers (W%dA%d, hadamard %s, ssm mode %s)", model.config.n_layer,
             config.w_bits, config.a_bits, config.hadamard, config.ssm_mode)
    return qmodel


def _hybrid_config(model, config: QuantConfig) -> QuantConfig:
    """A hybrid whose d_model or d_inner has no Hadamard matrix
    (quamba.quantization.rotation.hybrid_rotation_obstacle) is quantized unrotated: ``hadamard``
    is switched off, with a warning naming why."""
    from quamba.quantization.rotation import hybrid_rotation_obstacle

    if type(model) not in QUANTIZED_HYBRIDS or not config.hadamard:
        return config
    reason = hybrid_rotation_obstacle(model)
    if reason is None:
        return config
    log.warning("no Hadamard rotation: %s; quantizing without it", reason)
    return dataclasses.replace(config, hadamard=False)


def _check_hybrid(model, config: QuantConfig) -> None:
    """The recipes that a hybrid cannot take yet, refused in one line: learned scales."""
    name = model.config.model_type
    if config.learn_scales:
        raise QuambaError(f"learn_scales is not supported for {name} yet")
    for field in ("mlp_bias", "attention_bias"):
        if getattr(model.config, field, False):
            raise QuambaError(f"{name} with {field} is not supported by the quantized linears")
    if config.quantize_embedding and getattr(model.config, "embedding_multiplier", 1) != 1:
        raise QuambaError(f"quantize_embedding is not supported for {name} with an "
                          "embedding_multiplier")


def _check_quantizable(model, config: QuantConfig) -> None:
    if type(model) in QUANTIZED_HYBRIDS:
        _check_hybrid(model, config)
    elif isinstance(model, QuantizedMambaLM) or type(model) is not MambaLMHeadModel:
        raise QuambaError(f"quantize needs an FP MambaLMHeadModel, got {type(model).__name__}")
    if not model.config.conv_bias and not config.weight_only:
        raise QuambaError("models without a conv1d bias are not supported by the W8A8 and W4A8 "
                          "recipes")
    if config.learn_scales:
        from quamba.quantization.learn_scales import check_learnable
        check_learnable(model)
    if model.config.bias:
        raise QuambaError("models with biases in in_proj and out_proj are not supported by the "
                          "quantized layers")


def _calibrate(fp_model, tokenizer, config: QuantConfig, calib_data, progress: bool):
    """(clipping ranges ranges[layer][kind], the calibration record, the calibration tokens) of
    the activations."""
    from quamba.calibrate import CalibrationSet, calibrate, load_calibration_set
    calib = calib_data
    if not isinstance(calib, (CalibrationSet, torch.Tensor)):
        if calib is None and tokenizer is None:
            raise QuambaError("quantize needs a tokenizer to build the calibration set")
        calib = load_calibration_set(config.calib_source if calib is None else calib, tokenizer,
                                     config.calib_num_samples, config.calib_seqlen, config.seed)
    ranges = calibrate(fp_model, calib, observers=config.observer_specs(),
                       batch_size=config.calib_batch_size, progress=progress,
                       observe_head=config.lm_head == "int8")
    tokens = calib.tokens if isinstance(calib, CalibrationSet) else calib
    return ranges, _calibration_record(calib, config), tokens


def _mixed_precision_(qmodel: QuantizedMambaLM, fp_model, ranges: dict, config: QuantConfig,
                      tokens: torch.Tensor):
    """Turn the all-W4A8 ``qmodel`` into the mixed one in place: the layers whose measured
    sensitivity is highest rebuilt W4A16 (quamba.quantization.mixed). Returns (the config with
    those layer_bits, the sensitivities)."""
    from quamba.quantization.mixed import choose_layer_bits, layer_sensitivity
    qmodel.set_ssm_mode(config.ssm_mode, config.backend)
    sensitivity = layer_sensitivity(fp_model, qmodel, tokens, config.calib_batch_size)
    config = dataclasses.replace(config, layer_bits=choose_layer_bits(sensitivity,
                                                                      config.mixed_precision))
    w4a16 = [i for i, bits in enumerate(config.layer_bits) if bits[1] == 16]
    for i in w4a16:
        quantize_block_(qmodel.backbone.layers[i], fp_model.backbone.layers[i], i, ranges, config,
                        qmodel.config)
    if isinstance(qmodel, QuantizedZamba2LM):  # its layers' linears and shared blocks too
        quantize_shared_blocks_(qmodel, fp_model, ranges, config)
    qmodel.quant_config = config
    log.info("mixed precision: W4A16 layers %s", w4a16)
    return config, sensitivity


@torch.no_grad()
def build_quantized_model(fp_model: MambaLMHeadModel, ranges: dict, config: QuantConfig):
    """QuantizedMambaLM from an FP model (rotated when ``config.hadamard``) and its calibrated
    clipping ranges ``ranges[layer][kind]`` (None for W4A16); 4-bit weights round to nearest."""
    weight = fp_model.backbone.embedding.weight
    model_class = QUANTIZED_HYBRIDS.get(type(fp_model), QuantizedMambaLM)
    qmodel = model_class(copy.deepcopy(fp_model.config), config, dtype=weight.dtype,
                         device=weight.device)
    _quantize_ends_(qmodel, fp_model, ranges, config)
    for i, (block, fp_block) in enumerate(zip(qmodel.backbone.layers, fp_model.backbone.layers)):
        quantize_block_(block, fp_block, i, ranges, config, qmodel.config)
    if isinstance(qmodel, QuantizedZamba2LM):
        quantize_shared_blocks_(qmodel, fp_model, ranges, config)
    return qmodel


def _quantize_ends_(qmodel: QuantizedMambaLM, fp_model: MambaLMHeadModel, ranges: dict,
                    config: QuantConfig) -> None:
    """The embedding, final norm and lm_head of ``qmodel`` from ``fp_model``'s, in the formats
    of ``config.quantize_embedding`` and ``config.lm_head`` (quamba.layers.qhead)."""
    from quamba.calibrate.calibrate import HEAD_KIND, HEAD_LAYER
    from quamba.layers.qhead import QEmbedding
    backbone, fp_backbone = qmodel.backbone, fp_model.backbone
    if config.quantize_embedding:
        backbone.embedding = QEmbedding.from_float(fp_backbone.embedding)
    else:
        backbone.embedding.load_state_dict(fp_backbone.embedding.state_dict())
    if config.lm_head == "int8":
        head_scale = scale_from_range(ranges[HEAD_LAYER][HEAD_KIND])
        backbone.norm_f = quantized_norm(fp_backbone.norm_f, head_scale,
                                         keep_weight=not config.hadamard)
        qmodel.lm_head.in_scale.fill_(head_scale)
    else:
        backbone.norm_f.load_state_dict(fp_backbone.norm_f.state_dict())
    if config.lm_head != "fp16":
        qmodel.lm_head.load_float_weight(fp_model.lm_head.weight)
    elif not qmodel.ties_lm_head:
        qmodel.lm_head.weight.data.copy_(fp_model.lm_head.weight)


def _apply_gptq(qmodel: QuantizedMambaLM, fp_model: MambaLMHeadModel, tokenizer,
                config: QuantConfig, progress: bool) -> None:
    """GPTQ's codes for ``config.gptq_layers`` of every Mamba block (and every 4-bit linear of a
    hybrid's attention, MLP and MoE blocks; Zamba2's shared blocks once each, then its layers'
    linears), sequentially on the quantized model (quamba.quantization.gptq.gptq_sequential_),
    against the static group scales round-to-nearest uses (W4A8: the two-level scales; W4A16:
    the fp16 scales)."""
    from quamba.calibrate import load_calibration_set
    from quamba.quantization.gptq import gptq_sequential_
    tokens = load_calibration_set(config.gptq_source, tokenizer, config.gptq_num_samples,
                                  config.gptq_seqlen, config.seed).tokens
    gptq_sequential_(qmodel, fp_model, tokens, config.gptq_layers, damp=config.gptq_damp,
                     block_size=config.gptq_block_size, act_order=config.gptq_act_order,
                     batch_size=config.calib_batch_size, progress=progress)


def _calibration_record(calib, config: QuantConfig) -> dict:
    """What the checkpoint records of the calibration set (everything but the tokens)."""
    from quamba.calibrate import content_hash
    if isinstance(calib, torch.Tensor):
        return {"source": "token tensor", "num_samples": calib.shape[0], "seqlen": calib.shape[1],
                "seed": config.seed, "content_hash": content_hash(calib)}
    return {f.name: getattr(calib, f.name) for f in dataclasses.fields(calib) if f.name != "tokens"}
