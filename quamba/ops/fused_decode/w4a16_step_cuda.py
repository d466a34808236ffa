"""w4a16_ssm_step's cluster kernel (csrc/fused_decode/w4a16_step.cu): the SSM side of a
weight-only Mamba1 mixer's decode step in one CUDA kernel, one thread-block cluster a batch row.
Where it cannot run (a float32 model, sizes its shared memory does not hold, a GPU before
compute capability 9.0), the op's cuda backend runs the chain of CUDA ops instead."""
from __future__ import annotations

import functools

import torch

HALF_TYPES = (torch.float16, torch.bfloat16)


def lacks(x, z, conv_state, ssm_state, x_proj, weights) -> str | None:
    """Why the kernel cannot run this step (None: it can). Runs at every eager step: what depends
    only on the build, the device and the sizes is asked once."""
    why = _device_lacks(x.device)
    if why:
        return why
    if x.dtype not in HALF_TYPES:
        return f"it takes float16 or bfloat16 activations, not {x.dtype}"
    same_dtype = [conv_state, weights.conv_weight, weights.dt_weight, weights.dt_bias]
    same_dtype += [t for t in (z, weights.conv_bias) if t is not None]
    if any(t.dtype != x.dtype for t in same_dtype):
        return ("it takes the conv state, conv weight and bias, dt_proj and z in the activations' "
                "dtype")
    fp32 = [ssm_state, weights.A] + ([weights.D] if weights.D is not None else [])
    if any(t.dtype != torch.float32 for t in fp32):
        return "it takes an fp32 SSM state, A and D"
    contiguous = fp32 + same_dtype[:4] + [x_proj.packed, x_proj.scales]
    if weights.conv_bias is not None:
        contiguous.append(weights.conv_bias)
    if not all(t.is_contiguous() for t in contiguous):
        return "it reads contiguous states, weights and parameters"
    if x_proj.packed.data_ptr() % 16 or weights.dt_weight.data_ptr() % 16:
        return "it reads x_proj and dt_proj from 16-byte aligned addresses"
    if x_proj.scales.dtype != torch.float16:
        return "it takes x_proj's fp16 group scales"
    return _shape_lacks(x.shape[1], weights.dt_weight.shape[1], ssm_state.shape[2],
                        x_proj.group_size, x.element_size()) or None


@functools.lru_cache(maxsize=None)
def _device_lacks(device: torch.device) -> str:
    if not hasattr(torch.ops.quamba, "w4a16_ssm_step"):
        return "this build of quamba._C has no W4A16 step kernel (csrc/fused_decode)"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "its thread-block clusters need compute capability 9.0"
    return ""


@functools.lru_cache(maxsize=64)
def _shape_lacks(d_inner: int, dt_rank: int, d_state: int, group_size: int,
                 element_bytes: int) -> str:
    return torch.ops.quamba.w4a16_ssm_step_lacks(d_inner, dt_rank, d_state, group_size,
                                                 element_bytes)


def ssm_step(x, z, conv_state, ssm_state, x_proj, weights):
    """y [batch, d_inner] of :func:`quamba.ops.w4a16_decode.w4a16_ssm_step` on the kernel."""
    return torch.ops.quamba.w4a16_ssm_step(
        x, z, conv_state, ssm_state, weights.conv_weight, weights.conv_bias, x_proj.packed,
        x_proj.scales, x_proj.group_size, weights.dt_weight, weights.dt_bias, weights.A,
        weights.D)
