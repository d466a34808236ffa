"""4-bit weight linear ops (format: quamba.ops.quant4): W4A8 and weight-only W4A16."""
from __future__ import annotations

import torch

from quamba.ops import backend
from quamba.ops.linear.qlinear import int8_matmul
from quamba.ops.quant import requant_multiplier, requantize
from quamba.ops.quant4 import dequantize_int4, expand_groups, unpack_int4

# csrc/gemm4/gemm4.h kCodesPerChunk: every 4-bit kernel of quamba._C (GEMVs, GEMMs, expansion,
# dequantization) reads a packed row in 16-byte chunks of 32 codes, a chunk inside one group
CODES_PER_CHUNK = 32
HALF_TYPES = (torch.float16, torch.bfloat16)


def kernel_lacks(weight_packed, group_size: int) -> str | None:
    """Why no 4-bit kernel of quamba._C takes this weight (uint8 [N, K / 2] in groups of
    ``group_size``), None where they do: K and the group size must be multiples of 32
    (linear4.cpp's check_x and check_weight)."""
    in_features = 2 * weight_packed.shape[-1]
    if in_features % CODES_PER_CHUNK == 0 and group_size % CODES_PER_CHUNK == 0:
        return None
    return (f"its 4-bit kernels take in_features and group_size in multiples of "
            f"{CODES_PER_CHUNK} (16 bytes of packed codes), not {in_features} and {group_size}")


def w4a16_kernel_lacks(x, weight_packed, group_size: int) -> str | None:
    """The 4-bit limit where a W4A16 call reaches a kernel: float32 activations run the
    reference's computation on the GPU in the cuda backend (quamba.ops.linear.cuda4)."""
    return kernel_lacks(weight_packed, group_size) if x.dtype in HALF_TYPES else None


def w4a8_linear(x, x_scale, weight_packed, group_multiplier, channel_scale, group_size: int,
                out_scale=None, out_dtype=torch.float16, backend_name=None):
    """y = x · Wᵀ with int8 x and 4-bit W on an exact integer accumulator.

    x: int8 [..., K]; weight_packed: uint8 [N, K/2]; group_multiplier: int8 [N, K/G] (1…18, or
    up to 127 in checkpoints written before the cap); channel_scale: fp32 [N].

        w[n, k] = code[n, k] · group_multiplier[n, k // G]      (int8: |w| ≤ 7 · 18 = 126)
        acc[n]  = Σ_k x[k] · w[n, k]                               (int32, exact)
        out     = requantize(acc, requant_multiplier(x_scale, channel_scale, out_scale))  (int8)
           or   = fp32(acc) · requant_multiplier(x_scale, channel_scale)               (float)

    |acc| ≤ K · 127 · 126, within int32 for K up to 134k (K up to 19k with multipliers of 127).
    """
    impl = backend.select("w4a8_linear", x.device, backend_name,
                          cuda_lacks=kernel_lacks(weight_packed, group_size))
    return impl(x, x_scale, weight_packed, group_multiplier, channel_scale, group_size, out_scale,
                out_dtype)


def w4a16_linear(x, weight_packed, scales, group_size: int, out_dtype=None, backend_name=None):
    """y = x · Wᵀ with a float x [..., K] and W = code · scale (fp16 group scales [N, K/G]),
    accumulated in fp32 and returned in ``out_dtype`` (default x's dtype)."""
    impl = backend.select("w4a16_linear", x.device, backend_name,
                          cuda_lacks=w4a16_kernel_lacks(x, weight_packed, group_size))
    return impl(x, weight_packed, scales, group_size, out_dtype or x.dtype)


def w4a16_linear_channel_major(x, weight_packed, scales, group_size: int, out_dtype=None,
                               backend_name=None):
    """W · xᵀ: [N, M] for x [M, K], the transpose of ``w4a16_linear(x)`` with the same arithmetic
    (the layout in which the FP mixer's prefill keeps in_proj's output, see
    quamba.models.mamba.MambaMixer)."""
    impl = backend.select("w4a16_linear_channel_major", x.device, backend_name,
                          cuda_lacks=w4a16_kernel_lacks(x, weight_packed, group_size))
    return impl(x, weight_packed, scales, group_size, out_dtype or x.dtype)


@backend.register("w4a8_linear", "torch")
def _w4a8_linear_torch(x, x_scale, weight_packed, group_multiplier, channel_scale, group_size,
                       out_scale, out_dtype):
    weight = unpack_int4(weight_packed).int() * expand_groups(group_multiplier.int(), group_size)
    lead_shape = x.shape[:-1]
    acc = int8_matmul(x.reshape(-1, x.shape[-1]), weight)  # fp64 GEMM, exact for these ranges
    multiplier = requant_multiplier(x_scale, channel_scale, out_scale)
    if out_scale is not None:
        out = requantize(acc, multiplier)
    else:
        out = (acc.float() * torch.as_tensor(multiplier, device=acc.device)).to(out_dtype)
    return out.reshape(*lead_shape, weight.shape[0])


@backend.register("w4a16_linear", "torch")
def _w4a16_linear_torch(x, weight_packed, scales, group_size, out_dtype):
    weight = dequantize_int4(weight_packed, scales, group_size)
    return (x.float() @ weight.t().to(x.device)).to(out_dtype)


@backend.register("w4a16_linear_channel_major", "torch")
def _w4a16_linear_channel_major_torch(x, weight_packed, scales, group_size, out_dtype):
    weight = dequantize_int4(weight_packed, scales, group_size)
    return (weight.to(x.device) @ x.float().t()).to(out_dtype)
