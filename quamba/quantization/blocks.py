"""Quantizing one block: an FP block's norm and mixer → their W8A8, W4A8 or W4A16 versions, from
the block's calibrated clipping ranges. Shared by quantize() (quamba.quantization.quantize), the
learned-scales pass (quamba.quantization.learn_scales) and the Vision Mamba recipe
(quamba.quantization.quantize_vision)."""
from __future__ import annotations

import copy

import torch

from quamba.layers.qmixer import QMambaMixer
from quamba.layers.qmixer2 import QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import TRANSFORMER_LAYERS, quantize_linears_
from quamba.layers.weight_only import WeightOnlyMambaMixer, weight_only_mixer_from_float
from quamba.models.falcon_h1 import ParallelMixer
from quamba.models.mamba import Block
from quamba.models.mamba2 import Mamba2Mixer
from quamba.models.quantized import WeightOnlyBlock
from quamba.ops.quant import scale_from_range
from quamba.quantization.cluster import sort_and_cluster
from quamba.quantization.config import QuantConfig

# Per-tensor scales of a Mamba2 mixer (QMamba2Mixer) by the calibrated kind that sets them.
MAMBA2_SCALE_OF_KIND = {"z": "z_scale", "dt": "dt_scale", "ssm_state": "state_scale",
                        "out_proj.input": "y_scale"}

# Calibrated tensor kind → the mixer scale it sets.
SCALE_OF_KIND = {
    "in_proj.output": "xz_scale",
    "x_proj.input": "u_scale",
    "x_proj.output": "xdbl_scale",
    "dt_proj.output": "dt_scale",
    "ssm_state": "state_scale",
    "out_proj.input": "y_scale",
}


def quantized_block(fp_block, layer: int, ranges: dict, config: QuantConfig, model_config) -> Block:
    """A new Block: ``fp_block`` quantized at layer ``layer``'s bits with ``ranges``."""
    block = Block(None, None)
    quantize_block_(block, fp_block, layer, ranges, config, model_config)
    return block


def quantize_block_(block, fp_block, layer: int, ranges: dict, config: QuantConfig,
                    model_config) -> None:
    """Set ``block``'s norm and mixer to ``fp_block``'s, quantized at the layer's bits (a W4A16
    Mamba1 block becomes a WeightOnlyBlock; a hybrid's attention, MLP or MoE block keeps its
    float norm and gets quantized linears)."""
    w_bits, a_bits = config.bits_of(layer)
    if isinstance(fp_block.mixer, ParallelMixer):
        _quantize_parallel_block_(block, fp_block, layer, ranges, config, model_config)
        return
    if isinstance(fp_block.mixer, TRANSFORMER_LAYERS):
        block.norm = copy.deepcopy(fp_block.norm)
        block.mixer = quantize_linears_(copy.deepcopy(fp_block.mixer), w_bits, a_bits,
                                        config.group_size, ranges and ranges[layer],
                                        dynamic_inputs=model_config.dynamic_inputs)
        return
    if a_bits == 16:
        block.norm = copy.deepcopy(fp_block.norm)
        block.mixer = weight_only_mixer_from_float(fp_block.mixer, config.group_size)
        if isinstance(block.mixer, WeightOnlyMambaMixer):
            block.__class__ = WeightOnlyBlock  # a Block that adds no state, only the decode step
        return
    layer_ranges = ranges[layer]
    h_scale = scale_from_range(layer_ranges["in_proj.input"])
    block.norm = quantized_norm(fp_block.norm, h_scale, keep_weight=not config.hadamard)
    if isinstance(fp_block.mixer, Mamba2Mixer):
        block.mixer = _quantized_mamba2_mixer(fp_block.mixer, model_config, layer_ranges, h_scale,
                                              w_bits, config)
        return
    scales = {name: scale_from_range(layer_ranges[kind]) for kind, name in SCALE_OF_KIND.items()}
    block.mixer = QMambaMixer.from_float(fp_block.mixer, h_scale, scales, config.hadamard, w_bits,
                                         config.group_size)


def _quantize_parallel_block_(block, fp_block, layer: int, ranges: dict, config: QuantConfig,
                              model_config) -> None:
    """Falcon-H1's block of parallel Mamba2 and attention: the norm and the Mamba2 mixer as a
    Mamba2 block's, the attention's linears as a hybrid's. Both branches read the norm's output,
    quantized once (W8A8, W4A8: its int8 codes at in_proj.input's scale, the static input scale
    of in_proj and of q, k, v alike; W4A16: the float output); o_proj's input per token
    (FalconH1Config.dynamic_inputs)."""
    quantize_block_(block, Block(fp_block.norm, fp_block.mixer.mamba), layer, ranges, config,
                    model_config)
    mixer = copy.deepcopy(fp_block.mixer)
    mixer.mamba = block.mixer
    w_bits, a_bits = config.bits_of(layer)
    quantize_linears_(mixer.self_attn, w_bits, a_bits, config.group_size, ranges and ranges[layer],
                      dynamic_inputs=model_config.dynamic_inputs)
    block.mixer = mixer


def _quantized_mamba2_mixer(mixer: Mamba2Mixer, model_config, layer_ranges: dict, h_scale: float,
                            w_bits: int, config: QuantConfig) -> QMamba2Mixer:
    """Quamba2's scales from a Mamba2 layer's clipping ranges: in_proj's output per segment (z,
    x, B, C, dt), the conv output's x per sort-and-clustered channel and B, C per state group."""
    scales = {name: scale_from_range(layer_ranges[kind])
              for kind, name in MAMBA2_SCALE_OF_KIND.items()}
    d_inner, group_width = mixer.d_inner, mixer.ngroups * mixer.d_state
    xbc_in_range = torch.cat([torch.full((d_inner,), layer_ranges["x_in"]),
                              torch.full((group_width,), layer_ranges["B_in"]),
                              torch.full((group_width,), layer_ranges["C_in"])])
    x_range = sort_and_cluster(layer_ranges["x"], mixer.nheads, mixer.ngroups).flatten()
    xbc_range = torch.cat([x_range, layer_ranges["B"].repeat_interleave(mixer.d_state),
                           layer_ranges["C"].repeat_interleave(mixer.d_state)])
    return QMamba2Mixer.from_float(mixer, model_config, h_scale, scales,
                                   scale_from_range(xbc_in_range), scale_from_range(xbc_range),
                                   config.hadamard, w_bits, config.group_size)


def quantized_norm(fp_norm, out_scale: float, keep_weight: bool) -> QRMSNorm:
    weight = fp_norm.weight
    norm = QRMSNorm(weight.shape[0], fp_norm.eps, fp_norm.residual_in_fp32, out_scale,
                    has_weight=keep_weight, device=weight.device)
    if keep_weight:
        norm.weight.copy_(weight.float())
    return norm
