"""Hadamard matrices (orthonormality, entries, Kronecker layout) and the fast transform."""
import math

import pytest
import torch

from quamba.ops.norm.hadamard import (
    HadamardTransform,
    hadamard_factors,
    hadamard_matrix,
    hadamard_sign_matrix,
    hadamard_transform,
)

MAX_SIZE = 8192
SIZES = sorted({base << k for base in (1, 12, 20, 28, 40) for k in range(14)
                if base << k <= MAX_SIZE})
# A full Gram matrix of order 8192 costs ~1e12 flops: above FULL_GRAM_MAX orthogonality is checked
# on sampled rows, and in full through the Kronecker structure (a product of orthonormal factors).
FULL_GRAM_MAX = 1024


@pytest.fixture(scope="module", params=SIZES, ids=str)
def size_and_matrix(request):
    """The float64 matrix of each size, built once for all the tests that use it."""
    return request.param, hadamard_matrix(request.param)


def test_sizes_cover_the_mamba_shapes():
    assert {64, 192, 384, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 8192} <= set(SIZES)


def _sampled_rows(n):
    if n <= FULL_GRAM_MAX:
        return torch.arange(n)
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    return torch.cat([torch.arange(8), shuffled[:24], torch.arange(n - 8, n)])


def test_orthonormal_with_entries_plus_minus_one_over_sqrt_n(size_and_matrix):
    n, matrix = size_and_matrix
    assert matrix.dtype == torch.float64 and matrix.shape == (n, n)
    signs = hadamard_sign_matrix(n, torch.int8)
    assert signs.abs().eq(1).all()
    rows = _sampled_rows(n)
    assert torch.equal(matrix[rows], signs[rows].double() * (1 / math.sqrt(n)))
    identity_rows = torch.zeros(len(rows), n, dtype=torch.float64)
    identity_rows[torch.arange(len(rows)), rows] = 1
    assert (matrix[rows] @ matrix.T - identity_rows).abs().max() < 1e-6


@pytest.mark.parametrize("n", SIZES)
def test_kronecker_layout_documented_for_kernels(n):
    m, p = hadamard_factors(n)
    assert m in (1, 12, 20, 28) and p & (p - 1) == 0 and m * p == n
    factors = hadamard_sign_matrix(m, torch.int8), hadamard_sign_matrix(p, torch.int8)
    assert torch.equal(hadamard_sign_matrix(n, torch.int8), torch.kron(*factors))


@pytest.mark.parametrize("p", [1, 2, 4, 64, 512])
def test_power_of_two_is_sylvester_in_natural_order(p):
    i = torch.arange(p)
    popcount = sum(((i[:, None] & i[None, :]) >> bit) & 1 for bit in range(p.bit_length()))
    assert torch.equal(hadamard_sign_matrix(p), (1 - 2 * (popcount % 2)).float())


def test_fast_transform_matches_dense_product(size_and_matrix):
    n, matrix = size_and_matrix
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
    out = hadamard_transform(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out.double(), x.double() @ matrix, rtol=0, atol=5e-6)


def test_factors_of_the_supported_forms():
    assert hadamard_factors(1) == (1, 1)
    assert hadamard_factors(768) == (12, 64)
    assert hadamard_factors(2560) == (20, 128)  # 40·64 = 20·128
    assert hadamard_factors(40) == (20, 2)
    assert hadamard_factors(7168) == (28, 256)


@pytest.mark.parametrize("n", [0, -4, 3, 6, 10, 36, 44, 52, 60, 100, 4097, 2.0, True])
def test_unsupported_sizes_raise(n):
    with pytest.raises(ValueError, match="supported sizes are 2\\^k, 12·2\\^k"):
        hadamard_matrix(n)
    with pytest.raises(ValueError, match="supported sizes"):
        hadamard_factors(n)


def test_unsupported_module_size_raises_at_construction():
    with pytest.raises(ValueError, match="supported sizes"):
        HadamardTransform(96 + 4)


def test_returned_matrices_are_copies():
    hadamard_matrix(12).zero_()
    hadamard_sign_matrix(12).zero_()
    assert hadamard_sign_matrix(12).abs().eq(1).all() and hadamard_matrix(12).abs().min() > 0.28


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matrix_dtype_is_the_rounded_float64_matrix(dtype):
    assert torch.equal(hadamard_matrix(192, dtype), hadamard_matrix(192).to(dtype))


@pytest.mark.parametrize("n", [1, 2, 12, 20, 28, 40, 192, 384, 2560])
def test_fast_transform_batched_3d_and_strided(n):
    x = torch.randn(2, n, 5, generator=torch.Generator().manual_seed(0)).transpose(1, 2)
    expected = x.double() @ hadamard_matrix(n)
    torch.testing.assert_close(hadamard_transform(x).double(), expected, rtol=0, atol=5e-6)
    torch.testing.assert_close(HadamardTransform(n)(x[0, 0]).double(), expected[0, 0], rtol=0,
                               atol=5e-6)


def test_fast_transform_in_float64_is_undone_by_the_transpose():
    x = torch.randn(4, 768, dtype=torch.float64)
    rotated = hadamard_transform(x)
    assert rotated.dtype == torch.float64
    torch.testing.assert_close(rotated @ hadamard_matrix(768).T, x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_transform_low_precision_computes_in_fp32(dtype):
    x = torch.randn(2, 7, 384).to(dtype)
    out = hadamard_transform(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, (x.double() @ hadamard_matrix(384)).to(dtype))  # ≤ 1 ulp apart


def test_module_checks_its_size():
    with pytest.raises(ValueError, match="last dimension of 64"):
        HadamardTransform(128)(torch.zeros(2, 64))
    with pytest.raises(TypeError, match="floating-point"):
        hadamard_transform(torch.zeros(2, 64, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = torch.randn(4, 9, 2560)
    torch.testing.assert_close(hadamard_transform(x.cuda()).cpu(), hadamard_transform(x),
                               rtol=0, atol=5e-6)
    assert torch.equal(hadamard_matrix(768, device="cuda").cpu(), hadamard_matrix(768))
