"""Per-layer mixed precision (Quamba2's W4AX): which layers of a W4A8 model run W4A16 instead.

A layer's sensitivity is measured, not guessed: the FP model, in the basis of the quantized one,
with that layer alone replaced by its W4A8 block, scored by its mean next-token NLL on
calibration samples, minus the FP model's. The ``mixed_precision`` fraction of the layers whose
NLL rises most run W4A16 (the same 4-bit weights, float activations and SSM: no activation
error, fp16 prefill), the others W4A8. Deterministic: ties go to the earlier layer.

A hybrid's layers are its blocks of every kind, ranked together by the same measure: a Mamba
block's W4A8 form is its int8 mixer, an attention, MLP or MoE block's its W4A8 linears (routers
float); its W4A16 form has the same 4-bit weights with float activations. A Zamba2 hybrid
layer's W4A8 form is its mixer, its linear and its use of the W4A8 shared block; the shared
blocks' bits follow from the layers' (quamba.models.quantized_hybrid.shared_block_bits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SENSITIVITY_SAMPLES = 16  # calibration samples each layer's sensitivity is measured on


@torch.no_grad()
def layer_sensitivity(fp_model, qmodel, tokens: torch.Tensor, batch_size: int = 8) -> list[float]:
    """NLL increase (nats per token) of ``fp_model`` with each of its blocks in turn replaced by
    ``qmodel``'s (``fp_model`` in the basis ``qmodel`` was built in; restored after each)."""
    ids = tokens[:SENSITIVITY_SAMPLES].to(fp_model.backbone.embedding.weight.device)
    baseline = _mean_nll(fp_model, ids, batch_size)
    layers = fp_model.backbone.layers
    increases = []
    for i, quantized_block in enumerate(qmodel.backbone.layers):
        fp_block = layers[i]
        layers[i] = quantized_block
        try:
            increases.append(_mean_nll(fp_model, ids, batch_size) - baseline)
        finally:
            layers[i] = fp_block
    return increases


def _mean_nll(model, ids: torch.Tensor, batch_size: int) -> float:
    total = 0.0
    for start in range(0, ids.shape[0], batch_size):
        batch = ids[start:start + batch_size]
        logits = model(batch)[:, :-1].float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                 reduction="sum").item()
    return total / (ids.shape[0] * (ids.shape[1] - 1))


def choose_layer_bits(sensitivity: list[float], fraction: float) -> tuple:
    """(w_bits, a_bits) per layer: W4A16 for the round(fraction · layers) most sensitive, W4A8
    for the rest."""
    count = round(fraction * len(sensitivity))
    ranked = sorted(range(len(sensitivity)), key=lambda i: (-sensitivity[i], i))
    w4a16 = set(ranked[:count])
    return tuple((4, 16) if i in w4a16 else (4, 8) for i in range(len(sensitivity)))
