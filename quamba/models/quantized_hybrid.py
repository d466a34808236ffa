"""Hybrids with quantized blocks (QuantizedHybridLM: Nemotron-H, Bamba, Granite-4.0-H and
Falcon-H1). Their Mamba2 layers are Quamba2's (QMamba2Mixer with Δ's floor, or the W4A16 mixer);
their attention, MLP and MoE layers keep their float RMSNorm and forward, with quantized linears
(quamba.layers.qtransformer); MoE routers stay float. Everything else (SSM modes, state cache,
forward, decode, generate, checkpoints) is QuantizedMambaLM's. A family adds only ``fp_mixer``:
its FP mixer of a block (Granite and Falcon-H1: and their µP embedding and logits multipliers, in
float; Falcon-H1: its blocks of parallel Mamba2 and attention)."""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.qlinear import W4A16Linear
from quamba.layers.qmixer2 import ACTIVATION_SCALES, QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import quantize_linears_
from quamba.models.bamba import ScaledEmbedding, ScaledLogits, block_mixer
from quamba.models.falcon_h1 import LMHeadMultiplier, ParallelMixer
from quamba.models.mamba import Block, RMSNorm
from quamba.models.mamba2 import GatedRMSNorm, Mamba2Mixer
from quamba.models.nemotron_h import dt_floor, nemotron_h_layer
from quamba.models.quantized import QuantizedMambaLM
from quamba.models.transformer_layers import GatedMLP

# Falcon-H1's attention linears quantized per token besides down_proj (DYNAMIC_INPUTS): o_proj,
# whose input static per tensor costs 1.7 to 2.4 times the error of per token (W8A8, that
# linear alone quantized, three random models of tests/quantization/test_quantize_falcon_h1.py)
FALCON_H1_DYNAMIC_INPUTS = ("o_proj",)


class QuantizedHybridLM(QuantizedMambaLM):
    """Built empty with the shapes of a hybrid's config, as QuantizedMambaLM; ``quantize`` or
    ``from_pretrained`` fill it."""

    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        """The FP mixer of block ``layer``, whose quantized form the block holds."""
        raise NotImplementedError

    def _empty_block(self, layer: int, dtype, device) -> Block:
        w_bits, a_bits = self.quant_config.bits_of(layer)
        mixer = self.fp_mixer(layer, device, dtype)
        if not isinstance(mixer, Mamba2Mixer):
            return Block(self._empty_norm(False, dtype, device),
                         quantize_linears_(mixer, w_bits, a_bits, self.quant_config.group_size,
                                           load=False))
        return Block(self._empty_norm(a_bits != 16, dtype, device),
                     self._empty_mamba2_mixer(mixer, w_bits, a_bits, dtype, device))

    def _empty_norm(self, to_int8: bool, dtype, device) -> nn.Module:
        """The norm before a mixer: → int8 (QRMSNorm) for an int8 Mamba2 mixer, else float."""
        config = self.config
        if not to_int8:
            return RMSNorm(config.d_model, config.norm_epsilon, False, device=device, dtype=dtype)
        return QRMSNorm(config.d_model, config.norm_epsilon, False, 1.0, has_weight=True,
                        device=device)

    def _empty_mamba2_mixer(self, mixer: Mamba2Mixer, w_bits: int, a_bits: int, dtype,
                            device) -> nn.Module:
        """The quantized form of the empty FP Mamba2 mixer ``mixer`` (keeping its gate where it
        is not the gated RMSNorm)."""
        config, group_size = self.config, self.quant_config.group_size
        if a_bits == 16:
            return _weight_only_mixer(mixer, group_size, device)
        conv_ones = torch.ones(config.d_inner + 2 * config.ngroups * config.d_state)
        gate = None if isinstance(mixer.norm, GatedRMSNorm) else mixer.norm
        return QMamba2Mixer(config, {name: 1.0 for name in ACTIVATION_SCALES}, conv_ones,
                            conv_ones, 1.0, False, dtype, device, w_bits, group_size,
                            dt_floor(config), gate)


class QuantizedNemotronHLM(QuantizedHybridLM):
    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        return nemotron_h_layer(self.config.pattern[layer], self.config, device, dtype)


class ScaledEmbeddingLM(QuantizedHybridLM):
    """A hybrid with a µP ``config.embedding_multiplier`` (Granite's, Falcon-H1's) on its float
    embedding (quantize() refuses an int8 one)."""

    def __init__(self, config, quant_config, dtype=torch.float16, device=None):
        super().__init__(config, quant_config, dtype, device)
        if config.embedding_multiplier != 1 and not quant_config.quantize_embedding:
            self.backbone.embedding = ScaledEmbedding(config.vocab_size, config.d_model,
                                                      config.embedding_multiplier,
                                                      device=device, dtype=dtype)
            if self.ties_lm_head:
                self.lm_head.weight = self.backbone.embedding.weight


class QuantizedBambaLM(ScaledLogits, ScaledEmbeddingLM):
    """Bamba or Granite-4.0-H: Granite's embedding_multiplier on the float embedding, its
    logits_scaling on the logits."""

    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        return block_mixer(self.config, layer, device, dtype)


class QuantizedFalconH1LM(LMHeadMultiplier, ScaledEmbeddingLM):
    """Falcon-H1: block 2i a ParallelMixer whose Mamba2 mixer is Quamba2's (its SiluGate kept
    where it has no gated norm) and whose attention has quantized linears; both read the
    QRMSNorm's int8 codes (W4A16: the float norm's output). Block 2i+1 its GatedMLP, quantized
    as the other hybrids'. The embedding and lm_head multipliers in float at run time."""

    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        config = self.config
        if layer % 2:
            return GatedMLP(config.d_model, config.intermediate_size, config.mlp_bias,
                            device=device, dtype=dtype)
        return ParallelMixer(config, device, dtype)

    def _empty_block(self, layer: int, dtype, device) -> Block:
        if layer % 2:
            return super()._empty_block(layer, dtype, device)
        w_bits, a_bits = self.quant_config.bits_of(layer)
        mixer = self.fp_mixer(layer, device, dtype)
        mixer.mamba = self._empty_mamba2_mixer(mixer.mamba, w_bits, a_bits, dtype, device)
        quantize_linears_(mixer.self_attn, w_bits, a_bits, self.quant_config.group_size,
                          load=False, dynamic_inputs=FALCON_H1_DYNAMIC_INPUTS)
        return Block(self._empty_norm(a_bits != 16, dtype, device), mixer)


def _weight_only_mixer(mixer: Mamba2Mixer, group_size: int, device=None) -> Mamba2Mixer:
    """An empty FP Mamba2 mixer made W4A16: 4-bit in_proj and out_proj, the rest float."""
    for name in ("in_proj", "out_proj"):
        fp = getattr(mixer, name)
        setattr(mixer, name, W4A16Linear(fp.in_features, fp.out_features, group_size, device))
    return mixer
