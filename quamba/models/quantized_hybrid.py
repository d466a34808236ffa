"""QuantizedNemotronHLM: Nemotron-H with quantized blocks. Its Mamba2 layers are Quamba2's
(QMamba2Mixer with Δ's floor, or the W4A16 mixer); its attention, MLP and MoE layers keep their
float RMSNorm and forward, with quantized linears (quamba.layers.qtransformer). Everything else
(SSM modes, state cache, forward, decode, generate, checkpoints) is QuantizedMambaLM's."""
from __future__ import annotations

import torch

from quamba.layers.qlinear import W4A16Linear
from quamba.layers.qmixer2 import ACTIVATION_SCALES, QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import quantize_linears_
from quamba.models.mamba import Block, RMSNorm
from quamba.models.nemotron_h import (NemotronHConfig, NemotronHMamba2Mixer, dt_floor,
                                      nemotron_h_layer)
from quamba.models.quantized import QuantizedMambaLM


class QuantizedNemotronHLM(QuantizedMambaLM):
    """Built empty with the shapes of a NemotronHConfig, as QuantizedMambaLM; ``quantize`` or
    ``from_pretrained`` fill it."""

    def _empty_block(self, layer: int, dtype, device) -> Block:
        config, quant_config = self.config, self.quant_config
        w_bits, a_bits = quant_config.bits_of(layer)
        kw = dict(device=device, dtype=dtype)
        kind = config.pattern[layer]
        norm = RMSNorm(config.d_model, config.norm_epsilon, False, **kw)
        if kind != "M":
            mixer = nemotron_h_layer(kind, config, **kw)
            return Block(norm, quantize_linears_(mixer, w_bits, a_bits, quant_config.group_size,
                                                 load=False))
        if a_bits == 16:
            return Block(norm, _weight_only_mixer(config, quant_config.group_size, **kw))
        conv_ones = torch.ones(config.d_inner + 2 * config.ngroups * config.d_state)
        mixer = QMamba2Mixer(config, {name: 1.0 for name in ACTIVATION_SCALES}, conv_ones,
                             conv_ones, 1.0, False, dtype, device, w_bits,
                             quant_config.group_size, dt_floor(config))
        return Block(QRMSNorm(config.d_model, config.norm_epsilon, False, 1.0, has_weight=True,
                              device=device), mixer)


def _weight_only_mixer(config: NemotronHConfig, group_size: int, device=None, dtype=None):
    """An empty W4A16 Nemotron-H Mamba2 mixer: 4-bit in_proj and out_proj, the rest float."""
    mixer = NemotronHMamba2Mixer(config, device, dtype)
    for name in ("in_proj", "out_proj"):
        fp = getattr(mixer, name)
        setattr(mixer, name, W4A16Linear(fp.in_features, fp.out_features, group_size, device))
    return mixer
