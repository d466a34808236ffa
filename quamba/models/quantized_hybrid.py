"""Hybrids with quantized blocks (QuantizedHybridLM: Nemotron-H, Bamba, Granite-4.0-H). Their
Mamba2 layers are Quamba2's (QMamba2Mixer with Δ's floor, or the W4A16 mixer); their attention,
MLP and MoE layers keep their float RMSNorm and forward, with quantized linears
(quamba.layers.qtransformer); MoE routers stay float. Everything else (SSM modes, state cache,
forward, decode, generate, checkpoints) is QuantizedMambaLM's. A family adds only ``fp_mixer``:
its FP mixer of a block (Granite: and its µP embedding and logits multipliers, in float)."""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.qlinear import W4A16Linear
from quamba.layers.qmixer2 import ACTIVATION_SCALES, QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import quantize_linears_
from quamba.models.bamba import ScaledEmbedding, ScaledLogits, block_mixer
from quamba.models.mamba import Block, RMSNorm
from quamba.models.mamba2 import Mamba2Mixer
from quamba.models.nemotron_h import dt_floor, nemotron_h_layer
from quamba.models.quantized import QuantizedMambaLM


class QuantizedHybridLM(QuantizedMambaLM):
    """Built empty with the shapes of a hybrid's config, as QuantizedMambaLM; ``quantize`` or
    ``from_pretrained`` fill it."""

    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        """The FP mixer of block ``layer``, whose quantized form the block holds."""
        raise NotImplementedError

    def _empty_block(self, layer: int, dtype, device) -> Block:
        config, group_size = self.config, self.quant_config.group_size
        w_bits, a_bits = self.quant_config.bits_of(layer)
        norm = RMSNorm(config.d_model, config.norm_epsilon, False, device=device, dtype=dtype)
        mixer = self.fp_mixer(layer, device, dtype)
        if not isinstance(mixer, Mamba2Mixer):
            return Block(norm, quantize_linears_(mixer, w_bits, a_bits, group_size, load=False))
        if a_bits == 16:
            return Block(norm, _weight_only_mixer(mixer, group_size, device))
        conv_ones = torch.ones(config.d_inner + 2 * config.ngroups * config.d_state)
        mixer = QMamba2Mixer(config, {name: 1.0 for name in ACTIVATION_SCALES}, conv_ones,
                             conv_ones, 1.0, False, dtype, device, w_bits, group_size,
                             dt_floor(config))
        return Block(QRMSNorm(config.d_model, config.norm_epsilon, False, 1.0, has_weight=True,
                              device=device), mixer)


class QuantizedNemotronHLM(QuantizedHybridLM):
    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        return nemotron_h_layer(self.config.pattern[layer], self.config, device, dtype)


class QuantizedBambaLM(ScaledLogits, QuantizedHybridLM):
    """Bamba or Granite-4.0-H: Granite's embedding_multiplier on the float embedding (quantize()
    refuses an int8 one), its logits_scaling on the logits."""

    def __init__(self, config, quant_config, dtype=torch.float16, device=None):
        super().__init__(config, quant_config, dtype, device)
        if config.embedding_multiplier != 1 and not quant_config.quantize_embedding:
            self.backbone.embedding = ScaledEmbedding(config.vocab_size, config.d_model,
                                                      config.embedding_multiplier,
                                                      device=device, dtype=dtype)
            if self.ties_lm_head:
                self.lm_head.weight = self.backbone.embedding.weight

    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        return block_mixer(self.config, layer, device, dtype)


def _weight_only_mixer(mixer: Mamba2Mixer, group_size: int, device=None) -> Mamba2Mixer:
    """An empty FP Mamba2 mixer made W4A16: 4-bit in_proj and out_proj, the rest float."""
    for name in ("in_proj", "out_proj"):
        fp = getattr(mixer, name)
        setattr(mixer, name, W4A16Linear(fp.in_features, fp.out_features, group_size, device))
    return mixer
