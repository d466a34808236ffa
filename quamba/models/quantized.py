"""QuantizedMambaLM: the Mamba1 or Mamba2 LM with quantized blocks, and QuantizedModel, what it
shares with the quantized Vision Mamba classifier (quamba.models.quantized_vision): SSM modes and
checkpoints.

W8A8 and W4A8 blocks are a QRMSNorm (→ int8) and a QMambaMixer (QMamba2Mixer for Mamba2);
W4A16 (weight-only) blocks are the FP RMSNorm and the FP mixer with 4-bit in_proj, x_proj and
out_proj (quamba.layers.weight_only). A Mamba1 block of either kind (QMambaBlock,
WeightOnlyBlock) runs its batch-1 decode step on a GPU as one op where its layer kernel applies
(set_fused_layer). A mixed-precision model (QuantConfig.layer_bits) holds
both kinds. It reuses MambaLMHeadModel's forward, decode step, cache and
generate: only the blocks differ. The embedding, final norm and lm_head stay in the float dtype
unless QuantConfig.lm_head and quantize_embedding say otherwise (quamba.layers.qhead): an int8
head reads int8 codes from a QRMSNorm final norm, an int4 head the FP norm's output.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from quamba.errors import QuambaError
from quamba.layers.base import QuantModule
from quamba.layers.modes import (FP_MODE, STATE_CACHE_FORMATS, check_mode,
                                 check_weight_only_mode)
from quamba.layers.qhead import QEmbedding, empty_lm_head
from quamba.layers.qlinear import W4A16Linear
from quamba.layers.qmixer import ACTIVATION_SCALES, QMambaMixer
from quamba.layers.qmixer2 import ACTIVATION_SCALES as MAMBA2_ACTIVATION_SCALES
from quamba.layers.qmixer2 import QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.weight_only import weight_only_mixer
from quamba.models.config import MambaConfig
from quamba.models.hub import quantized_format
from quamba.models.loading import load_model
from quamba.models.mamba import Block, MambaLMHeadModel, RMSNorm
from quamba.models.state import DEFAULT_MAX_SEQLEN
from quamba.ops.fused_decode.layer_step import qmamba_layer_step
from quamba.ops.fused_decode.w4a16_step import w4a16_layer_step

log = logging.getLogger("quamba")


class QuantizedModel:
    """What every quantized model shares: its SSM mode, switched without re-calibrating, and for
    the ``fp16`` mode the unquantized model (kept from quantize(), else loaded from the recorded
    base model). Needs ``quant_config``, ``base_model``, ``ssm_mode`` and ``dtype``."""

    fused_decode = False  # whether the Mamba1 mixers' decode step is fused (set_fused_decode)
    # whether a Mamba1 block's batch-1 decode step is one op (set_fused_layer); None: the mixers'
    # default (QMambaMixer.fused_layer, WeightOnlyMambaMixer.fused_layer)
    fused_layer = None
    # whether a W4A16 Mamba1 mixer's decode-step SSM side is one op (set_fused_ssm_step); None: the
    # mixers' default (WeightOnlyMambaMixer.fused_ssm_step)
    fused_ssm_step = None

    @property
    def weight_only(self) -> bool:
        return self.quant_config.weight_only

    def set_ssm_mode(self, mode: str, backend: str | None = None):
        """Run the quantized blocks in ``mode`` (see quamba.layers.modes); ``fp16`` runs the
        unquantized model, loaded from the recorded base model if this one was reloaded. A W4A16
        model accepts only ``fp16``, which keeps it as it is (an int8 mode is a QuambaError);
        ``backend`` then applies to its 4-bit linear layers. In a mixed-precision model the
        int8 modes switch the A8 layers; its W4A16 layers keep their float SSM."""
        if self.weight_only:
            check_weight_only_mode(mode)
        elif check_mode(mode) == FP_MODE:
            self._fp()
        for module in self.modules():
            if isinstance(module, W4A16Linear):  # W4A16 layers, also those of a mixed model
                module.backend = backend
            elif isinstance(module, QuantModule) and mode != FP_MODE:
                module.set_mode(mode, backend)
        self.ssm_mode = mode
        return self

    def set_state_cache(self, state_cache: str):
        """Keep the decode SSM state of the int8 mixers as ``state_cache`` says ("int8" or
        "fp32", see QuantConfig.state_cache); applies to caches allocated from now on."""
        if state_cache not in STATE_CACHE_FORMATS:
            raise QuambaError(f"state_cache must be one of {', '.join(STATE_CACHE_FORMATS)}, got "
                              f"{state_cache!r}")
        for module in self.modules():
            if hasattr(module, "state_cache"):
                module.state_cache = state_cache
        self.state_cache = state_cache
        return self

    def set_fused_decode(self, enabled: bool):
        """Run each int8 Mamba1 mixer's decode-step SSM side as one op (qmixer_ssm_step) or op
        by op (``enabled`` False, the default): the same numbers on the torch backend; on a GPU
        two Triton kernels instead of four CUDA kernels, measured slower so far
        (QMambaMixer.fuses_decode says where it applies)."""
        return self._switch("fused_decode", enabled)

    def set_fused_layer(self, enabled: bool):
        """Run each W8A8, W4A8 or W4A16 Mamba1 block's batch-1 decode step on a GPU as one op,
        qmamba_layer_step or w4a16_layer_step, where its layer kernel applies
        (QMambaMixer.layer_step_weights and WeightOnlyMambaMixer.layer_step_weights say where),
        or (``enabled`` False) as its norm and mixer op by op: for W8A8 and W4A8 the same numbers
        bit for bit either way, for W4A16 the same to float tolerances (the kernel sums in its
        own order). On by default."""
        return self._switch("fused_layer", enabled)

    def set_fused_ssm_step(self, enabled: bool):
        """Run each W4A16 Mamba1 mixer's decode-step SSM side as one op, w4a16_ssm_step (one CUDA
        kernel on a GPU where it applies), or (``enabled`` False) op by op: the same numbers on
        the torch backend, the same to float tolerances on a GPU. On by default; off, the blocks'
        layer kernel (set_fused_layer) is off too: its whole step is op by op."""
        return self._switch("fused_ssm_step", enabled)

    def _switch(self, flag: str, enabled: bool):
        """Sets ``flag`` on every module that has it, and on the model (the decode graphs' key)."""
        for module in self.modules():
            if hasattr(module, flag):
                setattr(module, flag, bool(enabled))
        setattr(self, flag, bool(enabled))
        return self

    def _fp(self):
        if self.fp_model is None:
            if not self.base_model:
                raise QuambaError("ssm mode fp16 needs the unquantized model, and this checkpoint "
                                  "records no base model")
            device = next(t for t in (*self.parameters(), *self.buffers())).device
            self.__dict__["fp_model"], _ = load_model(self.base_model, dtype=self.dtype,
                                                      device=device, tokenizer=False)
        return self.fp_model

    @property
    def _runs_fp_model(self) -> bool:
        return self.ssm_mode == FP_MODE and not self.weight_only

    def save_pretrained(self, out_dir, tokenizer=None):
        """Write the quantized checkpoint atomically (see quamba.quantization.checkpoint)."""
        save = quantized_format["save"]
        return save(self, out_dir, tokenizer or getattr(self, "tokenizer", None))


class QuantizedMambaLM(QuantizedModel, MambaLMHeadModel):
    """Built empty (all codes zero, scales one) with the shapes of ``config``; ``quantize`` or
    ``from_pretrained`` fill it. ``set_ssm_mode`` switches the SSM mode without re-calibrating
    (a W4A16 model has only the fp16 mode: its SSM is not quantized)."""

    def __init__(self, config: MambaConfig, quant_config, dtype=torch.float16, device=None):
        nn.Module.__init__(self)
        self.config = config
        self.quant_config = quant_config
        self.calibration: dict = {}
        self.base_model: str | None = None
        self.tokenizer = None
        self.backbone = nn.Module()
        vocab = config.padded_vocab_size
        self.backbone.embedding = (
            QEmbedding(vocab, config.d_model, dtype, device) if quant_config.quantize_embedding
            else nn.Embedding(vocab, config.d_model, device=device, dtype=dtype))
        self.backbone.layers = nn.ModuleList(self._empty_block(i, dtype, device)
                                             for i in range(config.n_layer))
        self.backbone.norm_f = _empty_final_norm(config, quant_config, dtype, device)
        self.lm_head = empty_lm_head(quant_config.lm_head, config.d_model, vocab,
                                     quant_config.group_size, dtype, device)
        if self.ties_lm_head:
            self.lm_head.weight = self.backbone.embedding.weight
        # The unquantized model for the fp16 mode; kept out of the module tree and state dict.
        self.__dict__["fp_model"] = None
        # quantize / from_pretrained then set the recorded mode
        self.ssm_mode = FP_MODE if quant_config.weight_only else "int8"
        self.state_cache = "int8"

    def _empty_block(self, layer: int, dtype, device) -> Block:
        return _empty_block(self.config, self.quant_config, layer, dtype, device)

    @property
    def ties_lm_head(self) -> bool:
        """Whether lm_head shares the embedding's weight: only both in the float dtype, as the
        FP model ties them (a rotated model never does)."""
        return (self.config.tie_embeddings and self.quant_config.lm_head == "fp16"
                and not self.quant_config.quantize_embedding)

    @property
    def dtype(self) -> torch.dtype:
        embedding = self.backbone.embedding
        return embedding.out_dtype if isinstance(embedding, QEmbedding) else embedding.weight.dtype

    def forward(self, input_ids, cache=None, num_last_tokens: int = 0):
        if self._runs_fp_model:
            return self._fp()(input_ids, cache=cache, num_last_tokens=num_last_tokens)
        return super().forward(input_ids, cache=cache, num_last_tokens=num_last_tokens)

    def allocate_cache(self, batch_size: int, device=None, max_seqlen: int = DEFAULT_MAX_SEQLEN):
        if self._runs_fp_model:
            return self._fp().allocate_cache(batch_size, device, max_seqlen)
        return super().allocate_cache(batch_size, device, max_seqlen)


def _empty_final_norm(config: MambaConfig, quant_config, dtype, device) -> nn.Module:
    """The final norm: a QRMSNorm (→ int8 for the int8 head; its weight folded into lm_head when
    the model is rotated), else the FP RMSNorm."""
    if quant_config.lm_head == "int8":
        return QRMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, 1.0,
                        has_weight=not quant_config.hadamard, device=device)
    return RMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, device, dtype)


