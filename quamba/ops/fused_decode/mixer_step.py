"""One decode step of a quantized Mamba1 mixer's SSM side as one op: ``qmixer_ssm_step``.

The step between in_proj and out_proj in the int8 mode, zoh discretization:

    x (int8) ─ conv state update + conv + SiLU → u (int8)
    u ─ x_proj (W8A8, or W4A8 4-bit) → dt_low, B, C (int8, one scale)
    dt_low ─ dt_proj (W8A8) → dt (int8)
    QSScan step (u, dt, B, C, z; SSM state int8 or fp32, in place) → y (fp16/bf16/fp32)

Its torch reference is exactly that chain of the reference ops (qconv1d_update, w8a8_linear or
w4a8_linear, w8a8_linear, qsscan_update), so the mixer computes the same numbers through it as
through the separate ops. Its cuda backend is one CUDA kernel, a thread-block cluster a batch row
(quamba.ops.fused_decode.mixer_step_cuda), where that applies (a W8A8 x_proj, compute capability
9.0), else two Triton kernels (quamba.ops.fused_decode.mixer_step_triton), instead of the chain's
four CUDA kernels and their launches: on a GPU the decode step is mostly fixed per-kernel time. The
other SSM modes and discretizations keep the separate ops (the mixer chooses); what the kernels lack
(a per-channel W8A8 weight scale, an out-of-range d_state) runs the reference under ``auto`` and is
a BackendError under ``cuda``.
"""
from __future__ import annotations

import functools
import logging

import torch

from quamba.ops import backend
from quamba.ops.conv.qconv1d import kernel_lacks as conv_kernel_lacks
from quamba.ops.conv.qconv1d import qconv1d_update
from quamba.ops.fused_decode.weights import ConvWeights, StepScales, W4A8Weight, W8A8Weight
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.ops.linear.qlinear4 import kernel_lacks as w4_kernel_lacks
from quamba.ops.linear.qlinear4 import w4a8_linear
from quamba.ops.scan.qsscan import SSMParams, qsscan_update, step_kernel_lacks

log = logging.getLogger("quamba")

OP = "qmixer_ssm_step"
KERNEL_MAX_D_STATE = 256  # the scan kernel keeps a block's [rows, channels, d_state] state tile
KERNEL_WIDTHS = (2, 3, 4)  # conv widths the kernel's window of 4 taps holds


def qmixer_ssm_step(x, z, conv_state, ssm_state, conv: ConvWeights, x_proj, dt_proj: W8A8Weight,
                    params: SSMParams, scales: StepScales, out_dtype=torch.float16,
                    backend_name=None):
    """y [batch, d_inner] in ``out_dtype`` of one decode step; the states updated in place.

    x, z: int8 [batch, d_inner] (in_proj's output codes; any strides); conv_state: contiguous int8
    [batch, d_inner, width - 1]; ssm_state: contiguous int8 (codes of ``scales.state``) or fp32
    [batch, d_inner, d_state]; x_proj: W8A8Weight or W4A8Weight [dt_rank + 2 d_state, d_inner];
    dt_proj: W8A8Weight [d_inner, dt_rank]. The arithmetic is the chain's (module docstring): the
    integer outputs (u, x_proj's and dt_proj's codes, an int8 state) agree across backends to one
    int8 step (exp and log1p differ by an ulp between libraries), y to the scan's tolerance. On a
    GPU the kernels and the chain of CUDA ops (the unfused step) agree bit for bit, y included.
    """
    _check(x, z, conv_state, ssm_state, conv, x_proj, dt_proj)
    impl = backend.select(OP, x.device, backend_name,
                          cuda_lacks=_kernel_lacks(conv, x_proj, dt_proj, conv_state, ssm_state))
    return impl(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales, out_dtype)


def _check(x, z, conv_state, ssm_state, conv, x_proj, dt_proj) -> None:
    """ValueError for inputs outside the op's scope, on every backend."""
    if x.dtype != torch.int8 or z.dtype != torch.int8 or x.dim() != 2 or z.shape != x.shape:
        raise ValueError(f"{OP}: x and z must be int8 [batch, d_inner] codes, got {x.dtype} "
                         f"{tuple(x.shape)} and {z.dtype} {tuple(z.shape)}")
    batch, d_inner = x.shape
    width = conv.weight.shape[1]
    if conv_state.dtype != torch.int8 or conv_state.shape != (batch, d_inner, width - 1):
        raise ValueError(f"{OP}: conv_state must be int8 [batch, d_inner, width - 1], got "
                         f"{conv_state.dtype} {tuple(conv_state.shape)}")
    if (ssm_state.dtype not in (torch.int8, torch.float32) or ssm_state.dim() != 3
            or ssm_state.shape[:2] != x.shape):
        raise ValueError(f"{OP}: ssm_state must be int8 or fp32 [batch, d_inner, d_state], got "
                         f"{ssm_state.dtype} {tuple(ssm_state.shape)}")
    if not isinstance(x_proj, (W8A8Weight, W4A8Weight)) or not isinstance(dt_proj, W8A8Weight):
        raise ValueError(f"{OP}: x_proj must be a W8A8Weight or W4A8Weight and dt_proj a "
                         f"W8A8Weight, got {type(x_proj).__name__} and {type(dt_proj).__name__}")
    if conv.weight.shape[0] != d_inner or dt_proj.weight.shape[0] != d_inner:
        raise ValueError(f"{OP}: the conv weight {tuple(conv.weight.shape)} and dt_proj "
                         f"{tuple(dt_proj.weight.shape)} must have d_inner = {d_inner} rows")
    dt_rank = dt_proj.weight.shape[1]
    if _x_proj_shape(x_proj) != (dt_rank + 2 * ssm_state.shape[2], d_inner):
        raise ValueError(f"{OP}: x_proj {_x_proj_shape(x_proj)} does not map d_inner {d_inner} to "
                         f"dt_rank + 2 d_state = {dt_rank + 2 * ssm_state.shape[2]}")


