"""``w8a8_linear`` on the W8A8 GEMM/GEMV kernels of ``quamba._C`` (csrc/gemm).

The fp32 epilogue multiplier is computed here by the same function as the torch reference
(:func:`quamba.ops.quant.requant_multiplier`), so both backends round identically; the kernel
picks the GEMV for up to 8 rows, else the GEMM for the device.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.weak import WeakIdKeyDictionary

import quamba._C  # noqa: F401  loads torch.ops.quamba.*
from quamba.ops import backend
from quamba.ops.quant import requant_multiplier

K_ALIGN = 16  # the GEMM and GEMV kernels read K in 16-byte steps


@backend.register("w8a8_linear", "cuda")
def _w8a8_linear_cuda(x, x_scale, weight, weight_scale, out_scale, bias, out_dtype):
    if out_scale is not None and bias is not None:
        raise ValueError("w8a8_linear: bias is only supported with a float output")
    multiplier, per_channel = _epilogue_multiplier(x_scale, weight_scale, out_scale, weight)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[-1] % K_ALIGN:
        x2d, weight = _pad_k(x2d), _pad_k(weight)
    elif not _rows_readable(x2d):
        x2d = x2d.contiguous()
    dtype = torch.int8 if out_scale is not None else out_dtype
    out = torch.ops.quamba.w8a8_linear(x2d, weight, multiplier, per_channel, bias, dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _rows_readable(x2d: torch.Tensor) -> bool:
    """Whether the op takes x2d as it is: rows of contiguous values, 16-byte aligned, starting a
    multiple of 16 bytes apart. dt_low, the first dt_rank columns of x_proj's [M, dt_rank + 2 ·
    d_state] output, is such a slice for every Mamba size: the decode GEMV reads it in place (the
    copy was one extra kernel per layer and step at batch > 1); the GEMMs copy it in the op."""
    return (x2d.stride(-1) == 1 and x2d.data_ptr() % K_ALIGN == 0
            and (x2d.shape[0] <= 1 or (x2d.stride(0) >= x2d.shape[1] and x2d.stride(0) % K_ALIGN == 0)))


def _pad_k(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad the reduction dim to a multiple of K_ALIGN, which the kernels need. Only small
    models hit this (e.g. dt_proj with dt_rank 12): zeros add nothing to the int32 accumulator, so
    the result stays exact."""
    return torch.nn.functional.pad(t, (0, -t.shape[-1] % K_ALIGN)).contiguous()


# Per-channel multipliers (W4A8's channel scales, Quamba2's per-channel output scales) by the
# scale tensor they come from: computed once per (the tensors' versions, the float scales), not in
# every call (three small kernels per linear).
_CHANNEL_MULTIPLIERS = WeakIdKeyDictionary()


def _epilogue_multiplier(x_scale, weight_scale, out_scale, weight):
    """(scalar, None) for one multiplier, (0.0, fp32 [N] on the weight's device) per channel."""
    scales = (x_scale, weight_scale, out_scale)
    if all(s is None or isinstance(s, (int, float)) for s in scales):
        return _scalar_multiplier(x_scale, weight_scale, out_scale), None
    key, anchor = _multiplier_key(scales, weight.device)
    if key is not None:
        cached = _CHANNEL_MULTIPLIERS.get(anchor)
        if cached is not None and cached[0] == key:
            return 0.0, cached[1]
    multiplier = requant_multiplier(x_scale, weight_scale, out_scale)
    if not isinstance(multiplier, torch.Tensor):
        return float(multiplier), None
    per_channel = multiplier.to(device=weight.device, dtype=torch.float32).reshape(-1)
    if per_channel.numel() == 1:  # a 0-d scale tensor: broadcast on the device, no host sync
        per_channel = per_channel.expand(weight.shape[0])
    per_channel = per_channel.contiguous()
    if key is not None:
        _CHANNEL_MULTIPLIERS[anchor] = (key, per_channel)
    return 0.0, per_channel


def _multiplier_key(scales: tuple, device):
    """(cache key, the tensor it is stored under) of a per-channel multiplier, or (None, None)
    where one of its tensors is an inference tensor (made under torch.inference_mode: no version
    counter to key on) or x_scale is a tensor."""
    x_scale, weight_scale, out_scale = scales
    tensors = [s for s in (weight_scale, out_scale) if isinstance(s, torch.Tensor)]
    if isinstance(x_scale, torch.Tensor) or any(s.is_inference() for s in tensors):
        return None, None
    key = tuple((id(s), s._version) if isinstance(s, torch.Tensor) else s for s in scales) + (device,)
    return key, tensors[0]


@functools.lru_cache(maxsize=4096)
def _scalar_multiplier(x_scale, weight_scale, out_scale) -> float:
    # Cached: requant_multiplier rounds through small CPU tensors, too slow for every decode step.
    return float(requant_multiplier(x_scale, weight_scale, out_scale))
