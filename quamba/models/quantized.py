"""QuantizedMambaLM: the Mamba1 LM with quantized blocks (norm → int8, W8A8 mixer).

It reuses MambaLMHeadModel's forward, decode step, cache and generate: only the blocks differ.
The embedding, final norm and lm_head stay in the float dtype.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from quamba.errors import QuambaError
from quamba.layers.base import QuantModule
from quamba.layers.modes import check_mode
from quamba.layers.qmixer import ACTIVATION_SCALES, QMambaMixer
from quamba.layers.qnorm import QRMSNorm
from quamba.models.config import MambaConfig
from quamba.models.mamba import Block, MambaLMHeadModel, RMSNorm

log = logging.getLogger("quamba")


class QuantizedMambaLM(MambaLMHeadModel):
    """Built empty (all codes zero, scales one) with the shapes of ``config``; ``quantize`` or
    ``from_pretrained`` fill it. ``set_ssm_mode`` switches the SSM mode without re-calibrating."""

    def __init__(self, config: MambaConfig, quant_config, dtype=torch.float16, device=None):
        nn.Module.__init__(self)
        self.config = config
        self.quant_config = quant_config
        self.calibration: dict = {}
        self.base_model: str | None = None
        self.tokenizer = None
        hadamard = quant_config.hadamard
        self.backbone = nn.Module()
        self.backbone.embedding = nn.Embedding(config.padded_vocab_size, config.d_model,
                                               device=device, dtype=dtype)
        ones = {name: 1.0 for name in ACTIVATION_SCALES}
        self.backbone.layers = nn.ModuleList(
            Block(QRMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, 1.0,
                           has_weight=not hadamard, device=device),
                  QMambaMixer(config.d_model, config.d_inner, config.d_state, config.d_conv,
                              config.dt_rank, ones, 1.0, hadamard, dtype, device,
                              quant_config.w_bits, quant_config.group_size))
            for _ in range(config.n_layer))
        self.backbone.norm_f = RMSNorm(config.d_model, config.norm_epsilon,
                                       config.residual_in_fp32, device, dtype)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False,
                                 device=device, dtype=dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight
        # The unquantized model for the fp16 mode; kept out of the module tree and state dict.
        self.__dict__["fp_model"] = None
        self.ssm_mode = "int8"  # quantize / from_pretrained then set the recorded mode

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embedding.weight.dtype

    def set_ssm_mode(self, mode: str, backend: str | None = None) -> "QuantizedMambaLM":
        """Run the quantized blocks in ``mode`` (see quamba.layers.modes); ``fp16`` runs the
        unquantized model, loaded from the recorded base model if this one was reloaded."""
        check_mode(mode)
        if mode == "fp16":
            self._fp()
        else:
            for module in self.modules():
                if isinstance(module, QuantModule):
                    module.set_mode(mode, backend)
        self.ssm_mode = mode
        return self

    def _fp(self):
        if self.fp_model is None:
            if not self.base_model:
                raise QuambaError("ssm mode fp16 needs the unquantized model, and this checkpoint "
                                  "records no base model")
            from quamba.models.loading import load_model
            device = self.backbone.embedding.weight.device
            self.__dict__["fp_model"], _ = load_model(self.base_model, dtype=self.dtype,
                                                      device=device, tokenizer=False)
        return self.fp_model

    def forward(self, input_ids, cache=None, num_last_tokens: int = 0):
        if self.ssm_mode == "fp16":
            return self._fp()(input_ids, cache=cache, num_last_tokens=num_last_tokens)
        return super().forward(input_ids, cache=cache, num_last_tokens=num_last_tokens)

    def allocate_cache(self, batch_size: int, device=None):
        if self.ssm_mode == "fp16":
            return self._fp().allocate_cache(batch_size, device)
        return super().allocate_cache(batch_size, device)

    def save_pretrained(self, out_dir, tokenizer=None):
        """Write the quantized checkpoint atomically (see quamba.quantization.checkpoint)."""
        from quamba.quantization.checkpoint import save_quantized
        return save_quantized(self, out_dir, tokenizer or self.tokenizer)
