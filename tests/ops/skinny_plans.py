"""Which plans the skinny GEMM (csrc/gemm/gemm_skinny.cu) refuses, for the tests of its int8 and
4-bit weights: those whose K range of x does not fit in its shared memory."""

SKINNY_MAX_STAGED_BYTES = 96 * 1024


def skinny_staged_bytes(M, K, splits):
    """Shared memory the skinny kernel stages x in: its rows rounded up to 16, 32 or 64, each a
    split's K range (a multiple of 128 bytes) and 64 bytes of padding."""
    x_rows = 16 if M <= 16 else 32 if M <= 32 else 64
    per_split = -(-K // splits)
    return x_rows * (-(-per_split // 128) * 128 + 64)
