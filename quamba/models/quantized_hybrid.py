"""Hybrids with quantized blocks (QuantizedHybridLM: Nemotron-H, Bamba, Granite-4.0-H, Jamba).
Their Mamba2 layers are Quamba2's (QMamba2Mixer with Δ's floor), their Mamba1 layers (Jamba's)
Quamba's (QMambaMixer, with the weighted norms of dt, B and C), neither rotated; W4A16 keeps the
FP mixer with 4-bit in_proj and out_proj (Mamba1: and x_proj). Their attention, MLP and MoE
layers keep their float RMSNorm and forward, with quantized linears (quamba.layers.qtransformer);
MoE routers stay float. Everything else (SSM modes, state cache, forward, decode, generate,
checkpoints) is QuantizedMambaLM's. A family adds only ``fp_mixer``: its FP mixer of a block
(Granite: and its µP embedding and logits multipliers, in float)."""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.qmixer import ACTIVATION_SCALES as MAMBA1_ACTIVATION_SCALES
from quamba.layers.qmixer import QMambaMixer
from quamba.layers.qmixer2 import ACTIVATION_SCALES, QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import TRANSFORMER_LAYERS, quantize_linears_
from quamba.layers.weight_only import empty_weight_only_linears_
from quamba.models.bamba import ScaledEmbedding, ScaledLogits, block_mixer
from quamba.models.jamba import jamba_block_mixer
from quamba.models.mamba import Block, MambaMixer, RMSNorm
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
        if isinstance(mixer, TRANSFORMER_LAYERS):
            return Block(norm, quantize_linears_(mixer, w_bits, a_bits, group_size, load=False,
                                                 dynamic_inputs=config.dynamic_inputs))
        if a_bits == 16:
            return Block(norm, empty_weight_only_linears_(mixer, group_size))
        if isinstance(mixer, MambaMixer):
            qmixer = _empty_mamba1_mixer(mixer, config.d_model, w_bits, group_size, dtype, device)
        else:
            qmixer = _empty_mamba2_mixer(config, w_bits, group_size, dtype, device)
        return Block(QRMSNorm(config.d_model, config.norm_epsilon, False, 1.0, has_weight=True,
                              device=device), qmixer)


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


class QuantizedJambaLM(QuantizedHybridLM):
    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        return jamba_block_mixer(layer, self.config, device, dtype)


def _empty_mamba2_mixer(config, w_bits: int, group_size: int, dtype, device) -> QMamba2Mixer:
    """An empty QMamba2Mixer (no rotation, Δ's floor) of ``config``'s Mamba2 shapes."""
    conv_ones = torch.ones(config.d_inner + 2 * config.ngroups * config.d_state)
    return QMamba2Mixer(config, {name: 1.0 for name in ACTIVATION_SCALES}, conv_ones, conv_ones,
                        1.0, False, dtype, device, w_bits, group_size, dt_floor(config))


def _empty_mamba1_mixer(mixer: MambaMixer, d_model: int, w_bits: int, group_size: int, dtype,
                        device) -> QMambaMixer:
    """An empty QMambaMixer (no rotation) of the FP Mamba1 ``mixer``'s shapes and norms."""
    return QMambaMixer(d_model, mixer.d_inner, mixer.d_state, mixer.d_conv, mixer.dt_rank,
                       {name: 1.0 for name in MAMBA1_ACTIVATION_SCALES}, 1.0, False, dtype,
                       device, w_bits, group_size, discretization=mixer.discretization,
                       mixer_rms_eps=mixer.mixer_rms_eps,
                       mixer_norm_weights=mixer.mixer_norm_weights is not None)
