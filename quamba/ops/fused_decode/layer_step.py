"""A W8A8 or W4A8 Mamba1 block's whole decode step as one op: ``qmamba_layer_step``.

    hidden (+ residual) ─ RMSNorm → h (int8) ─ in_proj → x, z (int8)
    x, z ─ qmixer_ssm_step's chain (conv, x_proj, dt_proj, the scan step) → y
    y ─ Hadamard → int8 ─ out_proj → out

Its torch reference is that chain of the reference ops (rmsnorm_quant, w8a8_linear or
w4a8_linear, quamba.ops.fused_decode.mixer_step.chain_step, hadamard_quant), so a block computes the
same numbers through it as through its norm and mixer. Its cuda backend is one persistent CUDA
kernel for the block at batch 1 (quamba.ops.fused_decode.layer_step_cuda: Mamba-2.8B's sizes,
compute capability 9.0, 128 SMs), whose every rounding is the chain of CUDA kernels' (greedy
decoding takes the same tokens); where that kernel cannot run, the cuda backend runs the chain on
its CUDA kernels, the unfused step. A batch-1 decode step at 2.8B is mostly fixed per-kernel time:
seven kernels a block.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from quamba.ops import backend
from quamba.ops.fused_decode.mixer_step import chain_lacks, chain_step, linear_lacks, project
from quamba.ops.fused_decode.weights import ConvWeights, StepScales, W4A8Weight, W8A8Weight
from quamba.ops.norm.qhadamard import hadamard_quant, lacks_on
from quamba.ops.norm.qnorm import rmsnorm_quant
from quamba.ops.scan.qsscan import SSMParams

log = logging.getLogger("quamba")

OP = "qmamba_layer_step"


@dataclass
class LayerWeights:
    """What one quantized Mamba1 block's decode step reads besides its states: the norm (no
    weight: the rotation folded it into in_proj), in_proj (int8 out: x and z codes), the SSM side
    as qmixer_ssm_step takes it, the Hadamard's output scale and out_proj (float out). The
    linears are W8A8 or (in_proj, x_proj, out_proj of a W4A8 block) W4A8."""

    norm_eps: float
    h_scale: float  # the norm's output scale (in_proj's input scale)
    in_proj: W8A8Weight | W4A8Weight  # [2 d_inner, d_model], out_scale = x's and z's
    conv: ConvWeights
    x_proj: W8A8Weight | W4A8Weight
    dt_proj: W8A8Weight
    params: SSMParams
    scales: StepScales
    y_scale: float  # out_proj's input (the Hadamard's output) scale
    out_proj: W8A8Weight | W4A8Weight  # [d_model, d_inner], out_scale None: out in ``out_dtype``
    out_dtype: torch.dtype = torch.float16


def qmamba_layer_step(hidden, residual, layer: LayerWeights, conv_state, ssm_state,
                      backend_name=None):
    """(out [batch, 1, d_model] in ``layer.out_dtype``, residual_out fp32 [batch, 1, d_model]) of
    one decode step of a block, its states stepped in place.

    hidden: the block before's output [batch, 1, d_model] (or the embedding); residual: fp32, the
    same shape, or None (the first block); conv_state int8 [batch, d_inner, width - 1]; ssm_state
    int8 codes of ``layer.scales.state`` [batch, d_inner, d_state]. The numbers are the chain's
    (module docstring) on every backend; on a GPU the kernel's equal the chain of CUDA ops' bit
    for bit."""
    _check(hidden, residual, layer, conv_state, ssm_state)
    impl = backend.select(OP, hidden.device, backend_name,
                          cuda_lacks=_cuda_lacks(hidden, residual, layer, conv_state, ssm_state))
    return impl(hidden, residual, layer, conv_state, ssm_state)


def _check(hidden, residual, layer: LayerWeights, conv_state, ssm_state) -> None:
    """ValueError for inputs outside the op's scope, on every backend."""
    out_proj = layer.out_proj
    d_model = (out_proj.packed if isinstance(out_proj, W4A8Weight) else out_proj.weight).shape[0]
    check_block_step(OP, hidden, residual, torch.float32, d_model, conv_state, ssm_state)
    if ssm_state.dtype != torch.int8:
        raise ValueError(f"{OP}: ssm_state must be int8 codes (QuantConfig.state_cache 'int8'), got "
                         f"{ssm_state.dtype}")


