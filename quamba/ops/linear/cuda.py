"""``w8a8_linear`` on the W8A8 GEMM/GEMV kernels of ``quamba._C`` (csrc/gemm).

The fp32 epilogue multiplier is computed here by the same function as the torch reference
(:func:`quamba.ops.quant.requant_multiplier`), so both backends round identically; the kernel
picks the GEMV for up to 8 rows, else the GEMM for the device.
"""
from __future__ import annotations

import torch

import quamba._C  # noqa: F401  loads torch.ops.quamba.*
from quamba.ops import backend
from quamba.ops.constants import cached
from quamba.ops.quant import fp32_multiplier, requant_multiplier

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


def _epilogue_multiplier(x_scale, weight_scale, out_scale, weight):
    """(scalar, None) for one multiplier, (0.0, fp32 [N] on the weight's device) per channel (W4A8's
    channel scales, Quamba2's per-channel output scales), kept per version of the scale tensors
    (quamba.ops.constants) unless x_scale is a tensor or one of them an inference tensor."""
    scales = (x_scale, weight_scale, out_scale)
    if all(s is None or isinstance(s, (int, float)) for s in scales):
        return fp32_multiplier(*scales), None

    def make():
        multiplier = requant_multiplier(*scales)
        if not isinstance(multiplier, torch.Tensor):
            return float(multiplier)
        # a 0-d scale tensor broadcasts on the device (no host sync)
        multiplier = multiplier.to(device=weight.device, dtype=torch.float32).reshape(-1)
        return multiplier.expand(weight.shape[0]).contiguous()
    tensors = [s for s in scales if isinstance(s, torch.Tensor)]
    if isinstance(x_scale, torch.Tensor) or any(s.is_inference() for s in tensors):
        multiplier = make()
    else:
        key = tuple((id(s), s._version) if isinstance(s, torch.Tensor) else s for s in scales)
        multiplier = cached(tensors[0], key + (weight.device,), make)
    return (multiplier, None) if isinstance(multiplier, float) else (0.0, multiplier)


