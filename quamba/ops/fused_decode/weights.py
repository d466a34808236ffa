"""The weight and scale records of the fused decode steps (quamba.ops.fused_decode): what a mixer
hands its step ops, shared by their references and their kernel launchers."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ConvWeights:
    """The int8 depthwise conv of the step (quamba.ops.conv.qconv1d)."""

    weight: torch.Tensor  # int8 [d_inner, width]
    weight_scale: float
    bias: torch.Tensor | None  # int8 [d_inner]
    bias_scale: float


@dataclass
class W8A8Weight:
    """A W8A8 linear with an int8 output (quamba.ops.linear.qlinear), per-tensor scales."""

    weight: torch.Tensor  # int8 [N, K]
    weight_scale: float
    in_scale: float
    out_scale: float


@dataclass
class W4A8Weight:
    """A W4A8 linear with an int8 output (quamba.ops.linear.qlinear4, quamba.ops.quant4's
    format)."""

    packed: torch.Tensor  # uint8 [N, K / 2]
    group_multiplier: torch.Tensor  # int8 [N, K / group_size]
    channel_scale: torch.Tensor  # fp32 [N]
    group_size: int
    in_scale: float
    out_scale: float


@dataclass
class StepScales:
    """The activation scales the conv and the scan read (the linears carry their own)."""

    xz: float  # x and z codes, and the conv state
    u: float
    xdbl: float  # B and C
    dt: float
    state: float  # an int8 SSM state's (ignored for an fp32 state)
