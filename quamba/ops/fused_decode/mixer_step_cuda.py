"""qmixer_ssm_step's cluster kernel (csrc/fused_decode/mixer_step.cu): the whole SSM side of a
Mamba1 mixer's decode step in one CUDA kernel, one thread-block cluster a batch row, for a W8A8
x_proj. Where it cannot run (a W4A8 x_proj, sizes its shared memory does not hold, a GPU before
compute capability 9.0), the op's cuda backend runs the two Triton kernels
(quamba.ops.fused_decode.mixer_step_triton) instead; both compute the chain's numbers bit for
bit."""
from __future__ import annotations

import functools

import torch

from quamba.ops.fused_decode.weights import W8A8Weight
from quamba.ops.quant import fp32_multiplier, fp32_reciprocal


def lacks(x, conv, x_proj, dt_proj, ssm_state) -> str | None:
    """Why the cluster kernel cannot run this step (None: it can). Runs at every eager step: what
    depends only on the build and the device is asked once."""
    why = _device_lacks(x.device)
    if why:
        return why
    if not isinstance(x_proj, W8A8Weight):
        return "it takes a W8A8 x_proj"
    weights = (x_proj.weight, dt_proj.weight)
    if not all(w.is_contiguous() and w.data_ptr() % 16 == 0 for w in weights):
        return "it reads contiguous, 16-byte aligned x_proj and dt_proj weights"
    return _shape_lacks(x.shape[1], dt_proj.weight.shape[1], ssm_state.shape[2]) or None


@functools.lru_cache(maxsize=None)
def _device_lacks(device: torch.device) -> str:
    if not hasattr(torch.ops.quamba, "qmixer_ssm_step"):
        return "this build of quamba._C has no cluster kernel (csrc/fused_decode)"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "its thread-block clusters need compute capability 9.0"
    return ""


@functools.lru_cache(maxsize=64)
def _shape_lacks(d_inner: int, dt_rank: int, d_state: int) -> str:
    return torch.ops.quamba.qmixer_ssm_step_lacks(d_inner, dt_rank, d_state)


def ssm_step(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales, out_dtype,
             codes=(None, None, None)):
    """y [batch, d_inner] of :func:`quamba.ops.fused_decode.mixer_step.qmixer_ssm_step` on the
    cluster kernel; ``codes``: int8 tensors that receive the step's u, x_proj and dt codes, or
    None."""
    int8_state = ssm_state.dtype == torch.int8
    return torch.ops.quamba.qmixer_ssm_step(
        x, z, float(scales.xz), conv_state, ssm_state, float(scales.state) if int8_state else 1.0,
        conv.weight.contiguous(), conv.bias, fp32_multiplier(scales.xz, conv.weight_scale),
        float(conv.bias_scale), fp32_reciprocal(float(scales.u)), x_proj.weight,
        fp32_multiplier(x_proj.in_scale, x_proj.weight_scale, x_proj.out_scale), dt_proj.weight,
        fp32_multiplier(dt_proj.in_scale, dt_proj.weight_scale, dt_proj.out_scale),
        float(scales.u), float(scales.xdbl), float(scales.dt), params.A_log,
        float(params.A_log_scale), params.D, float(params.D_scale), params.dt_bias,
        float(params.dt_bias_scale), out_dtype, *codes)