def _empty_block(config: MambaConfig, quant_config, layer: int, dtype, device) -> Block:
    """The empty block of layer ``layer``, of the precision the recipe gives it."""
    w_bits, a_bits = quant_config.bits_of(layer)
    if a_bits == 16:
        return _weight_only_block(config, quant_config, dtype, device)
    return _int8_block(config, quant_config, w_bits, dtype, device)


def _int8_block(config: MambaConfig, quant_config, w_bits: int, dtype, device) -> Block:
    """An empty W8A8 or W4A8 block: QRMSNorm (→ int8) and QMambaMixer (QMamba2Mixer for Mamba2)."""
    hadamard = quant_config.hadamard
    norm = QRMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, 1.0,
                    has_weight=not hadamard, device=device)
    if config.layer == "Mamba2":
        conv_ones = torch.ones(config.d_inner + 2 * config.ngroups * config.d_state)
        mixer = QMamba2Mixer(config, {name: 1.0 for name in MAMBA2_ACTIVATION_SCALES}, conv_ones,
                             conv_ones, 1.0, hadamard, dtype, device, w_bits,
                             quant_config.group_size)
    else:
        mixer = QMambaMixer(config.d_model, config.d_inner, config.d_state, config.d_conv,
                            config.dt_rank, {name: 1.0 for name in ACTIVATION_SCALES}, 1.0,
                            hadamard, dtype, device, w_bits, quant_config.group_size,
                            discretization=config.discretization,
                            mixer_rms_eps=config.mixer_rms_eps)
        return QMambaBlock(norm, mixer)
    return Block(norm, mixer)


