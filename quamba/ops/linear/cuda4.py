"""``w4a8_linear``, ``w4a16_linear`` and ``w4a16_linear_channel_major`` on the 4-bit kernels of
``quamba._C`` (csrc/gemm4).

Up to 8 rows run the decode GEMVs (W4A8: exact for any int8 group multiplier; W4A16: fp32
accumulation, on tensor cores, or on CUDA cores for one row of a layer with few weight rows).
More rows run the prefill GEMMs. At 9–64 rows on compute capability 9.0, with groups of a multiple of
128, W4A8 runs a GEMM on the packed codes, exact for any multiplier: the tiled one, or the skinny one
at 33–64 rows for a weight of at most 256 rows (x_proj). Otherwise
it expands the codes to an int8 weight (code × group multiplier) and runs the W8A8 GEMM, which is
exact only while every product fits int8 — multipliers in 1…18 for codes in -7…7
(quamba.ops.quant4). Above 8 rows that is checked here, on the device, whichever path runs (a
weight that longer prompts would refuse is refused at once), once per weight: the verdict is
cached per (packed weight, group multiplier) tensor pair and their ``_version`` counters, so later
calls cost no host sync (the first prefill call of a weight does one; run it before any CUDA-graph
capture of a prefill). A weight that overflows is refused with an error. W4A16 dequantizes to x's
dtype and calls cuBLAS on x as strided as it comes; float32 activations (no kernel) run the
reference computation on the GPU.

The fp32 epilogue multiplier of W4A8 is computed by the W8A8 backend's ``_epilogue_multiplier``
(the same function as the torch reference), so both backends round identically.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

import quamba._C  # noqa: F401  loads torch.ops.quamba.*
from quamba.errors import QuambaError
from quamba.ops import backend
from quamba.ops.linear.cuda import _epilogue_multiplier
from quamba.ops.linear.qlinear4 import HALF_TYPES, _w4a16_linear_torch

GEMV_MAX_M = 8

# packed weight -> (group multiplier tensor, its _version, the weight's _version, group size)
# of its last passed check; the versions are None for inference tensors
_EXPANDABLE: WeakIdKeyDictionary = WeakIdKeyDictionary()


class W4A8OverflowError(QuambaError, ValueError):
    """A W4A8 weight whose code × group multiplier does not fit int8 (the prefill GEMM needs it)."""


@backend.register("w4a8_linear", "cuda")
def _w4a8_linear_cuda(x, x_scale, weight_packed, group_multiplier, channel_scale, group_size,
                      out_scale, out_dtype):
    multiplier, per_channel = _epilogue_multiplier(x_scale, channel_scale, out_scale, weight_packed)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    if x2d.shape[0] > GEMV_MAX_M:
        check_expandable(weight_packed, group_multiplier, group_size)
    dtype = torch.int8 if out_scale is not None else out_dtype
    out = torch.ops.quamba.w4a8_linear(x2d, weight_packed, group_multiplier, group_size, multiplier,
                                       per_channel, dtype)
    return out.reshape(*x.shape[:-1], weight_packed.shape[0])


def _dequantized(weight_packed, scales, group_size, dtype):
    """The [N, K] weight in ``dtype`` (fp32(code) · fp32(scale), rounded once): what the W4A16
    prefill multiplies on cuBLAS."""
    weight = torch.empty(weight_packed.shape[0], 2 * weight_packed.shape[1], dtype=dtype,
                         device=weight_packed.device)
    torch.ops.quamba.w4a16_dequantize_out(weight_packed, scales, group_size, weight)
    return weight


@backend.register("w4a16_linear", "cuda", kernels=("w4a16_linear", "w4a16_dequantize_out"))
def _w4a16_linear_cuda(x, weight_packed, scales, group_size, out_dtype):
    """Up to 8 rows: the GEMV. More: the op's own GEMM path (the dequantized weight on cuBLAS), with
    x read through its strides: the FP mixer hands x_proj and out_proj transposed views of its
    channel-major tensors, which torch.matmul passes to cuBLAS as they are, where a contiguous copy
    for the op would move as many bytes as the GEMM reads."""
    if x.dtype not in HALF_TYPES:
        # The kernels take 16-bit activations; fp32 models run the reference's own computation
        # (fp32 dequantized weight, torch matmul) on the GPU rather than failing.
        return _w4a16_linear_torch(x, weight_packed, scales, group_size, out_dtype)
    if x.numel() > GEMV_MAX_M * x.shape[-1]:
        return (x @ _dequantized(weight_packed, scales, group_size, x.dtype).t()).to(out_dtype)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.quamba.w4a16_linear(x2d, weight_packed, scales, group_size, out_dtype)
    return out.reshape(*x.shape[:-1], weight_packed.shape[0])


@backend.register("w4a16_linear_channel_major", "cuda", kernels=("w4a16_linear", "w4a16_dequantize_out"))
def _w4a16_linear_channel_major_cuda(x, weight_packed, scales, group_size, out_dtype):
    """Up to 8 rows: the GEMV's [M, N], transposed (a view). More: the weight dequantized to x's
    dtype times xᵀ in one cuBLAS call, [N, M] as it comes, with x read through its strides."""
    if x.dtype not in HALF_TYPES or x.shape[0] <= GEMV_MAX_M:
        return _w4a16_linear_cuda(x, weight_packed, scales, group_size, out_dtype).t()
    return (_dequantized(weight_packed, scales, group_size, x.dtype) @ x.t()).to(out_dtype)


def check_expandable(weight_packed: torch.Tensor, group_multiplier: torch.Tensor, group_size: int) -> None:
    """Raises W4A8OverflowError unless every code × group multiplier of the weight fits int8.
    Checked on the device once per weight and cached (see the module docstring); in every call
    for inference tensors (made under torch.inference_mode), which have no version counter. A
    CUDA-graph capture cannot read the device: there the verdict of the last check stands, also
    for inference tensors (the warm-up runs before a capture check them), and a weight never
    checked is an error."""
    inference = weight_packed.is_inference() or group_multiplier.is_inference()
    versions = (None, None) if inference else (group_multiplier._version, weight_packed._version)
    cached = _EXPANDABLE.get(weight_packed)
    checked = cached is not None and cached[0] is group_multiplier and cached[1:] == (*versions, group_size)
    capturing = torch.cuda.is_current_stream_capturing()
    if checked and (capturing or not inference):
        return
    if capturing:
        raise QuambaError("w4a8_linear: a CUDA graph of a W4A8 prefill needs the weight's int8 range "
                          "checked before the capture (run the prefill once first)")
    overflow = torch.zeros(1, dtype=torch.int32, device=weight_packed.device)
    scratch = torch.empty(weight_packed.shape[0], 2 * weight_packed.shape[1], dtype=torch.int8,
                          device=weight_packed.device)
    torch.ops.quamba.w4a8_expand_out(weight_packed, group_multiplier, group_size, scratch, overflow)
    if int(overflow.item()):
        raise W4A8OverflowError(
            "w4a8_linear: the prefill GEMM runs on int8 code × group_multiplier, and this weight has "
            "products outside [-128, 127] (group multipliers must lie in 1…18 for codes in -7…7); "
            "requantize it with the current quamba.ops.quant4 rule")
    _EXPANDABLE[weight_packed] = (group_multiplier, *versions, group_size)
