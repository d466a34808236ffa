"""Orthonormal Hadamard matrices and the fast Hadamard transform (the reference for the kernels).

Supported sizes: n = 2^k, 12·2^k, 20·2^k, 28·2^k and 40·2^k (k ≥ 0). Every size is written
``n = m · p`` by :func:`hadamard_factors`, with m ∈ {1, 12, 20, 28} and p = 2^k (40·2^k is
20·2^(k+1)), and

    hadamard_matrix(n) = kron(S_m, W_p) / sqrt(n)

where S_m is the ±1 base matrix of order m built below (S_1 = [[1]]) and W_p is the ±1 Sylvester
matrix in natural order, W_p[i, j] = (-1)^popcount(i & j) (symmetric). Index i of a length-n
vector is ``a · p + b`` with a < m the block and b < p the position inside the block, so

    (x @ hadamard_matrix(n)).view(m, p) = S_m.T @ (x.view(m, p) @ W_p) / sqrt(n):

a Walsh–Hadamard butterfly over each contiguous block of p, then a dense m×m product across the
blocks with the TRANSPOSE of S_m (S_12, S_20 and S_28 are not symmetric); a kernel that follows
this order reproduces ``hadamard_matrix(n)`` exactly. :func:`hadamard_sign_matrix` gives S_m.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn

_BASE_ORDERS = (12, 20, 28)
_SUPPORTED = "supported sizes are 2^k, 12·2^k, 20·2^k, 28·2^k and 40·2^k (k ≥ 0)"


def hadamard_factors(n: int) -> tuple[int, int]:
    """``(m, p)`` with n = m·p, m ∈ {1, 12, 20, 28}, p a power of two (see the module docstring);
    ValueError for any other n."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"no Hadamard matrix of size {n!r}: {_SUPPORTED}")
    power_of_two = n & -n
    odd = n // power_of_two
    if odd == 1:
        return 1, n
    if 4 * odd in _BASE_ORDERS and power_of_two >= 4:
        return 4 * odd, n // (4 * odd)
    raise ValueError(f"no Hadamard matrix of size {n}: {_SUPPORTED}")


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """Orthonormal Hadamard matrix of order n (H @ H.T = I, entries ±1/sqrt(n)); a new tensor."""
    if not dtype.is_floating_point:
        raise TypeError(f"hadamard_matrix needs a floating-point dtype, got {dtype}")
    signs = _sign_matrix(n).to(device=device, dtype=dtype)
    return signs.mul_(torch.tensor(1 / math.sqrt(n), dtype=torch.float64).to(dtype))


def hadamard_sign_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The ±1 matrix sqrt(n)·hadamard_matrix(n); a new tensor."""
    return _sign_matrix(n).to(device=device, dtype=dtype, copy=True)


@functools.lru_cache(maxsize=8)
def _sign_matrix(n: int) -> torch.Tensor:
    """kron(S_m, W_p) as int8 on the CPU (8192² int8 is 64 MiB); callers get copies."""
    m, p = hadamard_factors(n)
    with torch.inference_mode(False):  # a cached inference tensor would break later autograd use
        return torch.kron(_base_matrix(m), _sylvester(p))


def _sylvester(p: int) -> torch.Tensor:
    signs = torch.ones(1, 1, dtype=torch.int8)
    order_two = torch.tensor([[1, 1], [1, -1]], dtype=torch.int8)
    while signs.shape[0] < p:
        signs = torch.kron(order_two, signs)  # [[W, W], [W, -W]]
    return signs


def _base_matrix(m: int) -> torch.Tensor:
    if m == 1:
        return torch.ones(1, 1, dtype=torch.int8)
    if m == 28:
        return _paley_ii(13)
    return _paley_i(m - 1)


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j - i) with χ the quadratic character mod the prime q (χ(0) = 0)."""
    residues = {a * a % q for a in range(1, q)}
    character = torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)],
                             dtype=torch.int8)
    index = torch.arange(q)
    return character[(index[None, :] - index[:, None]) % q]


def _paley_i(q: int) -> torch.Tensor:
    """Order q+1 for a prime q ≡ 3 mod 4: H = I + S with S = [[0, 1ᵀ], [-1, Q]] skew-symmetric
    and S Sᵀ = q·I, so H Hᵀ = I + S + Sᵀ + S Sᵀ = (q+1)·I."""
    skew = torch.zeros(q + 1, q + 1, dtype=torch.int8)
    skew[0, 1:], skew[1:, 0], skew[1:, 1:] = 1, -1, _jacobsthal(q)
    return skew + torch.eye(q + 1, dtype=torch.int8)


def _paley_ii(q: int) -> torch.Tensor:
    """Order 2(q+1) for a prime q ≡ 1 mod 4: the conference matrix C = [[0, 1ᵀ], [1, Q]] is
    symmetric with C Cᵀ = q·I; H = C ⊗ A + I ⊗ B with A = [[1, 1], [1, -1]] and
    B = [[1, -1], [-1, -1]] (A Aᵀ = B Bᵀ = 2·I, A Bᵀ = -B Aᵀ), so H Hᵀ = 2q·I + 2·I."""
    conference = torch.zeros(q + 1, q + 1, dtype=torch.int8)
    conference[0, 1:], conference[1:, 0], conference[1:, 1:] = 1, 1, _jacobsthal(q)
    block_a = torch.tensor([[1, 1], [1, -1]], dtype=torch.int8)
    block_b = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int8)
    return torch.kron(conference, block_a) + torch.kron(torch.eye(q + 1, dtype=torch.int8), block_b)


@functools.lru_cache(maxsize=None)
def _cached_base_matrix(m: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return _base_matrix(m).to(device=device, dtype=dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard_matrix(x.shape[-1])`` in O(n log n): butterfly, then the small dense factor.

    Computed in fp32 (fp64 for fp64 input); returned in x's dtype.
    """
    if not x.is_floating_point():
        raise TypeError(f"hadamard_transform needs a floating-point tensor, got {x.dtype}")
    n = x.shape[-1]
    m, p = hadamard_factors(n)
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    blocks = _walsh_hadamard(x.to(compute_dtype).reshape(-1, m, p))
    if m > 1:
        blocks = _cached_base_matrix(m, compute_dtype, x.device).T @ blocks
    return (blocks * (1 / math.sqrt(n))).reshape(x.shape).to(x.dtype)


def _walsh_hadamard(blocks: torch.Tensor) -> torch.Tensor:
    """blocks @ W_p over the last dim (unnormalised), one butterfly stage per power of two."""
    lead, p = blocks.shape[:-1], blocks.shape[-1]
    half = 1
    while half < p:
        pairs = blocks.reshape(*lead, p // (2 * half), 2, half)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        blocks = torch.stack((first + second, first - second), dim=-2).reshape(*lead, p)
        half *= 2
    return blocks


class HadamardTransform(nn.Module):
    """``x ↦ x @ hadamard_matrix(n)`` over the last dim (the online rotation of y)."""

    def __init__(self, n: int):
        super().__init__()
        hadamard_factors(n)
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.n:
            raise ValueError(f"HadamardTransform({self.n}) got a last dimension of {x.shape[-1]}")
        return hadamard_transform(x)

    def extra_repr(self) -> str:
        return f"n={self.n}"
