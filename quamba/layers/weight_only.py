"""The weight-only (W4A16) mixer: the FP MambaMixer with 4-bit in_proj, x_proj and out_proj (a
Mamba2Mixer: in_proj and out_proj).

Only these three weights are quantized (W4A16Linear: packed 4-bit codes, fp16 group scales).
dt_proj, conv1d, A_log and D keep their float dtypes and activations are never quantized, so
conv1d and the scan run the FP ops, and the mixer's forward and state are the FP mixer's own. A
Mamba1 mixer's decode step runs its SSM side (conv, x_proj, dt_proj, the scan step) as one op,
w4a16_ssm_step (quamba.ops.fused_decode.w4a16_step: one CUDA kernel on a GPU instead of four), where
``fused_ssm_step`` is set (the default; QuantizedModel.set_fused_ssm_step switches it). Its
block's (quamba.models.quantized.WeightOnlyBlock) batch-1 decode step on a GPU runs whole as one
op, w4a16_layer_step, where ``fused_layer`` is set (the default; QuantizedModel.set_fused_layer)
and the layer kernel applies (:meth:`WeightOnlyMambaMixer.layer_step_weights`).
"""
from __future__ import annotations

import copy
import functools
import logging

import torch
import torch.nn as nn

from quamba.layers.qlinear import W4A16Linear
from quamba.models.config import MambaConfig
from quamba.models.mamba import MambaMixer
from quamba.models.mamba2 import Mamba2Mixer
from quamba.models.state import MixerState
from quamba.ops import backend
from quamba.ops.fused_decode.w4a16_step import (
    FloatSSMWeights,
    W4A16LayerWeights,
    W4A16Weight,
    w4a16_ssm_step,
)
from quamba.ops.norm.hadamard import HadamardTransform
from quamba.ops.scan.discretization import DEFAULT as DEFAULT_DISCRETIZATION

log = logging.getLogger("quamba")

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
    # True: the block's batch-1 decode step on a GPU runs whole as one op, w4a16_layer_step, where
    # its layer kernel applies (:meth:`layer_step_weights`). QuantizedModel.set_fused_layer
    # switches every mixer.
    fused_layer = True

    def _step(self, h, state: MixerState, ssm_A: torch.Tensor | None = None):
        if not self.fuses_step(state):
            return super()._step(h, state, ssm_A)
        x, z = self.in_proj(h[:, 0]).chunk(2, dim=-1)
        y = w4a16_ssm_step(x, z, state.conv, state.ssm, _weight(self.x_proj),
                           self._ssm_weights(ssm_A), backend_name=self.x_proj.backend)
        return self.out_proj(self.online_hadamard(y)).unsqueeze(1)

    def _ssm_weights(self, ssm_A: torch.Tensor | None) -> FloatSSMWeights:
        """The float weights of the step's SSM side; ``ssm_A`` as :meth:`_step` takes it."""
        return FloatSSMWeights(
            self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_proj.weight,
            self.dt_proj.bias, -torch.exp(self.A_log.float()) if ssm_A is None else ssm_A, self.D)

    def fuses_step(self, state: MixerState) -> bool:
        """Whether the decode step runs its SSM side as one w4a16_ssm_step: ``fused_ssm_step``
        set, zoh, no norms of dt, B and C (Falcon-Mamba), a 4-bit x_proj and a float dt_proj with
        its bias, at most ``fused_max_batch`` rows."""
        return (self.fused_ssm_step and self.discretization == DEFAULT_DISCRETIZATION
                and self.mixer_rms_eps is None
                and state.ssm.shape[0] <= self.fused_max_batch
                and state.drive is None and isinstance(self.x_proj, W4A16Linear)
                and self.dt_proj.bias is not None)

    def layer_step_weights(self, norm, hidden, residual, state: MixerState,
                           ssm_A: torch.Tensor | None = None) -> W4A16LayerWeights | None:
        """What w4a16_layer_step reads of this block (``norm`` its RMSNorm, ``ssm_A`` as
        :meth:`_step` takes it) where its layer kernel runs this decode step, else None (the block
        then runs norm and mixer op by op): ``fused_layer`` set, a CUDA step on a backend other
        than torch, :meth:`fuses_step`, no taps, :meth:`layer_weights`, and what the kernel
        checks (batch 1, a float16 model of Mamba-2.8B's sizes, groups of 128)."""
        if not (self.fused_layer and hidden.is_cuda and self.fuses_step(state)
                and self.taps is None and backend.requested_backend(self.x_proj.backend) != "torch"
                and backend.cuda_extension_error() is None):
            return None
        weights = self.layer_weights(norm, ssm_A)
        if weights is None:
            return None
        from quamba.ops.fused_decode import w4a16_layer_cuda
        kernel_lacks = w4a16_layer_cuda.lacks(hidden, residual, weights, state.conv, state.ssm)
        if kernel_lacks is not None:
            _log_op_by_op(kernel_lacks)
            return None
        return weights

    def layer_weights(self, norm, ssm_A: torch.Tensor | None = None) -> W4A16LayerWeights | None:
        """The block's weights as w4a16_layer_step takes them (``norm`` its RMSNorm, ``ssm_A`` as
        :meth:`_step` takes it), or None where the op cannot take them: it has no online Hadamard
        (a rotated model's) and takes W4A16 in_proj, x_proj and out_proj."""
        linears = (self.in_proj, self.x_proj, self.out_proj)
        if not (isinstance(self.online_hadamard, nn.Identity)
                and all(isinstance(linear, W4A16Linear) for linear in linears)):
            return None
        in_proj, x_proj, out_proj = (_weight(linear) for linear in linears)
        return W4A16LayerWeights(norm.weight, norm.eps, norm.residual_in_fp32, in_proj, x_proj,
                                 self._ssm_weights(ssm_A), out_proj)


def _weight(linear: W4A16Linear) -> W4A16Weight:
    return W4A16Weight(linear.weight, linear.scales, linear.group_size)


@functools.lru_cache(maxsize=None)
def _log_op_by_op(why: str) -> None:
    """Says once per reason that a block's decode step runs op by op, not as the layer kernel."""
    log.info("a W4A16 block's decode step runs op by op, not as w4a16_layer_step's layer "
             "kernel: %s", why)


def _linear_names(mixer) -> list[str]:
    """The WEIGHT_ONLY_LINEARS a mixer has (a Mamba2 mixer has no x_proj)."""
    return [name for name in WEIGHT_ONLY_LINEARS if hasattr(mixer, name)]


def weight_only_mixer(config: MambaConfig, group_size: int, hadamard: bool, dtype=None,
                      device=None) -> MambaMixer:
    """An empty weight-only mixer with ``config``'s shapes (a checkpoint's tensors fill it);
    ``hadamard``: the model is rotated, so y is rotated online before out_proj."""
    mixer_class = Mamba2Mixer if config.layer == "Mamba2" else WeightOnlyMambaMixer
    mixer = empty_weight_only_linears_(mixer_class(config, device, dtype), group_size)
    if hadamard:
        mixer.online_hadamard = HadamardTransform(config.d_inner)
    return mixer


def empty_weight_only_linears_(mixer: nn.Module, group_size: int) -> nn.Module:
    """``mixer`` (an FP Mamba1 or Mamba2 mixer) with empty W4A16 linears in place of its
    WEIGHT_ONLY_LINEARS, for a checkpoint's tensors to fill."""
    for name in _linear_names(mixer):
        fp_linear = getattr(mixer, name)
        setattr(mixer, name, W4A16Linear(fp_linear.in_features, fp_linear.out_features,
                                         group_size, fp_linear.weight.device))
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
