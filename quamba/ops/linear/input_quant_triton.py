"""The input quantizers (quamba.ops.linear.input_quant) in Triton: one program per row. Per token,
it reads its row once for the absmax, computes the scale (max(absmax, SCALE_FLOOR) / 127) and its
reciprocal with round-to-nearest divisions, as the torch reference on a CPU does, stores the scale
and reads the row again to write the codes (the second read mostly from L2: a row is at most
Nemotron-H-8B's 21504 channels, 42 KiB in fp16). Per tensor it writes the codes of the reciprocal
computed on the host. With an activation each read applies it (relu(x)², or silu(x) · up with a
second input), rounded as torch rounds it, so the activation costs no pass of its own. Codes
follow quamba.ops.quant's rule (quamba.ops.quant_triton): they and the scales equal the
reference's bit for bit."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from quamba.ops import backend
from quamba.ops.norm.gated_norm_triton import as_rows
from quamba.ops.quant import SCALE_FLOOR, fp32_reciprocal
from quamba.ops.quant_triton import int8_codes

MAX_BLOCK = 4096  # channels a program loads at a time


# _quantize_rows_kernel's ACTIVATION of each activation: none, relu(x)², silu(x) · up
CODES = {None: 0, "relu2": 1, "swiglu": 2}


@triton.jit
def _rounded(x, like):
    """fp32 ``x`` rounded to the element type of pointer ``like``, in fp32 (to nearest even)."""
    if like.dtype.element_ty == tl.bfloat16:
        x = _bf16_round(x)
    elif like.dtype.element_ty == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _bf16_round(x):
    """fp32 ``x`` rounded to bf16 (to nearest, ties to even), in fp32. In integers, as the GPU's
    conversion rounds: Triton's interpreter truncates instead."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_input(x_row, up_row, c, mask, ACTIVATION: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The quantizer's input at ``c`` in fp32 (ACTIVATION: CODES): x; relu(x)² as torch.square
    computes it (in fp32, exact for fp16 and bf16 values, rounded once to x's dtype); or
    silu(x) · up as F.silu and the product compute them (x / (1 + exp(-x)) in fp32 with
    libdevice's exp, as torch's CUDA silu's expf, and a division rounded to nearest, rounded to
    x's dtype, times up, rounded again)."""
    x = tl.load(x_row + c, mask=mask, other=0).to(tl.float32)
    if ACTIVATION == 1:
        x = tl.maximum(x, 0.0)
        x = _rounded(x * x, x_row)
    elif ACTIVATION == 2:
        up = tl.load(up_row + c, mask=mask, other=0).to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-x)
        else:
            e = tl.exp(-x)
        x = _rounded(_rounded(tl.math.div_rn(x, 1.0 + e), x_row) * up, x_row)
    return x


@triton.jit
def _row_scale(x_row, up_row, width, scale_floor, BLOCK: tl.constexpr, ACTIVATION: tl.constexpr,
               LIBDEVICE: tl.constexpr):
    """max(absmax of the row, scale_floor) / 127, divided with round to nearest."""
    absmax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        c = start + tl.arange(0, BLOCK)
        x = _load_input(x_row, up_row, c, c < width, ACTIVATION, LIBDEVICE)
        absmax = tl.maximum(absmax, tl.abs(x))
    floored = tl.maximum(tl.max(absmax, axis=0), scale_floor)
    return tl.math.div_rn(floored, tl.full([], 127.0, tl.float32))


@triton.jit
def _quantize_rows_kernel(x_ptr, x_row_stride, up_ptr, up_row_stride, codes_ptr, scales_ptr, width,
                          inverse, scale_floor, BLOCK: tl.constexpr, PER_TOKEN: tl.constexpr,
                          ACTIVATION: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    up_row = up_ptr + row * up_row_stride
    if PER_TOKEN:
        scale = _row_scale(x_row, up_row, width, scale_floor, BLOCK, ACTIVATION, LIBDEVICE)
        tl.store(scales_ptr + row, scale)
        inverse = tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)
    for start in range(0, width, BLOCK):
        c = start + tl.arange(0, BLOCK)
        mask = c < width
        x = _load_input(x_row, up_row, c, mask, ACTIVATION, LIBDEVICE)
        tl.store(codes_ptr + row * width + c, int8_codes(x, inverse), mask=mask)


# libdevice's exp where the kernel is compiled; Triton's interpreter (TRITON_INTERPRET when it was
# defined) has none and runs numpy's
LIBDEVICE_MATH = not isinstance(_quantize_rows_kernel, InterpretedFunction)


def _launch(x: torch.Tensor, inverse: float, scales: torch.Tensor | None, activation=None,
            up: torch.Tensor | None = None) -> torch.Tensor:
    """int8 codes of ``x``'s rows (of its activation with ``up``: CODES); per token (``scales``
    [rows] given) the kernel writes them."""
    rows = as_rows(x)
    up_rows = rows if up is None else as_rows(up)
    codes = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(max(rows.shape[1], 1)))
    if codes.numel():
        _quantize_rows_kernel[(rows.shape[0],)](
            rows, rows.stride(0), up_rows, up_rows.stride(0), codes,
            codes if scales is None else scales, rows.shape[1], inverse, SCALE_FLOOR, BLOCK=block,
            PER_TOKEN=scales is not None, ACTIVATION=CODES[activation], LIBDEVICE=LIBDEVICE_MATH,
            num_warps=min(16, max(1, block // 256)))
    return codes.view(x.shape)


@backend.register("quantize_per_tensor", "cuda", kernels=())
def _quantize_per_tensor_cuda(x, scale):
    return _launch(x, fp32_reciprocal(float(scale)), None)


@backend.register("quantize_per_token", "cuda", kernels=())
def _quantize_per_token_cuda(x, activation=None, up=None):
    scales = torch.empty(x.shape[:-1].numel(), dtype=torch.float32, device=x.device)
    codes = _launch(x, 1.0, scales, activation, up)
    return codes, scales.view(*x.shape[:-1], 1)
