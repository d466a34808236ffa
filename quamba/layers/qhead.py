"""The quantized ends of a language model: the int8 embedding (per-row scales, dequantized on
lookup) and the lm_head formats of QuantConfig.lm_head.

lm_head formats (the final RMSNorm in front of the head is chosen with it):

* ``fp16``: nn.Linear in the model's float dtype (tied to the embedding where the model ties
  them), after the FP RMSNorm: the unquantized head.
* ``int8``: W8A8, int8 weight with one fp32 scale per output channel (vocabulary row), int8 input
  from a QRMSNorm with the calibrated static scale of the final norm's output (``lm_head.input``),
  float logits; the existing W8A8 GEMM/GEMV kernels with a per-channel epilogue.
* ``int4``: W4A16, 4-bit weight in groups of ``group_size`` input channels with fp16 group scales,
  after the FP RMSNorm: no activation quantization, so it also fits the weight-only recipe.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from quamba.layers.qlinear import W4A16Linear, W8A8Linear
from quamba.ops.quant import quantize_weight

LM_HEAD_FORMATS = ("fp16", "int8", "int4")


class QEmbedding(nn.Module):
    """Embedding rows as int8 codes [vocab, d_model] with one fp32 scale per row; a lookup returns
    the dequantized rows in ``out_dtype``. Per-row absmax scales keep every row's resolution, and
    rows of rare tokens cost nothing when they are small."""

    def __init__(self, num_embeddings: int, embedding_dim: int, out_dtype=torch.float16,
                 device=None):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones(num_embeddings, device=device))
        self.out_dtype = out_dtype

    @classmethod
    def from_float(cls, embedding: nn.Embedding) -> "QEmbedding":
        weight = embedding.weight
        q = cls(weight.shape[0], weight.shape[1], weight.dtype, weight.device)
        codes, scale = quantize_weight(weight, per_channel=True)
        q.weight.copy_(codes)
        q.weight_scale.copy_(scale)
        return q

    def forward(self, input_ids):
        rows = F.embedding(input_ids, self.weight).float()
        return (rows * F.embedding(input_ids, self.weight_scale[:, None])).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, int8 rows, out={self.out_dtype}"


def empty_lm_head(lm_head: str, d_model: int, vocab_size: int, group_size: int, dtype,
                  device=None) -> nn.Module:
    """The empty lm_head module of format ``lm_head`` (see the module docstring)."""
    if lm_head == "int8":
        return W8A8Linear(d_model, vocab_size, 1.0, None, dtype, device, per_channel=True)
    if lm_head == "int4":
        return W4A16Linear(d_model, vocab_size, group_size, device)
    return nn.Linear(d_model, vocab_size, bias=False, device=device, dtype=dtype)
