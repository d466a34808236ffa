"""RMSNorm → int8 and Hadamard → int8 on the kernels of ``quamba._C`` (csrc/norm):
``rmsnorm_quant``, ``hadamard_quant`` and Mamba2's ``gated_norm_hadamard_quant`` (the gated
RMSNorm fused into the Hadamard kernel's load), with the torch references' signatures.

Every fp32 constant a kernel applies (the reciprocal of an output scale, 1/sqrt(n)) is computed
here by the functions of :mod:`quamba.ops.quant` that the references use. The kernels take rows: a
non-contiguous input is copied once by ``.contiguous()`` (the modules never pass one).
"""
from __future__ import annotations

import functools
import math

import torch

import quamba._C  # noqa: F401  loads torch.ops.quamba.*
from quamba.ops import backend
from quamba.ops.constants import cached, scale_float
from quamba.ops.norm.hadamard import hadamard_factors, hadamard_sign_matrix
from quamba.ops.quant import fp32_reciprocal, fp32_value


@backend.register("rmsnorm_quant", "cuda")
def _rmsnorm_quant_cuda(x, residual, weight, eps, out_scale, residual_in_fp32):
    residual = None if residual is None else residual.contiguous()
    weight = None if weight is None else weight.contiguous()
    return torch.ops.quamba.rmsnorm_quant(x.contiguous(), residual, weight, fp32_value(float(eps)),
                                          fp32_reciprocal(scale_float(out_scale)), residual_in_fp32)


@functools.lru_cache(maxsize=None)
def _hadamard_plan(n: int) -> tuple[int, int, list[int], float]:
    """(m, p, column sign masks of S_m, fp32 1/sqrt(n)) for size n."""
    m, p = hadamard_factors(n)
    negative = hadamard_sign_matrix(m, dtype=torch.int8) < 0  # [c, a]
    masks = [sum(1 << c for c in range(m) if negative[c, a]) for a in range(m)]
    return m, p, masks, fp32_value(1 / math.sqrt(n))


@backend.register("hadamard_quant", "cuda")
def _hadamard_quant_cuda(x, out_scale):
    m, p, masks, norm = _hadamard_plan(x.shape[-1])
    return torch.ops.quamba.hadamard_quant(x.contiguous(), m, p, masks, norm,
                                           fp32_reciprocal(scale_float(out_scale)))


@backend.register("gated_norm_hadamard_quant", "cuda", kernels=("hadamard_quant",))
def _gated_norm_hadamard_quant_cuda(y, z, z_scale, weight, group_size, eps, out_scale):
    m, p, masks, norm = _hadamard_plan(y.shape[-1])
    if weight is not None:
        weight = cached(weight, ("fp32", y.device),
                        lambda: weight.to(device=y.device, dtype=torch.float32).contiguous())
    return torch.ops.quamba.hadamard_quant(y.contiguous(), m, p, masks, norm,
                                           fp32_reciprocal(scale_float(out_scale)), z,
                                           fp32_value(scale_float(z_scale)), weight, group_size,
                                           eps)
