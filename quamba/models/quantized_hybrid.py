"""Hybrids with quantized blocks (QuantizedHybridLM: Nemotron-H, Bamba, Granite-4.0-H, Zamba2).
Their Mamba2 layers are Quamba2's (QMamba2Mixer with Δ's floor, or the W4A16 mixer); their
attention, MLP and MoE layers keep their float RMSNorm and forward, with quantized linears
(quamba.layers.qtransformer); MoE routers stay float. Everything else (SSM modes, state cache,
forward, decode, generate, checkpoints) is QuantizedMambaLM's. A family adds only ``fp_mixer``:
its FP mixer of a block (Granite: and its µP embedding and logits multipliers, in float;
Zamba2: its shared transformer blocks and its layers' adapters and linears)."""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.qlinear import W4A16Linear
from quamba.layers.qmixer2 import ACTIVATION_SCALES, QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import empty_linear, quantize_linears_
from quamba.models.bamba import ScaledEmbedding, ScaledLogits, block_mixer
from quamba.models.mamba import Block, RMSNorm
from quamba.models.mamba2 import Mamba2Mixer
from quamba.models.nemotron_h import NemotronHMamba2Mixer, dt_floor, nemotron_h_layer
from quamba.models.quantized import QuantizedMambaLM
from quamba.models.zamba2 import (Zamba2Layer, Zamba2LM, Zamba2SharedBlock, num_shared_blocks,
                                  shared_block_of)


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


class QuantizedZamba2LM(QuantizedHybridLM, Zamba2LM):
    """Zamba2 (forward, cache and decode Zamba2LM's: every layer gets the token embeddings).
    The shared transformer blocks are held once (``backbone.shared_blocks``) with quantized
    linears, used at every depth as in the FP model; a hybrid layer keeps its LoRA adapters in
    float (their outputs add to the quantized linears') and quantizes its own linear."""

    def fp_mixer(self, layer: int, device=None, dtype=None) -> nn.Module:
        return NemotronHMamba2Mixer(self.config, device, dtype)

    def _empty_block(self, layer: int, dtype, device) -> Zamba2Layer:
        if not hasattr(self.backbone, "shared_blocks"):  # before the first layer points to them
            self.backbone.shared_blocks = nn.ModuleList(
                self._empty_shared_block(dtype, device)
                for _ in range(num_shared_blocks(self.config)))
        hybrid = self.config.layer_types[layer] == "hybrid"
        shared = (self.backbone.shared_blocks[shared_block_of(self.config, layer)] if hybrid
                  else None)
        quantized = super()._empty_block(layer, dtype, device)
        block = Zamba2Layer(self.config, shared, device, dtype)
        block.norm, block.mixer = quantized.norm, quantized.mixer
        if hybrid:
            block.linear = empty_linear(block.linear, "linear", *self._bits())
        return block

    def _empty_shared_block(self, dtype, device) -> Zamba2SharedBlock:
        block = Zamba2SharedBlock(self.config, device, dtype)
        return quantize_linears_(block, *self._bits(), load=False)

    def float_modules(self) -> list[nn.Module]:
        """What stays float beside the quantized linears, cast with the model's float dtype
        (quamba.quantization.checkpoint): the shared blocks' norms, the layers' adapters."""
        norms = [norm for block in self.backbone.shared_blocks
                 for norm in (block.input_norm, block.pre_ff_norm)]
        return norms + [layer.adapters for layer in self.backbone.layers
                        if layer.shared is not None]

    def _bits(self) -> tuple[int, int, int]:
        """(w_bits, a_bits, group_size) of the shared blocks and the layers' linears: the
        model's (hybrids take no per-layer precision)."""
        config = self.quant_config
        return config.w_bits, config.a_bits, config.group_size


def _weight_only_mixer(mixer: Mamba2Mixer, group_size: int, device=None) -> Mamba2Mixer:
    """An empty FP Mamba2 mixer made W4A16: 4-bit in_proj and out_proj, the rest float."""
    for name in ("in_proj", "out_proj"):
        fp = getattr(mixer, name)
        setattr(mixer, name, W4A16Linear(fp.in_features, fp.out_features, group_size, device))
    return mixer
