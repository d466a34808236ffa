"""qmamba_layer_step's persistent kernel (csrc/fused_decode/layer_step.cu): a W8A8 or W4A8 Mamba1
block's whole decode step at batch 1 in one launch of 128 blocks, one an SM, for Mamba-2.8B's
sizes on a GPU of compute capability 9.0. Every fp32 constant it applies is computed here by the
functions the chain's own launchers use (quamba.ops.quant, quamba.ops.norm.cuda and
quamba.ops.linear.cuda), so that its outputs equal the chain of CUDA kernels' bit for bit."""
from __future__ import annotations

import functools

import torch

from quamba.ops.constants import cached
from quamba.ops.constants import workspace as kernel_workspace
from quamba.ops.fused_decode.weights import W4A8Weight
from quamba.ops.linear.cuda import _epilogue_multiplier
from quamba.ops.norm.cuda import _hadamard_plan
from quamba.ops.quant import fp32_multiplier, fp32_reciprocal, fp32_value
from quamba.ops.quant4 import expand_groups, unpack_int4

BLOCKS = 128  # the kernel's grid: block b owns d_inner / 128 channels
GROUP_SIZE = 128  # the groups in which it reads W4A8's in_proj and out_proj


def lacks(hidden, residual, layer, conv_state, ssm_state) -> str | None:
    """Why the kernel cannot run this step (None: it can). Runs at every eager step: what depends
    only on the sizes and the device is asked once."""
    if hidden.shape[0] != 1:
        return f"it steps batch 1, not {hidden.shape[0]}"
    if hidden.dtype != torch.float16 or layer.out_dtype != torch.float16:
        return "it takes a float16 model"
    in_proj, x_proj, dt_proj, out_proj = layer.in_proj, layer.x_proj, layer.dt_proj, layer.out_proj
    linears = (in_proj, x_proj, dt_proj, out_proj)
    if type(in_proj) is not type(out_proj):
        return "it takes in_proj and out_proj of one precision"
    per_tensor = [w.in_scale for w in linears]
    per_tensor += [w.weight_scale for w in linears if not isinstance(w, W4A8Weight)]
    if not all(isinstance(scale, float) for scale in per_tensor):
        return "it takes per-tensor activation scales and W8A8 weight scales"
    if not all(isinstance(w.out_scale, float) for w in (in_proj, x_proj, dt_proj)):
        return "it takes per-tensor output scales"
    if isinstance(in_proj, W4A8Weight) and {in_proj.group_size, out_proj.group_size} != {GROUP_SIZE}:
        return f"it reads 4-bit in_proj and out_proj in groups of {GROUP_SIZE}"
    if isinstance(x_proj, W4A8Weight) and x_proj_products(x_proj) is None:
        return "its 4-bit x_proj's codes times their group multipliers exceed int8"
    if not (conv_state.is_contiguous() and ssm_state.is_contiguous()):
        return "it steps contiguous conv and SSM states"
    d_inner, d_state = ssm_state.shape[1:]
    return _shape_lacks(hidden.shape[-1], d_inner, d_state, layer.dt_proj.weight.shape[1],
                        layer.conv.weight.shape[1], hidden.device) or None


@functools.lru_cache(maxsize=64)
def _shape_lacks(d_model, d_inner, d_state, dt_rank, width, device: torch.device) -> str:
    if not hasattr(torch.ops.quamba, "qmamba_layer_step"):
        return "this build of quamba._C has no layer kernel (csrc/fused_decode)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.ops.quamba.qmamba_layer_step_lacks(d_model, d_inner, d_state, dt_rank, width, index)


