"""qmamba_layer_step's persistent kernel (csrc/fused_decode/layer_step.cu): a W8A8 Mamba1 block's
whole decode step at batch 1 in one launch of 128 blocks, one an SM, for Mamba-2.8B's sizes on a
GPU of compute capability 9.0. Every fp32 constant it applies is computed here by the functions
the chain's own launchers use (quamba.ops.quant, quamba.ops.cuda_backend.ssm), so that its
outputs equal the chain of CUDA kernels' bit for bit."""
from __future__ import annotations

import functools

import torch
from torch.utils.weak import WeakIdKeyDictionary

from quamba.ops.constants import cached, keeps_constants
from quamba.ops.cuda_backend.ssm import _hadamard_plan
from quamba.ops.quant import fp32_multiplier, fp32_reciprocal, fp32_value

BLOCKS = 128  # the kernel's grid: block b owns d_inner / 128 channels
_WORKSPACES = WeakIdKeyDictionary()


def lacks(hidden, residual, layer, conv_state, ssm_state) -> str | None:
    """Why the kernel cannot run this step (None: it can). Runs at every eager step: what depends
    only on the sizes and the device is asked once."""
    if hidden.shape[0] != 1:
        return f"it steps batch 1, not {hidden.shape[0]}"
    if hidden.dtype != torch.float16 or layer.out_dtype != torch.float16:
        return "it takes a float16 model"
    linears = (layer.in_proj, layer.x_proj, layer.dt_proj, layer.out_proj)
    if any(not isinstance(s, float) for w in linears for s in (w.in_scale, w.weight_scale)):
        return "it takes per-tensor weight and activation scales"
    if not all(isinstance(w.out_scale, float) for w in linears[:3]):
        return "it takes per-tensor output scales"
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


def workspace(ssm_state: torch.Tensor) -> torch.Tensor:
    """The kernel's scratch (its grid barrier's counter, x_proj's sums, y), one per SSM state
    tensor, so per layer and cache: zero when made, left zero by every launch but the counter,
    which only grows. One made during a CUDA-graph capture is not kept (its zeroing runs at every
    replay)."""
    scratch = _WORKSPACES.get(ssm_state)
    if scratch is None:
        words = torch.ops.quamba.qmamba_layer_workspace_words()
        scratch = torch.zeros(words, dtype=torch.int32, device=ssm_state.device)
        if keeps_constants(ssm_state.device):
            _WORKSPACES[ssm_state] = scratch
    return scratch


def layer_step(hidden, residual, layer, conv_state, ssm_state):
    """(out [1, 1, d_model] fp16, residual_out fp32 [1, 1, d_model]) of
    :func:`quamba.ops.fused_layer.qmamba_layer_step` on the kernel."""
    s, conv = layer.scales, layer.conv
    in_proj, x_proj, dt_proj, out_proj = layer.in_proj, layer.x_proj, layer.dt_proj, layer.out_proj
    params = layer.params
    d_inner = ssm_state.shape[1]
    _, _, _, y_norm = _hadamard_plan(d_inner)
    out, residual_out = torch.ops.quamba.qmamba_layer_step(
        hidden.reshape(-1), None if residual is None else residual.reshape(-1), in_proj.weight,
        fp32_multiplier(in_proj.in_scale, in_proj.weight_scale, in_proj.out_scale),
        small_weights(x_proj.weight, dt_proj.weight), out_proj.weight,
        fp32_multiplier(out_proj.in_scale, out_proj.weight_scale, None), conv.weight, conv.bias,
        fp32_multiplier(s.xz, conv.weight_scale), float(conv.bias_scale), fp32_reciprocal(float(s.u)),
        conv_state[0], ssm_state[0], float(s.state),
        fp32_multiplier(x_proj.in_scale, x_proj.weight_scale, x_proj.out_scale),
        fp32_multiplier(dt_proj.in_scale, dt_proj.weight_scale, dt_proj.out_scale),
        float(s.u), float(s.xdbl), float(s.dt), float(s.xz), params.A_log, float(params.A_log_scale),
        params.D, float(params.D_scale), params.dt_bias, float(params.dt_bias_scale),
        fp32_value(float(layer.norm_eps)), fp32_reciprocal(float(layer.h_scale)), y_norm,
        fp32_reciprocal(float(layer.y_scale)), workspace(ssm_state))
    return out.view(1, 1, -1), residual_out.view(1, 1, -1)
