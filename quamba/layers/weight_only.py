"""The weight-only (W4A16) mixer: the FP MambaMixer with 4-bit in_proj, x_proj and out_proj (a
Mamba2Mixer: in_proj and out_proj).

Only these three weights are quantized (W4A16Linear: packed 4-bit codes, fp16 group scales).
dt_proj, conv1d, A_log and D keep their float dtypes and activations are never quantized, so
conv1d and the scan run the FP ops, and the mixer's forward and state are the FP mixer's own. A
Mamba1 mixer's decode step runs its SSM side (conv, x_proj, dt_proj, the scan step) as one op,
w4a16_ssm_step (quamba.ops.w4a16_decode: one CUDA kernel on a GPU instead of four), where
``fused_ssm_step`` is set (the default; QuantizedModel.set_fused_ssm_step switches it).
"""
from __future__ import annotations

import copy

import torch

from quamba.layers.qlinear import W4A16Linear
from quamba.models.config import MambaConfig
from quamba.models.mamba import MambaMixer
from quamba.models.mamba2 import Mamba2Mixer
from quamba.models.state import MixerState
from quamba.ops.discretization import DEFAULT as DEFAULT_DISCRETIZATION
from quamba.ops.hadamard import HadamardTransform
from quamba.ops.w4a16_decode import FloatSSMWeights, W4A16Weight, w4a16_ssm_step

WEIGHT_ONLY_LINEARS = ("in_proj", "x_proj", "out_proj")


class WeightOnlyMambaMixer(MambaMixer):
    """A Mamba1 mixer with W4A16 in_proj, x_proj and out_proj; it adds no state to MambaMixer,
    only the decode step through w4a16_ssm_step."""

    fused_ssm_step = True  # QuantizedModel.set_fused_ssm_step switches every mixer
    # Batches the fused step takes: on an H100 at Mamba-2.8B's sizes it makes the batch-1 decode
    # step faster (2.22 against 2.33 ms) and made the batch-8 step slower (3.38 against 2.75: its
    # clusters, one a row, run in two waves); alone it takes 10.7 / 11.1 / 13.4 / 26.1 µs at
    # batch 1 / 2 / 4 / 8 against the chain's 9.3 / 10.9 / 11.5 / 13.1, so the cut is at 2
    # (benchmarks/RESULTS.md).
    fused_max_batch = 2

    def _step(self, h, state: MixerState, ssm_A: torch.Tensor | None = None):
        if not self.fuses_step(state):
            return super()._step(h, state, ssm_A)
        x, z = self.in_proj(h[:, 0]).chunk(2, dim=-1)
        weights = FloatSSMWeights(
            self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_proj.weight,
            self.dt_proj.bias, -torch.exp(self.A_log.float()) if ssm_A is None else ssm_A, self.D)
        x_proj = W4A16Weight(self.x_proj.weight, self.x_proj.scales, self.x_proj.group_size)
        y = w4a16_ssm_step(x, z, state.conv, state.ssm, x_proj, weights,
                           backend_name=self.x_proj.backend)
        return self.out_proj(self.online_hadamard(y)).unsqueeze(1)

    def fuses_step(self, state: MixerState) -> bool:
        """Whether the decode step runs its SSM side as one w4a16_ssm_step: ``fused_ssm_step``
        set, zoh, a 4-bit x_proj and a float dt_proj with its bias, at most ``fused_max_batch``
        rows."""
        return (self.fused_ssm_step and self.discretization == DEFAULT_DISCRETIZATION
                and state.ssm.shape[0] <= self.fused_max_batch
                and state.drive is None and isinstance(self.x_proj, W4A16Linear)
                and self.dt_proj.bias is not None)


def _linear_names(mixer) -> list[str]:
    """The WEIGHT_ONLY_LINEARS a mixer has (a Mamba2 mixer has no x_proj)."""
    return [name for name in WEIGHT_ONLY_LINEARS if hasattr(mixer, name)]


def weight_only_mixer(config: MambaConfig, group_size: int, hadamard: bool, dtype=None,
                      device=None) -> MambaMixer:
    """An empty weight-only mixer with ``config``'s shapes (a checkpoint's tensors fill it);
    ``hadamard``: the model is rotated, so y is rotated online before out_proj."""
    mixer_class = Mamba2Mixer if config.layer == "Mamba2" else WeightOnlyMambaMixer
    mixer = mixer_class(config, device, dtype)
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
    if type(mixer) is MambaMixer:
        mixer.__class__ = WeightOnlyMambaMixer  # its subclass adds no state, only the decode step
    for name in _linear_names(fp_mixer):
        fp_weight = getattr(fp_mixer, name).weight
        layer = W4A16Linear(fp_weight.shape[1], fp_weight.shape[0], group_size, fp_weight.device)
        layer.load_float_weight(fp_weight)
        setattr(mixer, name, layer)
    return mixer
