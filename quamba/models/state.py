"""Decode state: one mixer's (MixerState), one attention layer's (AttentionState) and a whole
model's (InferenceCache)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quamba.errors import QuambaError

# The tokens a KV cache holds when its allocation is given no length (allocate_cache's default):
# generate allocates what the prompt and the new tokens need instead.
DEFAULT_MAX_SEQLEN = 2048


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
    """Decode state of one attention layer (quamba.models.transformer_layers.Attention): key and
    value buffers [batch, kv heads, max_seqlen, head_dim] in the model dtype, of which the first
    ``length`` positions hold the tokens seen so far. ``length`` is a device tensor [1] (int64),
    not a host int, so that a decode step captured in a CUDA graph writes and attends where the
    replay is, not where the capture was: a prefill sets it, each step advances it in place."""

    key: torch.Tensor
    value: torch.Tensor
    length: torch.Tensor

    @classmethod
    def empty(cls, batch_size: int, kv_heads: int, max_seqlen: int, head_dim: int, device,
              dtype) -> "AttentionState":
        buffer = torch.zeros(batch_size, kv_heads, max_seqlen, head_dim, device=device,
                             dtype=dtype)
        return cls(key=buffer, value=buffer.clone(),
                   length=torch.zeros(1, dtype=torch.long, device=device))

    @property
    def max_seqlen(self) -> int:
        return self.key.shape[2]


@dataclass
class InferenceCache:
    """Per-layer decode states (None for a layer without one: MLP, MoE), the number of tokens
    already consumed, and the tokens its KV caches hold (None: it has none, so no limit)."""

    states: list = field(default_factory=list)
    seqlen_offset: int = 0
    max_seqlen: int | None = None

    def holds(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` fits the KV caches."""
        return self.max_seqlen is None or tokens <= self.max_seqlen

    def check_room(self, new_tokens: int) -> None:
        """A QuambaError where ``new_tokens`` more tokens would not fit the KV caches."""
        if not self.holds(self.seqlen_offset + new_tokens):
            raise QuambaError(f"{self.seqlen_offset} + {new_tokens} tokens do not fit the KV "
                              f"cache of {self.max_seqlen}: allocate it with a larger max_seqlen")

    @property
    def batch_size(self) -> int:
        return self.states[0].conv.shape[0] if self.states else 0
