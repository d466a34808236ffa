"""4-bit weights: the grouped symmetric rule, the two-level scales of W4A8, and the packing.

* **groups**: weights [N, K] are quantized in groups of ``group_size`` consecutive input channels
  (default 128; one group when K ≤ group_size; otherwise K must be a multiple of it).
* **codes**: ``q = clamp(rne(w · fp32(1 / s)), -7, 7)`` with s the group's fp32 scale
  ``absmax / 7`` — the int8 rule of quamba.ops.quant with 7 in place of 127 (-8 is never used).
* **W4A8 two-level scales**: per output channel an fp32 ``channel_scale = max group scale / 18``
  and per group an int8 ``group_multiplier = clamp(rne(s / channel_scale), 1, 18)``; the codes
  are taken against ``channel_scale · group_multiplier``. 18 = 127 // 7 (W4A8_MAX_MULTIPLIER)
  is the largest multiplier for which every expanded weight ``code · group_multiplier`` stays
  within int8 ([-126, 126]): the GEMM expands the 4-bit codes to these int8 weights once (as
  QQQ and Quamba2 do), runs a plain int8 × int8 → int32 GEMM on int8 tensor cores, and scales
  once per output channel in the epilogue, so it stays exact. (Checkpoints written before this
  cap hold multipliers up to 127; the torch reference op still runs them.)
* **W4A16 scales**: fp16 group scales ``absmax / 7``, rounded to fp16 before the codes are taken.
* **packing**: two codes per byte along K, the even k in the low nibble and the odd k in the high
  nibble, each as 4-bit two's complement: ``byte = (q[2i] & 0xF) | (q[2i+1] & 0xF) << 4``.
  Kernels may repack at load; checkpoints hold this layout.
"""
from __future__ import annotations

import torch

from quamba.errors import QuambaError
from quamba.ops.quant import INT8_MAX, SCALE_FLOOR, reciprocal

INT4_MAX = 7
W4A8_MAX_MULTIPLIER = INT8_MAX // INT4_MAX  # 18: code · multiplier stays an int8
DEFAULT_GROUP_SIZE = 128


def group_size_for(in_features: int, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """The group size used for a weight with ``in_features`` input channels."""
    if in_features <= group_size:
        return in_features
    if in_features % group_size:
        raise QuambaError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    return group_size


def expand_groups(group_values: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K / G] per-group values → [N, K] per-weight values."""
    return group_values.repeat_interleave(group_size, dim=1)


def group_scales(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 [N, K / G]: each group's absmax / 7 (floored)."""
    n, k = weight.shape
    absmax = weight.detach().float().abs().view(n, k // group_size, group_size).amax(-1)
    return absmax.clamp(min=SCALE_FLOOR) / INT4_MAX


def quantize_int4(weight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """int8 tensor of 4-bit codes in [-7, 7] for per-group ``scales`` [N, K / G]."""
    inv = expand_groups(reciprocal(scales.float()), group_size)
    return torch.round(weight.float() * inv).clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)


def two_level_scales(scales: torch.Tensor):
    """(channel_scale fp32 [N], group_multiplier int8 [N, K / G] in [1, 18]) approximating
    ``scales``."""
    channel_scale = scales.float().amax(dim=1).clamp(min=SCALE_FLOOR) / W4A8_MAX_MULTIPLIER
    multiplier = torch.round(scales.float() / channel_scale[:, None]).clamp_(1, W4A8_MAX_MULTIPLIER)
    return channel_scale, multiplier.to(torch.int8)


def effective_scales(channel_scale: torch.Tensor, group_multiplier: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K / G] group scales a two-level pair stands for."""
    return channel_scale[:, None] * group_multiplier.float()


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K even) → uint8 [N, K / 2]."""
    if codes.shape[-1] % 2:
        raise QuambaError(f"cannot pack an odd number of 4-bit codes ({codes.shape[-1]})")
    low = codes[..., 0::2].to(torch.int16) & 0xF
    high = codes[..., 1::2].to(torch.int16) & 0xF
    return (low | (high << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] → int8 codes [N, K] (sign-extended nibbles)."""
    as_int = packed.to(torch.int16)
    nibbles = torch.stack([as_int & 0xF, as_int >> 4], dim=-1).flatten(-2)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)


def quantize_weight_w4a8(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE):
    """RTN W4A8 weight: (packed uint8 [N, K/2], group_multiplier int8 [N, K/G], channel_scale
    fp32 [N], the group size used)."""
    size = group_size_for(weight.shape[1], group_size)
    channel_scale, multiplier = two_level_scales(group_scales(weight, size))
    codes = quantize_int4(weight, effective_scales(channel_scale, multiplier), size)
    return pack_int4(codes), multiplier, channel_scale, size


def w4a16_scales(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp16 [N, K / G]: W4A16's group scales, absmax / 7 rounded to fp16."""
    return group_scales(weight, group_size).half()


def quantize_weight_w4a16(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE):
    """RTN W4A16 weight: (packed uint8 [N, K/2], fp16 group scales [N, K/G], the group size).
    The fp16-rounded scales are the ones the codes are taken against."""
    size = group_size_for(weight.shape[1], group_size)
    scales = w4a16_scales(weight, size)
    return pack_int4(quantize_int4(weight, scales.float(), size)), scales, size


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 [N, K] weight from packed codes and fp32-convertible group scales [N, K / G]."""
    return unpack_int4(packed).float() * expand_groups(scales.float(), group_size)