def check_block_step(op: str, hidden, residual, residual_dtype, d_model: int, conv_state,
                     ssm_state) -> None:
    """ValueError unless a block's decode-step op (``op``) gets hidden float [batch, 1, d_model],
    a residual of hidden's shape in ``residual_dtype`` or None, and states of hidden's batch."""
    if hidden.dim() != 3 or hidden.shape[1:] != (1, d_model) or not hidden.is_floating_point():
        raise ValueError(f"{op}: hidden must be float [batch, 1, {d_model}], got {hidden.dtype} "
                         f"{tuple(hidden.shape)}")
    if residual is not None and (residual.shape, residual.dtype) != (hidden.shape, residual_dtype):
        dtype_name = "fp32" if residual_dtype == torch.float32 else residual_dtype
        raise ValueError(f"{op}: residual must be {dtype_name} of hidden's shape "
                         f"{tuple(hidden.shape)}, got {residual.dtype} {tuple(residual.shape)}")
    if conv_state.shape[0] != hidden.shape[0] or ssm_state.shape[0] != hidden.shape[0]:
        raise ValueError(f"{op}: the states' batch {conv_state.shape[0]}, {ssm_state.shape[0]} is "
                         f"not hidden's {hidden.shape[0]}")


def _cuda_lacks(hidden, residual, layer: LayerWeights, conv_state, ssm_state) -> str | None:
    """Why no cuda path takes this step: what the chain's CUDA kernels lack, unless the layer
    kernel runs it (it takes Mamba-2.8B's blocks only, inside every limit of the chain's but a
    4-bit x_proj's group size: it reads x_proj expanded)."""
    lacks = (linear_lacks(layer.in_proj) or chain_lacks(layer.conv, layer.x_proj, ssm_state)
             or lacks_on(hidden.device, ssm_state.shape[1]) or linear_lacks(layer.out_proj))
    if lacks is not None and _layer_kernel_runs(hidden, residual, layer, conv_state, ssm_state):
        return None
    return lacks


def _layer_kernel_runs(hidden, residual, layer: LayerWeights, conv_state, ssm_state) -> bool:
    if not hidden.is_cuda or backend.cuda_extension_error() is not None:
        return False
    from quamba.ops.fused_decode import layer_step_cuda
    return layer_step_cuda.lacks(hidden, residual, layer, conv_state, ssm_state) is None


def chain_layer_step(hidden, residual, layer: LayerWeights, conv_state, ssm_state,
                     backend_name=None):
    """The step as the chain of the separate ops on ``backend_name``'s implementations (the op's
    torch backend runs their references)."""
    h, residual_out = rmsnorm_quant(hidden, residual, None, layer.norm_eps, layer.h_scale, True,
                                    backend_name=backend_name)
    x, z = project(layer.in_proj, h[:, 0], layer.out_dtype, backend_name).chunk(2, dim=-1)
    y = chain_step(x, z, conv_state, ssm_state, layer.conv, layer.x_proj, layer.dt_proj,
                   layer.params, layer.scales, layer.out_dtype, backend_name)[0]
    y_codes = hadamard_quant(y, layer.y_scale, backend_name=backend_name)
    return project(layer.out_proj, y_codes, layer.out_dtype, backend_name)[:, None], residual_out


@backend.register(OP, "torch")
def _qmamba_layer_step_torch(hidden, residual, layer, conv_state, ssm_state):
    return chain_layer_step(hidden, residual, layer, conv_state, ssm_state, backend_name="torch")


@backend.register(OP, "cuda")
def _qmamba_layer_step_cuda(hidden, residual, layer, conv_state, ssm_state):
    from quamba.ops.fused_decode import layer_step_cuda
    kernel_lacks = layer_step_cuda.lacks(hidden, residual, layer, conv_state, ssm_state)
    if kernel_lacks is None:
        return layer_step_cuda.layer_step(hidden, residual, layer, conv_state, ssm_state)
    _log_chain(kernel_lacks)
    return chain_layer_step(hidden, residual, layer, conv_state, ssm_state, backend_name="cuda")


@functools.lru_cache(maxsize=None)
def _log_chain(why: str) -> None:
    """Says once per reason that the step runs the chain of CUDA kernels, not the layer kernel."""
    log.info("%s runs the chain of CUDA kernels, not its layer kernel: %s", OP, why)
