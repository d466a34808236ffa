"""Which plans the skinny GEMM (csrc/gemm/gemm_skinny.cu) refuses, for the tests of its int8 and
4-bit weights: those whose K range of x does not fit in its shared memory."""

SKINNY_MAX_STAGED_BYTES = 96 * 1024


def skinny_staged_bytes(x_rows, K, splits):
    """Shared memory a block of the skinny kernel stages x in: its x_rows rows (16, 32 or 64), each
    a split's K range (a multiple of 128 bytes) and 64 bytes of padding."""
    per_split = -(-K // splits)
    return x_rows * (-(-per_split // 128) * 128 + 64)
