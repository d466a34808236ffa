"""The decode state of one mixer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MixerState:
    """Decode state of one mixer: the last conv inputs and the SSM state."""

    conv: torch.Tensor  # [batch, conv channels, d_conv - 1], model dtype
    ssm: torch.Tensor  # Mamba1: [batch, d_inner, d_state]; Mamba2: [batch, nheads, headdim, d_state]; fp32
