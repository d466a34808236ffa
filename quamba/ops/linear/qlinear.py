"""W8A8 linear: int8 activations × int8 weights → int32 accumulator → scaled int8 or float output."""
from __future__ import annotations

import torch

from quamba.ops import backend
from quamba.ops.quant import requant_multiplier, requantize


def w8a8_linear(x, x_scale, weight, weight_scale, out_scale=None, bias=None,
                out_dtype=torch.float16, backend_name=None):
    """y = x · weightᵀ on int8 codes with an fp32 epilogue.

    x: int8 [..., K] (contiguous last dim); x_scale: float.
    weight: int8 [N, K] row-major (each output channel's K codes contiguous).
    weight_scale: float (per tensor) or fp32 tensor [N] (per output channel).
    out_scale: float → int8 output ``requantize(acc, requant_multiplier(x_scale, w_scale, out_scale))``;
      None → float output ``fp32(acc) · requant_multiplier(x_scale, w_scale) (+ bias)`` in out_dtype.
    bias: fp32 [N] or None (float output only).
    Returns [..., N]. The accumulator is exact (int32), so int8 outputs match across backends
    exactly; float outputs to the rounding of the final cast.
    """
    impl = backend.select("w8a8_linear", x.device, backend_name)
    return impl(x, x_scale, weight, weight_scale, out_scale, bias, out_dtype)


def int8_matmul(x, weight):
    """Exact int32 x · weightᵀ for integer-valued x [M, K] and weight [N, K] (int8 codes, or
    W4A8's codes times their group multipliers) whose dot products fit in int32.

    fp64 holds every partial sum exactly (|acc| < 2³¹ < 2⁵³), so a float64 GEMM is an exact
    integer GEMM on any device."""
    return (x.double() @ weight.double().t()).to(torch.int32)


@backend.register("w8a8_linear", "torch")
def _w8a8_linear_torch(x, x_scale, weight, weight_scale, out_scale, bias, out_dtype):
    lead_shape = x.shape[:-1]
    acc = int8_matmul(x.reshape(-1, x.shape[-1]), weight)
    if out_scale is not None:
        if bias is not None:
            raise ValueError("w8a8_linear: bias is only supported with a float output")
        out = requantize(acc, requant_multiplier(x_scale, weight_scale, out_scale))
    else:
        out = acc.float() * _on(requant_multiplier(x_scale, weight_scale), acc.device)
        if bias is not None:
            out = out + bias.float()
        out = out.to(out_dtype)
    return out.reshape(*lead_shape, weight.shape[0])


def _on(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value
