"""The input quantizers (quamba.ops.linear.input_quant) in Triton: one program per row. Per token,
it reads its row once for the absmax, computes the scale (max(absmax, SCALE_FLOOR) / 127) and its
reciprocal with round-to-nearest divisions, as the torch reference on a CPU does, stores the scale
and reads the row again to write the codes (the second read mostly from L2: a row is at most
Nemotron-H-8B's 21504 channels, 42 KiB in fp16). Per tensor it writes the codes of the reciprocal
computed on the host. With ``activation="relu2"`` each read applies relu(x)² (an exact product in
fp32, rounded to x's dtype as torch rounds it), so the activation costs no pass of its own. Codes
follow quamba.ops.quant's rule (quamba.ops.quant_triton): they and the scales equal the
reference's bit for bit."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quamba.ops import backend
from quamba.ops.norm.gated_norm_triton import as_rows
from quamba.ops.quant import SCALE_FLOOR, fp32_reciprocal
from quamba.ops.quant_triton import int8_codes

MAX_BLOCK = 4096  # channels a program loads at a time


@triton.jit
def _load_input(x_row, c, mask, RELU2: tl.constexpr):
    """The row's values at ``c`` in fp32: x, or relu(x)² in x's dtype as torch.square computes it
    (in fp32, exact for fp16 and bf16 values, then rounded once to the dtype)."""
    x = tl.load(x_row + c, mask=mask, other=0).to(tl.float32)
    if RELU2:
        x = tl.maximum(x, 0.0)
        if x_row.dtype.element_ty == tl.bfloat16:
            x = _bf16_round(x * x)
        else:
            x = (x * x).to(x_row.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _bf16_round(x):
    """fp32 ``x`` rounded to bf16 (to nearest, ties to even), in fp32. In integers, as the GPU's
    conversion rounds: Triton's interpreter truncates instead."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_scale(x_row, width, scale_floor, BLOCK: tl.constexpr, RELU2: tl.constexpr):
    """max(absmax of the row, scale_floor) / 127, divided with round to nearest."""
    absmax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        c = start + tl.arange(0, BLOCK)
        absmax = tl.maximum(absmax, tl.abs(_load_input(x_row, c, c < width, RELU2)))
    floored = tl.maximum(tl.max(absmax, axis=0), scale_floor)
    return tl.math.div_rn(floored, tl.full([], 127.0, tl.float32))


@triton.jit
def _quantize_rows_kernel(x_ptr, x_row_stride, codes_ptr, scales_ptr, width, inverse, scale_floor,
                          BLOCK: tl.constexpr, PER_TOKEN: tl.constexpr, RELU2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    if PER_TOKEN:
        scale = _row_scale(x_row, width, scale_floor, BLOCK, RELU2)
        tl.store(scales_ptr + row, scale)
        inverse = tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)
    for start in range(0, width, BLOCK):
        c = start + tl.arange(0, BLOCK)
        mask = c < width
        x = _load_input(x_row, c, mask, RELU2)
        tl.store(codes_ptr + row * width + c, int8_codes(x, inverse), mask=mask)


def _launch(x: torch.Tensor, inverse: float, scales: torch.Tensor | None,
            relu2: bool = False) -> torch.Tensor:
    """int8 codes of ``x``'s rows (of relu(x)² if ``relu2``); per token (``scales`` [rows] given)
    the kernel writes them."""
    rows = as_rows(x)
    codes = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(max(rows.shape[1], 1)))
    if codes.numel():
        _quantize_rows_kernel[(rows.shape[0],)](
            rows, rows.stride(0), codes, codes if scales is None else scales, rows.shape[1],
            inverse, SCALE_FLOOR, BLOCK=block, PER_TOKEN=scales is not None, RELU2=relu2,
            num_warps=min(16, max(1, block // 256)))
    return codes.view(x.shape)


@backend.register("quantize_per_tensor", "cuda", kernels=())
def _quantize_per_tensor_cuda(x, scale):
    return _launch(x, fp32_reciprocal(float(scale)), None)


@backend.register("quantize_per_token", "cuda", kernels=())
def _quantize_per_token_cuda(x, activation=None):
    scales = torch.empty(x.shape[:-1].numel(), dtype=torch.float32, device=x.device)
    codes = _launch(x, 1.0, scales, relu2=activation == "relu2")
    return codes, scales.view(*x.shape[:-1], 1)
