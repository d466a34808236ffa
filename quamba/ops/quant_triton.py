"""quamba.ops.quant's rounding rule as Triton helpers, for the Triton kernels that write int8 codes.

The multiplication x · inverse is clamped before the rounding addition, so the compiler cannot
contract the two into one FMA (which would round x · inverse differently from the reference)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_half_even(x):
    # |x| ≤ 2^22: adding 1.5·2^23 leaves no fraction bits, so fp32 addition rounds half to even
    return (x + 12582912.0) - 12582912.0


@triton.jit
def int8_code_values(x, inverse):
    """quamba.ops.quant.quantize's codes of fp32 ``x`` for fp32 ``inverse`` = fp32(1/scale), as
    fp32 values: round half to even, clamped to ±127."""
    codes = round_half_even(tl.clamp(x * inverse, -128.0, 128.0))
    return tl.clamp(codes, -127.0, 127.0)


@triton.jit
def int8_codes(x, inverse):
    """int8_code_values as int8."""
    return int8_code_values(x, inverse).to(tl.int8)
