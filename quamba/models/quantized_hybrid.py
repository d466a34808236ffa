"""Hybrids with quantized blocks (QuantizedHybridLM: Nemotron-H, Bamba, Granite-4.0-H, Jamba,
Falcon-H1, Zamba2). Their Mamba2 layers are Quamba2's (QMamba2Mixer with Δ's floor), their
Mamba1 layers (Jamba's) Quamba's (QMambaMixer, with the weighted norms of dt, B and C), their y
rotated online where the residual stream is (quamba.quantization.rotation); W4A16 keeps the FP
mixer with 4-bit in_proj and out_proj (Mamba1: and x_proj). Their attention, MLP and MoE layers
keep their float RMSNorm and forward, with quantized linears (quamba.layers.qtransformer); MoE
routers stay float. Everything else (SSM modes, state cache, forward, decode, generate,
checkpoints) is QuantizedMambaLM's. A family adds only ``fp_mixer``: its FP mixer of a block
(Granite and Falcon-H1: and their µP embedding and logits multipliers, in float; Falcon-H1: its
blocks of parallel Mamba2 and attention; Zamba2: its shared transformer blocks and its layers'
adapters and linears)."""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.qmixer import ACTIVATION_SCALES as MAMBA1_ACTIVATION_SCALES
from quamba.layers.qmixer import QMambaMixer
from quamba.layers.qmixer2 import ACTIVATION_SCALES, QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import TRANSFORMER_LAYERS, empty_linear, quantize_linears_
from quamba.layers.weight_only import empty_weight_only_linears_
from quamba.models.bamba import ScaledEmbedding, ScaledLogits, block_mixer
from quamba.models.falcon_h1 import LMHeadMultiplier, ParallelMixer
from quamba.models.jamba import jamba_block_mixer
from quamba.models.mamba import Block, MambaMixer, RMSNorm
from quamba.models.mamba2 import GatedRMSNorm
from quamba.models.nemotron_h import NemotronHMamba2Mixer, dt_floor, nemotron_h_layer
from quamba.models.quantized import QuantizedMambaLM
from quamba.models.transformer_layers import GatedMLP
from quamba.models.zamba2 import (Zamba2Layer, Zamba2LM, Zamba2SharedBlock, num_shared_blocks,
                                  shared_block_of, shared_block_users)
from quamba.ops.norm.hadamard import HadamardTransform


