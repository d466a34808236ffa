"""Online Hadamard transform fused with int8 quantization (the out_proj input), for Mamba2 with
its gated RMSNorm before it."""
from __future__ import annotations

import functools

import torch

from quamba.ops import backend
from quamba.ops.norm.gated_norm import gated_rms_norm
from quamba.ops.norm.hadamard import hadamard_transform
from quamba.ops.quant import quantize

# csrc/norm/hadamard_quant.cu: a block transforms a row in shared memory (max_shared_floats: the
# device's opt-in shared memory a block, in floats) and gates it in at most kMaxGateGroups groups
KERNEL_MAX_GATE_GROUPS = 64


def kernel_lacks(n: int, shared_floats: int, groups: int = 1) -> str | None:
    """Why the Hadamard kernel cannot take rows of n values (gated in ``groups`` RMSNorm groups)
    on a device whose blocks hold ``shared_floats`` floats; None where it can."""
    if n > shared_floats:
        return f"its kernel holds a row of up to {shared_floats} values in shared memory, not {n}"
    if groups > KERNEL_MAX_GATE_GROUPS:
        return f"its kernel gates a row in up to {KERNEL_MAX_GATE_GROUPS} groups, not {groups}"
    return None


def lacks_on(device: torch.device, n: int, groups: int = 1) -> str | None:
    """:func:`kernel_lacks` on ``device`` (None off a GPU, where no kernel runs)."""
    return kernel_lacks(n, _shared_floats(device), groups) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _shared_floats(device: torch.device) -> int:
    """The floats a block of ``device`` holds in shared memory (asked once per device)."""
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin // 4


def hadamard_quant(x, out_scale, backend_name=None):
    """x: [..., n] float, n a supported Hadamard size (quamba.ops.norm.hadamard). Returns int8
    ``quantize(x @ hadamard_matrix(n), out_scale)`` [..., n], the transform in fp32. int8 outputs
    agree across backends to one step (fp32 summation order differs)."""
    impl = backend.select("hadamard_quant", x.device, backend_name,
                          cuda_lacks=lacks_on(x.device, x.shape[-1]))
    return impl(x, out_scale)


@backend.register("hadamard_quant", "torch")
def _hadamard_quant_torch(x, out_scale):
    return quantize(hadamard_transform(x.float()), out_scale)


def gated_norm_hadamard_quant(y, z, z_scale, weight, group_size: int, eps: float, out_scale,
                              backend_name=None):
    """Mamba2's gated RMSNorm, then the Hadamard transform and int8 (the Quamba2 out_proj input)
    in one op: ``hadamard_quant(gated_rms_norm(y, z, weight, group_size, eps, z_scale,
    out_dtype=float32), out_scale)``, with z int8 codes of ``z_scale``. int8 outputs agree with
    that chain to one step."""
    if z.dtype != torch.int8 or y.shape != z.shape:
        raise ValueError(f"gated_norm_hadamard_quant: z must be int8 codes of y's shape "
                         f"{tuple(y.shape)}, got {z.dtype} {tuple(z.shape)}")
    impl = backend.select("gated_norm_hadamard_quant", y.device, backend_name,
                          cuda_lacks=lacks_on(y.device, y.shape[-1], y.shape[-1] // group_size))
    return impl(y, z, z_scale, weight, group_size, eps, out_scale)


@backend.register("gated_norm_hadamard_quant", "torch")
def _gated_norm_hadamard_quant_torch(y, z, z_scale, weight, group_size, eps, out_scale):
    normed = gated_rms_norm(y, z, weight, group_size, eps, z_scale, torch.float32,
                            backend_name="torch")
    return _hadamard_quant_torch(normed, out_scale)