def small_weights(x_proj: torch.Tensor, dt_proj: torch.Tensor) -> torch.Tensor:
    """[128, n_out · c + c · dt_rank] int8, c = d_inner / 128: block b's columns of x_proj
    [n_out, c] and its rows of dt_proj [c, dt_rank], one bulk copy a block; kept per version of
    x_proj (dt_proj's version is part of the key)."""
    def make():
        n_out, d_inner = x_proj.shape
        columns = x_proj.view(n_out, BLOCKS, d_inner // BLOCKS).permute(1, 0, 2).reshape(BLOCKS, -1)
        return torch.cat([columns, dt_proj.reshape(BLOCKS, -1)], dim=1).contiguous()
    return cached(x_proj, ("layer_step_small", dt_proj.data_ptr(), dt_proj._version), make)


def x_proj_products(x_proj: W4A8Weight) -> torch.Tensor | None:
    """A W4A8 x_proj's weights code · group multiplier as int8 [n_out, d_inner] (its int32 sums
    are the W4A8 GEMV's), or None where one exceeds int8 (multipliers above 18, from checkpoints
    written before their cap); kept per version of the packed codes."""
    def make():
        weight = unpack_int4(x_proj.packed).int() * expand_groups(x_proj.group_multiplier.int(),
                                                                  x_proj.group_size)
        return weight.to(torch.int8) if int(weight.abs().max()) <= 127 else None
    multiplier = x_proj.group_multiplier
    return cached(x_proj.packed, ("layer_step_x_proj", multiplier.data_ptr(), multiplier._version,
                                  x_proj.group_size), make)


def group_multipliers(in_proj: W4A8Weight, out_proj: W4A8Weight) -> torch.Tensor:
    """[128, 2400] int8: block b's in_proj rows' multipliers (x rows, then z rows) and its
    out_proj rows', as its shared memory holds them; kept per version of in_proj's."""
    def make():
        x_rows, z_rows = in_proj.group_multiplier.chunk(2)
        parts = (x_rows, z_rows, out_proj.group_multiplier)
        return torch.cat([part.reshape(BLOCKS, -1) for part in parts], dim=1).contiguous()
    out_groups = out_proj.group_multiplier
    return cached(in_proj.group_multiplier, ("layer_step_groups", out_groups.data_ptr(),
                                             out_groups._version), make)


def _multipliers(linear) -> tuple[float, torch.Tensor | None]:
    """A linear's epilogue multiplier as the chain's GEMV takes it: (the scalar, None), or (0.0,
    fp32 [N]) per channel (W4A8's channel scales)."""
    if isinstance(linear, W4A8Weight):
        return _epilogue_multiplier(linear.in_scale, linear.channel_scale, linear.out_scale,
                                    linear.packed)
    return fp32_multiplier(linear.in_scale, linear.weight_scale, linear.out_scale), None


def workspace(ssm_state: torch.Tensor) -> torch.Tensor:
    """The kernel's scratch (its grid barrier's counter, x_proj's sums, y), one per SSM state
    tensor (quamba.ops.constants.workspace): left zero by every launch but the counter, which only
    grows."""
    return kernel_workspace(ssm_state, "qmamba_layer_workspace_words")


def layer_step(hidden, residual, layer, conv_state, ssm_state):
    """(out [1, 1, d_model] fp16, residual_out fp32 [1, 1, d_model]) of
    :func:`quamba.ops.fused_decode.layer_step.qmamba_layer_step` on the kernel."""
    s, conv, params = layer.scales, layer.conv, layer.params
    in_proj, x_proj, dt_proj, out_proj = layer.in_proj, layer.x_proj, layer.dt_proj, layer.out_proj
    w4 = isinstance(in_proj, W4A8Weight)
    in_multiplier, in_multipliers = _multipliers(in_proj)
    x_multiplier, x_multipliers = _multipliers(x_proj)
    out_multiplier, out_multipliers = _multipliers(out_proj)
    x_weight = x_proj_products(x_proj) if isinstance(x_proj, W4A8Weight) else x_proj.weight
    _, _, _, y_norm = _hadamard_plan(ssm_state.shape[1])
    out, residual_out = torch.ops.quamba.qmamba_layer_step(
        hidden.reshape(-1), None if residual is None else residual.reshape(-1),
        in_proj.packed if w4 else in_proj.weight, in_multiplier,
        small_weights(x_weight, dt_proj.weight), out_proj.packed if w4 else out_proj.weight,
        out_multiplier, conv.weight, conv.bias, fp32_multiplier(s.xz, conv.weight_scale),
        float(conv.bias_scale), fp32_reciprocal(float(s.u)), conv_state[0], ssm_state[0],
        float(s.state), x_multiplier, fp32_multiplier(dt_proj.in_scale, dt_proj.weight_scale,
                                                      dt_proj.out_scale),
        float(s.u), float(s.xdbl), float(s.dt), float(s.xz), params.A_log, float(params.A_log_scale),
        params.D, float(params.D_scale), params.dt_bias, float(params.dt_bias_scale),
        fp32_value(float(layer.norm_eps)), fp32_reciprocal(float(layer.h_scale)), y_norm,
        fp32_reciprocal(float(layer.y_scale)), group_multipliers(in_proj, out_proj) if w4 else None,
        in_multipliers, x_multipliers, out_multipliers, workspace(ssm_state))
    return out.view(1, 1, -1), residual_out.view(1, 1, -1)