def _x_proj_shape(x_proj) -> tuple[int, int]:
    """(out, in) features of an x_proj weight."""
    if isinstance(x_proj, W4A8Weight):
        return x_proj.packed.shape[0], x_proj.packed.shape[1] * 2
    return tuple(x_proj.weight.shape)


def _kernel_lacks(conv, x_proj, dt_proj, conv_state, ssm_state) -> str | None:
    """Why the kernels cannot run this step (None: they can)."""
    if not (conv_state.is_contiguous() and ssm_state.is_contiguous()):
        return "its kernels need contiguous conv and SSM states"
    if ssm_state.shape[2] > KERNEL_MAX_D_STATE:
        return f"its kernel takes d_state up to {KERNEL_MAX_D_STATE}, not {ssm_state.shape[2]}"
    if conv.weight.shape[1] not in KERNEL_WIDTHS:
        return f"its kernel takes conv widths {KERNEL_WIDTHS}, not {conv.weight.shape[1]}"
    scales = [x_proj.in_scale, x_proj.out_scale, dt_proj.in_scale, dt_proj.out_scale,
              dt_proj.weight_scale]
    if isinstance(x_proj, W8A8Weight):
        scales.append(x_proj.weight_scale)
    if any(isinstance(s, torch.Tensor) for s in scales):
        return "its kernels take per-tensor activation and W8A8 weight scales (floats)"
    return None


def project(linear: W8A8Weight | W4A8Weight, x, out_dtype=torch.float16,
            backend_name=None) -> torch.Tensor:
    """``linear`` applied to int8 codes x [batch, K], as the quantized linear layer runs it: int8
    codes [batch, N] where it has an output scale (x_proj's), else ``out_dtype``."""
    if isinstance(linear, W4A8Weight):
        return w4a8_linear(x.contiguous(), linear.in_scale, linear.packed, linear.group_multiplier,
                           linear.channel_scale, linear.group_size, linear.out_scale,
                           out_dtype=out_dtype, backend_name=backend_name)
    return w8a8_linear(x, linear.in_scale, linear.weight, linear.weight_scale, linear.out_scale,
                       out_dtype=out_dtype, backend_name=backend_name)


def linear_lacks(linear: W8A8Weight | W4A8Weight) -> str | None:
    """What quamba's linear kernels lack for ``linear`` (the 4-bit ones' limits; W8A8's take
    any shape); None: nothing."""
    if isinstance(linear, W4A8Weight):
        return w4_kernel_lacks(linear.packed, linear.group_size)
    return None


def chain_lacks(conv: ConvWeights, x_proj, ssm_state) -> str | None:
    """What the CUDA kernels of :func:`chain_step`'s ops lack for this step (None: nothing)."""
    batch, d_inner, d_state = ssm_state.shape
    return (conv_kernel_lacks((batch, d_inner), conv.weight.shape[1]) or linear_lacks(x_proj)
            or step_kernel_lacks(d_state, batch, d_inner, None))


def chain_step(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales,
               out_dtype=torch.float16, backend_name=None):
    """The step as the chain of separate ops (the op's torch backend runs it on their torch
    references; the unfused decode step runs it on ``backend_name``'s): (y, u codes, x_proj's
    codes, dt codes), the states stepped in place."""
    u = qconv1d_update(x, conv_state, scales.xz, conv.weight, conv.weight_scale, conv.bias,
                       conv.bias_scale, out_scale=scales.u, backend_name=backend_name)
    x_dbl = project(x_proj, u, backend_name=backend_name)
    d_state = ssm_state.shape[2]
    dt_low, B, C = torch.split(x_dbl, [dt_proj.weight.shape[1], d_state, d_state], dim=-1)
    dt = w8a8_linear(dt_low, dt_proj.in_scale, dt_proj.weight, dt_proj.weight_scale,
                     dt_proj.out_scale, backend_name=backend_name)
    y = qsscan_update(ssm_state, scales.state, u, scales.u, dt, scales.dt, B, scales.xdbl, C,
                      scales.xdbl, z, scales.xz, params, out_dtype=out_dtype,
                      backend_name=backend_name)
    return y, u, x_dbl, dt


@backend.register(OP, "torch")
def _qmixer_ssm_step_torch(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales,
                           out_dtype):
    return chain_step(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales,
                      out_dtype, backend_name="torch")[0]


@backend.register(OP, "cuda", kernels=())
def _qmixer_ssm_step_cuda(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales,
                          out_dtype):
    cluster_lacks = backend.cuda_extension_error()
    if cluster_lacks is None:
        from quamba.ops.fused_decode import mixer_step_cuda
        cluster_lacks = mixer_step_cuda.lacks(x, conv, x_proj, dt_proj, ssm_state)
        if cluster_lacks is None:
            return mixer_step_cuda.ssm_step(x, z, conv_state, ssm_state, conv, x_proj, dt_proj,
                                            params, scales, out_dtype)
    _log_triton_step(cluster_lacks)
    from quamba.ops.fused_decode import mixer_step_triton
    return mixer_step_triton.ssm_step(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params,
                                        scales, out_dtype)


@functools.lru_cache(maxsize=None)
def _log_triton_step(why: str) -> None:
    """Says once per reason that the step runs the two Triton kernels, not the cluster kernel."""
    log.info("%s runs its two Triton kernels, not the cluster kernel: %s", OP, why)
