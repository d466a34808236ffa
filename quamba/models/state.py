"""Decode state: one mixer's (MixerState), one attention layer's (AttentionState) and a whole
model's (InferenceCache)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MixerState:
    """Decode state of one mixer: the last conv inputs, the SSM state, and for the foh
    discretization the last step's drive u ⊗ B (quamba.ops.scan.discretization)."""

    conv: torch.Tensor  # [batch, conv channels, d_conv - 1], model dtype
    ssm: torch.Tensor  # Mamba1: [batch, d_inner, d_state]; Mamba2: [batch, nheads, headdim, d_state]; fp32
    drive: torch.Tensor | None = None  # foh only: [batch, d_inner, d_state], fp32

    def keep_scan(self, last_state: torch.Tensor, last_drive: torch.Tensor | None) -> None:
        """Store a prefill's last SSM state, and its last drive where the state carries one."""
        self.ssm.copy_(last_state)
        if self.drive is not None:
            self.drive.copy_(last_drive)


@dataclass
class AttentionState:
    """Decode state of one attention layer: the keys and values of the tokens seen so far
    [batch, kv heads, tokens, head_dim], in the model dtype; each step replaces them by longer
    ones (quamba.models.transformer_layers.Attention)."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass
class InferenceCache:
    """Per-layer decode states (None for a layer without one: MLP, MoE) and the number of tokens
    already consumed."""

    states: list = field(default_factory=list)
    seqlen_offset: int = 0

    @property
    def batch_size(self) -> int:
        return self.states[0].conv.shape[0] if self.states else 0