class QuantizedHybridLM(QuantizedMambaLM):
    """Built empty with the shapes of a hybrid's config, as QuantizedMambaLM; ``quantize`` or
    ``from_pretrained`` fill it."""

    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        """The FP mixer of block ``layer``, whose quantized form the block holds."""
        raise NotImplementedError

    def _empty_block(self, layer: int, dtype, device) -> Block:
        w_bits, a_bits = self.quant_config.bits_of(layer)
        mixer = self.fp_mixer(layer, device, dtype)
        if isinstance(mixer, TRANSFORMER_LAYERS):
            return Block(self._empty_norm(False, dtype, device),
                         quantize_linears_(mixer, w_bits, a_bits, self.quant_config.group_size,
                                           load=False, dynamic_inputs=self.config.dynamic_inputs))
        return Block(self._empty_norm(a_bits != 16, dtype, device),
                     self._empty_mamba_mixer(mixer, w_bits, a_bits, dtype, device))

    def _empty_norm(self, to_int8: bool, dtype, device) -> nn.Module:
        """The norm before a mixer: → int8 (QRMSNorm) for an int8 Mamba mixer, else float."""
        config = self.config
        if not to_int8:
            return RMSNorm(config.d_model, config.norm_epsilon, False, device=device, dtype=dtype)
        return QRMSNorm(config.d_model, config.norm_epsilon, False, 1.0,
                        has_weight=not self.quant_config.hadamard, device=device)

    def _empty_mamba_mixer(self, mixer: nn.Module, w_bits: int, a_bits: int, dtype,
                           device) -> nn.Module:
        """The quantized form of the empty FP Mamba1 or Mamba2 mixer ``mixer``: W4A16, the FP
        mixer with 4-bit linears; else Quamba's QMambaMixer (with the weighted norms of dt, B
        and C) or Quamba2's QMamba2Mixer (Δ's floor; its gate kept where it is not the gated
        RMSNorm); y rotated online where the model is (QuantConfig.hadamard)."""
        config, group_size = self.config, self.quant_config.group_size
        hadamard = self.quant_config.hadamard
        if a_bits == 16:
            if hadamard:
                mixer.online_hadamard = HadamardTransform(mixer.d_inner)
            return empty_weight_only_linears_(mixer, group_size)
        if isinstance(mixer, MambaMixer):
            return QMambaMixer(config.d_model, mixer.d_inner, mixer.d_state, mixer.d_conv,
                               mixer.dt_rank, {name: 1.0 for name in MAMBA1_ACTIVATION_SCALES},
                               1.0, hadamard, dtype, device, w_bits, group_size,
                               discretization=mixer.discretization,
                               mixer_rms_eps=mixer.mixer_rms_eps,
                               mixer_norm_weights=mixer.mixer_norm_weights is not None)
        conv_ones = torch.ones(config.d_inner + 2 * config.ngroups * config.d_state)
        gate = None if isinstance(mixer.norm, GatedRMSNorm) else mixer.norm
        return QMamba2Mixer(config, {name: 1.0 for name in ACTIVATION_SCALES}, conv_ones,
                            conv_ones, 1.0, hadamard, dtype, device, w_bits, group_size,
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


class QuantizedJambaLM(QuantizedHybridLM):
    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        return jamba_block_mixer(layer, self.config, device, dtype)


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
        mixer.mamba = self._empty_mamba_mixer(mixer.mamba, w_bits, a_bits, dtype, device)
        quantize_linears_(mixer.self_attn, w_bits, a_bits, self.quant_config.group_size,
                          load=False, dynamic_inputs=self.config.dynamic_inputs)
        return Block(self._empty_norm(a_bits != 16, dtype, device), mixer)


class QuantizedZamba2LM(QuantizedHybridLM, Zamba2LM):
    """Zamba2 (forward, cache and decode Zamba2LM's: every layer gets the token embeddings).
    The shared transformer blocks are held once (``backbone.shared_blocks``) with quantized
    linears, used at every depth as in the FP model; a hybrid layer keeps its LoRA adapters in
    float (their outputs add to the quantized linears') and quantizes its own linear at its
    layer's bits; a shared block takes the bits of shared_block_bits."""

    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        return NemotronHMamba2Mixer(self.config, device, dtype)

    def _empty_block(self, layer: int, dtype, device) -> Zamba2Layer:
        if not hasattr(self.backbone, "shared_blocks"):  # before the first layer points to them
            self.backbone.shared_blocks = nn.ModuleList(
                self._empty_shared_block(b, dtype, device)
                for b in range(num_shared_blocks(self.config)))
        hybrid = self.config.layer_types[layer] == "hybrid"
        shared = (self.backbone.shared_blocks[shared_block_of(self.config, layer)] if hybrid
                  else None)
        quantized = super()._empty_block(layer, dtype, device)
        block = Zamba2Layer(self.config, shared, device, dtype)
        block.norm, block.mixer = quantized.norm, quantized.mixer
        if hybrid:
            block.linear = empty_linear(block.linear, False, *self.quant_config.bits_of(layer),
                                        self.quant_config.group_size)
        return block

    def _empty_shared_block(self, b: int, dtype, device) -> Zamba2SharedBlock:
        block = Zamba2SharedBlock(self.config, device, dtype)
        bits = shared_block_bits(self.quant_config, shared_block_users(self.config, b))
        return quantize_linears_(block, *bits, self.quant_config.group_size, load=False)

    def float_modules(self) -> list[nn.Module]:
        """What stays float beside the quantized linears, cast with the model's float dtype
        (quamba.quantization.checkpoint): the shared blocks' norms, the layers' adapters."""
        norms = [norm for block in self.backbone.shared_blocks
                 for norm in (block.input_norm, block.pre_ff_norm)]
        return norms + [layer.adapters for layer in self.backbone.layers
                        if layer.shared is not None]


def shared_block_bits(quant_config, users: list[int]) -> tuple[int, int]:
    """(w_bits, a_bits) of a Zamba2 shared block run by the layers ``users``: the most precise
    of theirs (float activations first, then 8-bit weights), since its one set of weights serves
    them all: a layer chosen to run W4A16 keeps its shared block's activations float, and its
    W4A8 co-users run that block W4A16 too. Found from layer_bits alone, so a checkpoint needs
    no more than layer_bits."""
    return max((quant_config.bits_of(i) for i in users), key=lambda bits: (bits[1], bits[0]))
