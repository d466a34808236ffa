"""The weight-only (W4A16) mixer: the FP MambaMixer with 4-bit in_proj, x_proj and out_proj (a
Mamba2Mixer: in_proj and out_proj).

Only these three weights are quantized (W4A16Linear: packed 4-bit codes, fp16 group scales).
dt_proj, conv1d, A_log and D keep their float dtypes and activations are never quantized, so
conv1d and the scan run the FP ops, and the mixer's forward, decode step and state are the FP
mixer's own.
"""
from __future__ import annotations

import copy

from quamba.layers.qlinear import W4A16Linear
from quamba.models.config import MambaConfig
from quamba.models.mamba import MambaMixer
from quamba.models.mamba2 import Mamba2Mixer
from quamba.ops.hadamard import HadamardTransform

WEIGHT_ONLY_LINEARS = ("in_proj", "x_proj", "out_proj")


def _linear_names(mixer) -> list[str]:
    """The WEIGHT_ONLY_LINEARS a mixer has (a Mamba2 mixer has no x_proj)."""
    return [name for name in WEIGHT_ONLY_LINEARS if hasattr(mixer, name)]


def weight_only_mixer(config: MambaConfig, group_size: int, hadamard: bool, dtype=None,
                      device=None) -> MambaMixer:
    """An empty weight-only mixer with ``config``'s shapes (a checkpoint's tensors fill it);
    ``hadamard``: the model is rotated, so y is rotated online before out_proj."""
    mixer = (Mamba2Mixer if config.layer == "Mamba2" else MambaMixer)(config, device, dtype)
    for name in _linear_names(mixer):
        fp_linear = getattr(mixer, name)
        setattr(mixer, name, W4A16Linear(fp_linear.in_features, fp_linear.out_features,
                                         group_size, device))
    if hadamard:
        mixer.online_hadamard = HadamardTransform(config.d_inner)
    return mixer


def weight_only_mixer_from_float(fp_mixer: MambaMixer, group_size: int) -> MambaMixer:
    """A weight-only copy of an FP mixer (rotated or not), its 4-bit weights rounded to nearest
    (GPTQ replaces their codes afterwards)."""
    mixer = copy.deepcopy(fp_mixer)
    for name in _linear_names(fp_mixer):
        fp_weight = getattr(fp_mixer, name).weight
        layer = W4A16Linear(fp_weight.shape[1], fp_weight.shape[0], group_size, fp_weight.device)
        layer.load_float_weight(fp_weight)
        setattr(mixer, name, layer)
    return mixer