class QMambaBlock(Block):
    """A W8A8 or W4A8 Mamba1 block: QRMSNorm and QMambaMixer, whose decode step runs as one op,
    qmamba_layer_step, where the mixer's layer kernel applies (QMambaMixer.layer_step_weights),
    else op by op; the same numbers either way."""

    def forward(self, hidden, residual=None, state=None, step=False, ssm_A=None, **mixer_kwargs):
        if step and not mixer_kwargs:
            weights = self.mixer.layer_step_weights(self.norm, hidden, residual, state)
            if weights is not None:
                return qmamba_layer_step(hidden, residual, weights, state.conv, state.ssm,
                                         backend_name=self.mixer.backend)
        return super().forward(hidden, residual, state=state, step=step, ssm_A=ssm_A,
                               **mixer_kwargs)


class WeightOnlyBlock(Block):
    """A W4A16 Mamba1 block: the FP RMSNorm and WeightOnlyMambaMixer, whose decode step runs as
    one op, w4a16_layer_step, where the mixer's layer kernel applies
    (WeightOnlyMambaMixer.layer_step_weights), else op by op; the same numbers on the torch
    backend, the same to float tolerances on the kernel. It adds no state to Block."""

    def forward(self, hidden, residual=None, state=None, step=False, ssm_A=None, **mixer_kwargs):
        if step and not mixer_kwargs:
            weights = self.mixer.layer_step_weights(self.norm, hidden, residual, state, ssm_A)
            if weights is not None:
                return w4a16_layer_step(hidden, residual, weights, state.conv, state.ssm,
                                        backend_name=self.mixer.x_proj.backend)
        return super().forward(hidden, residual, state=state, step=step, ssm_A=ssm_A,
                               **mixer_kwargs)


def _weight_only_block(config: MambaConfig, quant_config, dtype, device) -> Block:
    """An empty W4A16 block: the FP RMSNorm and the weight-only mixer, in a WeightOnlyBlock for
    Mamba1."""
    block_class = Block if config.layer == "Mamba2" else WeightOnlyBlock
    return block_class(RMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32,
                               device, dtype),
                       weight_only_mixer(config, quant_config.group_size, quant_config.hadamard,
                                         dtype, device))
