"""w4a16_layer_step's persistent kernel (csrc/fused_decode/w4a16_layer.cu): a W4A16 Mamba1
block's whole decode step at batch 1 in one launch of 128 blocks, one an SM, for Mamba-2.8B's
sizes, a float16 model and a GPU of compute capability 9.0. Block b owns the 40 channels
40 b … 40 b + 39 of d_inner and the 20 out_proj rows 20 b … 20 b + 19; what it reads besides
in_proj's and out_proj's codes (x_proj, dt_proj, the group scales) is repacked here, once per
version of the tensors, into one contiguous row a block. Pure torch up to the kernel's call, so
that the CPU tests check the layouts (tests/ops/test_w4a16_layer.py)."""
from __future__ import annotations

import functools

import torch

from quamba.ops.constants import cached
from quamba.ops.constants import workspace as kernel_workspace
from quamba.ops.quant import fp32_value

BLOCKS = 128  # the kernel's grid: block b owns d_inner / 128 channels and d_model / 128 rows
GROUP_SIZE = 128  # the groups in which it reads the 4-bit weights


def lacks(hidden, residual, layer, conv_state, ssm_state) -> str | None:
    """Why the kernel cannot run this step (None: it can). Runs at every eager step: what depends
    on the device and the sizes is asked once, last, of a CUDA step only."""
    if hidden.shape[0] != 1:
        return f"it steps batch 1, not {hidden.shape[0]}"
    if hidden.dtype != torch.float16:
        return "it takes a float16 model"
    if not layer.residual_in_fp32:
        return "it keeps the residual in fp32 (residual_in_fp32)"
    linears = (layer.in_proj, layer.x_proj, layer.out_proj)
    if any(w.group_size != GROUP_SIZE for w in linears):
        return f"it reads the 4-bit weights in groups of {GROUP_SIZE}"
    if any(w.scales.dtype != torch.float16 for w in linears):
        return "it takes fp16 group scales"
    ssm = layer.ssm
    fp16 = [layer.norm_weight, ssm.conv_weight, ssm.dt_weight, ssm.dt_bias, conv_state]
    fp16 += [ssm.conv_bias] if ssm.conv_bias is not None else []
    if any(t.dtype != torch.float16 for t in fp16):
        return "it takes the norm, conv and dt_proj weights and the conv state in float16"
    fp32 = [ssm_state, ssm.A] + ([ssm.D] if ssm.D is not None else [])
    if any(t.dtype != torch.float32 for t in fp32):
        return "it takes an fp32 SSM state, A and D"
    read = fp16 + fp32 + [layer.in_proj.packed, layer.out_proj.packed, hidden]
    read += [residual] if residual is not None else []
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in read):
        return "it reads contiguous, 16-byte aligned activations, states and weights"
    if not hidden.is_cuda:
        return f"it runs on a CUDA device, not {hidden.device}"
    d_inner, d_state = ssm_state.shape[1:]
    return _shape_lacks(hidden.shape[-1], d_inner, d_state, ssm.dt_weight.shape[1],
                        ssm.conv_weight.shape[1], hidden.device) or None


@functools.lru_cache(maxsize=64)
def _shape_lacks(d_model, d_inner, d_state, dt_rank, width, device: torch.device) -> str:
    if not hasattr(torch.ops.quamba, "w4a16_layer_step"):
        return "this build of quamba._C has no W4A16 layer kernel (csrc/fused_decode)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.ops.quamba.w4a16_layer_step_lacks(d_model, d_inner, d_state, dt_rank, width,
                                                   index)


def small_weights(x_proj, dt_weight: torch.Tensor) -> torch.Tensor:
    """int8 [128, ·]: block b's bytes of x_proj's packed columns of its c channels (c0 = c b …)
    [n_out, c / 2], x_proj's fp16 scales of the groups of its first and last channel [n_out, 2]
    and dt_proj's fp16 rows [c, dt_rank], one bulk copy a block (17408 bytes at Mamba-2.8B's
    sizes); kept per version of x_proj's codes (its scales' and dt_proj's versions are part of
    the key)."""
    def make():
        n_out, row_bytes = x_proj.packed.shape
        channels = 2 * row_bytes // BLOCKS
        columns = x_proj.packed.reshape(n_out, BLOCKS, channels // 2).transpose(0, 1)
        first = torch.arange(BLOCKS, device=x_proj.scales.device) * channels
        groups = torch.stack([first, first + channels - 1], dim=1) // x_proj.group_size
        scales = x_proj.scales[:, groups].transpose(0, 1)  # [128, n_out, 2]
        rows = dt_weight.reshape(BLOCKS, channels, -1)
        return torch.cat([_bytes(part) for part in (columns, scales, rows)], dim=1)
    scales = x_proj.scales
    return cached(x_proj.packed, ("w4a16_layer_small", dt_weight.data_ptr(), dt_weight._version,
                                  scales.data_ptr(), scales._version), make)


def group_scales(in_proj, out_proj) -> torch.Tensor:
    """fp16 [128, ·]: block b's in_proj scales of its x rows, then of its z rows, then its
    out_proj rows' scales (2400 at Mamba-2.8B's sizes); kept per version of in_proj's scales
    (out_proj's version is part of the key)."""
    def make():
        x_rows, z_rows = in_proj.scales.chunk(2)
        parts = (x_rows, z_rows, out_proj.scales)
        return torch.cat([part.reshape(BLOCKS, -1) for part in parts], dim=1)
    out_scales = out_proj.scales
    return cached(in_proj.scales, ("w4a16_layer_groups", out_scales.data_ptr(),
                                   out_scales._version), make)


def _bytes(part: torch.Tensor) -> torch.Tensor:
    """[128, ...] → its bytes as int8 [128, ·], each block's row in ``part``'s order."""
    return part.contiguous().view(torch.int8).reshape(BLOCKS, -1)


def workspace(ssm_state: torch.Tensor) -> torch.Tensor:
    """The kernel's scratch (its grid barrier's counter, x_proj's sums, y), one per SSM state
    tensor (quamba.ops.constants.workspace)."""
    return kernel_workspace(ssm_state, "w4a16_layer_workspace_words")


def layer_step(hidden, residual, layer, conv_state, ssm_state):
    """(out [1, 1, d_model] fp16, residual_out fp32 [1, 1, d_model]) of
    :func:`quamba.ops.w4a16_decode.w4a16_layer_step` on the kernel."""
    ssm = layer.ssm
    out, residual_out = torch.ops.quamba.w4a16_layer_step(
        hidden.reshape(-1), None if residual is None else residual.reshape(-1), layer.norm_weight,
        fp32_value(float(layer.norm_eps)), layer.in_proj.packed,
        small_weights(layer.x_proj, ssm.dt_weight), layer.out_proj.packed,
        group_scales(layer.in_proj, layer.out_proj), ssm.conv_weight, ssm.conv_bias,
        conv_state[0], ssm_state[0], ssm.dt_bias, ssm.A, ssm.D, workspace(ssm_state))
    return out.view(1, 1, -1), residual_out.view(1, 1, -1)
