"""Zamba2's shared transformer blocks quantized (quamba.models.quantized_hybrid.QuantizedZamba2LM):
each block's linears once, as the FP model holds it once, with static input scales calibrated
over all of its uses (each clipping range the largest of its uses': the absmax over all of
them) and down_proj's input per token (quamba.layers.qtransformer); every layer that uses the
block points to the one quantized block. A hybrid layer's LoRA adapters stay float (their
outputs add to the quantized linears'), its own linear is quantized with its own input scale.
With per-layer bits (mixed precision) a layer's linear takes its layer's, a shared block the most
precise of its users' (quamba.models.quantized_hybrid.shared_block_bits)."""
from __future__ import annotations

import copy

from quamba.calibrate.calibrate import SHARED_PREFIX
from quamba.layers.qtransformer import quantize_linears_, quantized_linear
from quamba.models.quantized_hybrid import shared_block_bits
from quamba.models.zamba2 import shared_block_users
from quamba.quantization.config import QuantConfig


def quantize_shared_blocks_(qmodel, fp_model, ranges: dict | None, config: QuantConfig) -> None:
    """Fill ``qmodel``'s shared blocks, adapters and layer linears from ``fp_model``'s (its
    Mamba2 layers are quantized as every hybrid's, quamba.quantization.blocks): a layer's
    linear at its layer's bits, a shared block at shared_block_bits of its users'."""
    fp_layers, layers = fp_model.backbone.layers, qmodel.backbone.layers
    for b, fp_block in enumerate(fp_model.backbone.shared_blocks):
        uses = shared_block_users(fp_model.config, b)
        block = quantize_linears_(copy.deepcopy(fp_block), *shared_block_bits(config, uses),
                                  config.group_size, ranges and shared_ranges(ranges, uses))
        qmodel.backbone.shared_blocks[b] = block
        for i in uses:
            layers[i].set_shared(block)
    for i, (layer, fp_layer) in enumerate(zip(layers, fp_layers)):
        if fp_layer.shared is not None:
            layer.adapters = copy.deepcopy(fp_layer.adapters)
            layer.linear = quantized_linear(fp_layer.linear, "linear", *config.bits_of(i),
                                            config.group_size, ranges and ranges[i])


def shared_ranges(ranges: dict, uses: list[int]) -> dict:
    """A shared block's clipping ranges by kind (SHARED_PREFIX dropped): each the largest over
    the layers ``uses`` that run it."""
    kinds = [kind for kind in ranges[uses[0]] if kind.startswith(SHARED_PREFIX)]
    return {kind[len(SHARED_PREFIX):]: max(ranges[i][kind] for i in uses) for kind in kinds}
