"""The one rounding and saturation rule of quamba. Every op and every kernel follows it.

Symmetric, per-tensor (or per-channel where stated), static int8:

* **scale**: ``scale = max(range, SCALE_FLOOR) / 127`` in fp32, where ``range`` is the clipping
  range an observer measured (absmax or a percentile of |x|).
* **quantize**: ``q = clamp(rne(x · inv), -127, 127)`` with ``inv = fp32(1 / scale)`` computed once
  in fp32 and ``x`` in fp32; rne is round-half-to-even. -128 is never produced, so the int8
  range is symmetric. Division is written as a multiplication by the fp32 reciprocal so every
  backend (PyTorch CPU/CUDA, our kernels) rounds identically; kernels must not fuse the
  multiplication into a neighbouring add (no FMA contraction across it).
* **dequantize**: ``x = fp32(q) · scale``.
* **requantize an int32 accumulator** (GEMM, conv): ``q = clamp(rne(fp32(acc) · multiplier))``
  with ``multiplier = requant_multiplier(in_scale, weight_scale, out_scale)``, one fp32 number
  (or one per output channel) computed on the host by the function below for every backend.
"""
from __future__ import annotations

import functools

import torch

INT8_MAX = 127
SCALE_FLOOR = 1e-8


def to_fp32(value) -> torch.Tensor | float:
    """A Python float rounded to fp32 (so host and device agree on its value); tensors → fp32."""
    if isinstance(value, torch.Tensor):
        return value.float()
    return float(torch.tensor(float(value), dtype=torch.float32))


def scale_from_range(clip_range) -> torch.Tensor | float:
    """fp32 scale mapping ``clip_range`` to 127 (floored so an all-zero tensor stays finite)."""
    if isinstance(clip_range, torch.Tensor):
        return clip_range.float().clamp(min=SCALE_FLOOR) / INT8_MAX
    return to_fp32(max(float(clip_range), SCALE_FLOOR) / INT8_MAX)


def reciprocal(scale) -> torch.Tensor | float:
    """fp32(1 / scale): the multiplier ``quantize`` applies."""
    if isinstance(scale, torch.Tensor):
        return torch.reciprocal(scale.float())
    return to_fp32(1.0 / to_fp32(scale))


@functools.lru_cache(maxsize=4096)
def fp32_value(value: float) -> float:
    """:func:`to_fp32` of a Python float, cached: the constants kernel launchers pass per call."""
    return float(to_fp32(value))


@functools.lru_cache(maxsize=4096)
def fp32_reciprocal(scale: float) -> float:
    """:func:`reciprocal` of a Python float scale, cached."""
    return float(reciprocal(scale))


def quantize(x: torch.Tensor, scale) -> torch.Tensor:
    """int8 codes of ``x`` (any float dtype) for ``scale`` (float or broadcastable fp32 tensor)."""
    inv = reciprocal(scale)
    if isinstance(inv, torch.Tensor):
        inv = inv.to(x.device)
    return torch.round(x.float() * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize(q: torch.Tensor, scale) -> torch.Tensor:
    """fp32 values of int8 codes ``q``."""
    if isinstance(scale, torch.Tensor):
        scale = scale.float().to(q.device)
    return q.float() * scale


def fake_quantize(x: torch.Tensor, scale) -> torch.Tensor:
    """quantize then dequantize, in fp32: what an int8 tensor holds, seen as floats."""
    return dequantize(quantize(x, scale), scale)


def quantize_weight(weight: torch.Tensor, per_channel: bool = False):
    """Symmetric absmax int8 codes and fp32 scale of a weight (per tensor, or per output row)."""
    w = weight.detach().float()
    if per_channel:
        scale = scale_from_range(w.abs().amax(dim=tuple(range(1, w.dim()))))
        return quantize(w, scale.view(-1, *([1] * (w.dim() - 1)))), scale
    scale = scale_from_range(float(w.abs().max()))
    return quantize(w, scale), scale


def requant_multiplier(in_scale, weight_scale, out_scale=None):
    """fp32 epilogue multiplier of an int32 accumulator: ``in_scale · weight_scale / out_scale``
    (without ``out_scale`` for a float output). A tensor when ``weight_scale`` or ``out_scale`` is
    per channel."""
    if isinstance(weight_scale, torch.Tensor) and weight_scale.numel() > 1:
        multiplier = weight_scale.float() * to_fp32(in_scale)
        return multiplier if out_scale is None else multiplier * reciprocal(out_scale)
    multiplier = to_fp32(to_fp32(in_scale) * to_fp32(float(weight_scale)))
    if isinstance(out_scale, torch.Tensor):  # per output channel (Quamba2's in_proj segments)
        return multiplier * reciprocal(out_scale)
    return multiplier if out_scale is None else to_fp32(multiplier * reciprocal(out_scale))


@functools.lru_cache(maxsize=4096)
def fp32_multiplier(in_scale: float, weight_scale: float, out_scale: float | None = None) -> float:
    """:func:`requant_multiplier` of Python float scales, cached: kernel launchers pass it per
    call, and it rounds through small CPU tensors."""
    return float(requant_multiplier(float(in_scale), float(weight_scale),
                                    None if out_scale is None else float(out_scale)))


def requantize(acc: torch.Tensor, multiplier) -> torch.Tensor:
    """int8 codes of an int32 accumulator times the fp32 ``multiplier``."""
    if isinstance(multiplier, torch.Tensor):
        multiplier = multiplier.to(acc.device)
    return torch.round(acc.float() * multiplier).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
