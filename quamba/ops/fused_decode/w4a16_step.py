"""One decode step of a weight-only (W4A16) Mamba1 mixer's SSM side as one op,
``w4a16_ssm_step``, and of a whole W4A16 block as one op, ``w4a16_layer_step``.

The step between in_proj and out_proj, float activations, zoh discretization:

    x ─ conv state update + conv + SiLU → u
    u ─ x_proj (W4A16: 4-bit codes, fp16 group scales) → dt_low, B, C
    dt_low ─ dt_proj (float) → dt
    selective scan step (u, dt + dt_bias, A, B, C, D, z; fp32 SSM state, in place) → y

Its torch reference is exactly that chain of the FP mixer's ops (causal_conv1d_update,
w4a16_linear, a float linear, selective_state_update), so the mixer computes the same numbers
through the op on the torch backend as op by op. Its cuda backend is one CUDA kernel, a
thread-block cluster a batch row (quamba.ops.fused_decode.w4a16_step_cuda, compute capability 9.0, a
float16 or bfloat16 model), instead of the chain's four kernels (causal-conv1d's, the 4-bit GEMV,
cuBLAS, mamba-ssm's Triton step); it rounds u, x_proj's output and dt to the activation dtype
where the chain stores them and sums in fp32 in its own order, so it agrees with the chain to
float tolerances. Where the kernel cannot run, the cuda backend runs the chain on the CUDA ops
and says so once.

``w4a16_layer_step`` is a block's whole decode step (Block(RMSNorm, WeightOnlyMambaMixer)):

    hidden (+ residual) ─ RMSNorm → h ─ in_proj (W4A16) → x, z
    x, z ─ w4a16_ssm_step → y ─ out_proj (W4A16) → out

Its torch reference is that chain of ops (rms_norm, w4a16_linear, w4a16_ssm_step), so a block
computes the same numbers through it as through its norm and mixer. Its cuda backend is one
persistent CUDA kernel for the block at batch 1 (quamba.ops.fused_decode.w4a16_layer_cuda:
Mamba-2.8B's sizes, a float16 model, compute capability 9.0). It rounds to float16 where the
chain stores and sums in fp32 in its own order: its residual is the chain of CUDA ops' bit for
bit, its output, states and in_proj's x (the conv state's newest column) agree with the chain's
to float tolerances.
Where it cannot run, the cuda backend runs the chain on the CUDA ops and says so once.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quamba.ops import backend
from quamba.ops.conv.causal_conv1d import causal_conv1d_update
from quamba.ops.fused_decode.layer_step import check_block_step
from quamba.ops.linear.qlinear4 import w4a16_kernel_lacks, w4a16_linear
from quamba.ops.norm.rms_norm import rms_norm
from quamba.ops.scan.selective_scan import selective_state_update

log = logging.getLogger("quamba")

OP = "w4a16_ssm_step"
LAYER_OP = "w4a16_layer_step"


@dataclass
class W4A16Weight:
    """A W4A16 linear (quamba.layers.qlinear.W4A16Linear's format)."""

    packed: torch.Tensor  # uint8 [N, K / 2], two 4-bit codes a byte, low nibble first
    scales: torch.Tensor  # fp16 [N, K / group_size]
    group_size: int


@dataclass
class FloatSSMWeights:
    """The float weights of the step besides x_proj (the FP mixer's own tensors)."""

    conv_weight: torch.Tensor  # [d_inner, width]
    conv_bias: torch.Tensor | None  # [d_inner]
    dt_weight: torch.Tensor  # [d_inner, dt_rank]
    dt_bias: torch.Tensor  # [d_inner]
    A: torch.Tensor  # fp32 [d_inner, d_state]: -exp(A_log)
    D: torch.Tensor | None  # fp32 [d_inner]


@dataclass
class W4A16LayerWeights:
    """What one W4A16 Mamba1 block's decode step reads besides its states."""

    norm_weight: torch.Tensor  # [d_model], the block's RMSNorm weight
    norm_eps: float
    residual_in_fp32: bool
    in_proj: W4A16Weight  # [2 d_inner, d_model]
    x_proj: W4A16Weight  # [dt_rank + 2 d_state, d_inner]
    ssm: FloatSSMWeights
    out_proj: W4A16Weight  # [d_model, d_inner]


def w4a16_ssm_step(x, z, conv_state, ssm_state, x_proj: W4A16Weight, weights: FloatSSMWeights,
                   backend_name=None):
    """y [batch, d_inner] in x's dtype of one decode step; the states updated in place.

    x, z: [batch, d_inner] (in_proj's output; any strides; z None: no gate); conv_state: [batch,
    d_inner, width - 1] in x's dtype; ssm_state: fp32 [batch, d_inner, d_state]; x_proj: the
    W4A16 weight [dt_rank + 2 d_state, d_inner]. The arithmetic is the chain's (module docstring).
    """
    _check(x, z, conv_state, ssm_state, x_proj, weights)
    impl = backend.select(OP, x.device, backend_name, cuda_lacks=_chain_lacks(x, x_proj))
    return impl(x, z, conv_state, ssm_state, x_proj, weights)


def _check(x, z, conv_state, ssm_state, x_proj, weights) -> None:
    """ValueError for inputs outside the op's scope, on every backend."""
    if x.dim() != 2 or not x.is_floating_point() or (z is not None and z.shape != x.shape):
        raise ValueError(f"{OP}: x and z must be float [batch, d_inner], got {x.dtype} "
                         f"{tuple(x.shape)} and {None if z is None else tuple(z.shape)}")
    batch, d_inner = x.shape
    width = weights.conv_weight.shape[-1]
    if conv_state.shape != (batch, d_inner, width - 1):
        raise ValueError(f"{OP}: conv_state must be [batch, d_inner, width - 1] = "
                         f"{(batch, d_inner, width - 1)}, got {tuple(conv_state.shape)}")
    if ssm_state.dim() != 3 or ssm_state.shape[:2] != x.shape:
        raise ValueError(f"{OP}: ssm_state must be [batch, d_inner, d_state], got "
                         f"{tuple(ssm_state.shape)}")
    d_state = ssm_state.shape[2]
    dt_rank = weights.dt_weight.shape[1]
    x_proj_shape = (x_proj.packed.shape[0], 2 * x_proj.packed.shape[1])
    if x_proj_shape != (dt_rank + 2 * d_state, d_inner):
        raise ValueError(f"{OP}: x_proj {x_proj_shape} does not map d_inner {d_inner} to "
                         f"dt_rank + 2 d_state = {dt_rank + 2 * d_state}")
    if weights.A.shape != (d_inner, d_state) or weights.dt_weight.shape[0] != d_inner:
        raise ValueError(f"{OP}: A {tuple(weights.A.shape)} and dt_proj "
                         f"{tuple(weights.dt_weight.shape)} must have d_inner = {d_inner} rows")


def _chain_lacks(x, *linears: W4A16Weight) -> str | None:
    """What the cuda chain's 4-bit kernels lack for these weights and activations like x (None:
    nothing). The op's own kernels lack it too: the step kernel reads x_proj in pieces of 32
    channels within a group (w4a16_step.cu's kPiece), the layer kernel in groups of 128, so no
    cuda path of the op takes such a step."""
    for linear in linears:
        lacks = w4a16_kernel_lacks(x, linear.packed, linear.group_size)
        if lacks is not None:
            return lacks
    return None


def chain_step(x, z, conv_state, ssm_state, x_proj: W4A16Weight, weights: FloatSSMWeights,
               backend_name=None):
    """The step as the FP mixer's chain of ops (the op's torch backend runs it on their torch
    references, the cuda backend where its kernel cannot run on theirs)."""
    u = causal_conv1d_update(x, conv_state, weights.conv_weight, weights.conv_bias,
                             backend_name=backend_name)
    x_dbl = w4a16_linear(u, x_proj.packed, x_proj.scales, x_proj.group_size,
                         backend_name=backend_name)
    d_state = ssm_state.shape[2]
    dt_low, B, C = torch.split(x_dbl, [weights.dt_weight.shape[1], d_state, d_state], dim=-1)
    dt = F.linear(dt_low, weights.dt_weight)  # the bias is added inside the scan
    return selective_state_update(ssm_state, u, dt, weights.A, B, C, weights.D, z=z,
                                  delta_bias=weights.dt_bias, delta_softplus=True,
                                  backend_name=backend_name)


@backend.register(OP, "torch")
def _w4a16_ssm_step_torch(x, z, conv_state, ssm_state, x_proj, weights):
    return chain_step(x, z, conv_state, ssm_state, x_proj, weights, backend_name="torch")


@backend.register(OP, "cuda")
def _w4a16_ssm_step_cuda(x, z, conv_state, ssm_state, x_proj, weights):
    from quamba.ops.fused_decode import w4a16_step_cuda
    kernel_lacks = w4a16_step_cuda.lacks(x, z, conv_state, ssm_state, x_proj, weights)
    if kernel_lacks is None:
        return w4a16_step_cuda.ssm_step(x, z, conv_state, ssm_state, x_proj, weights)
    _log_chain(OP, kernel_lacks)
    return chain_step(x, z, conv_state, ssm_state, x_proj, weights, backend_name="cuda")


def w4a16_layer_step(hidden, residual, layer: W4A16LayerWeights, conv_state, ssm_state,
                     backend_name=None):
    """(out [batch, 1, d_model] in hidden's dtype, residual_out [batch, 1, d_model]) of one
    decode step of a block, its states stepped in place.

    hidden: the block before's output [batch, 1, d_model] (or the embedding); residual: the
    same shape, fp32 if ``layer.residual_in_fp32`` else in hidden's dtype, or None (the first
    block); conv_state, ssm_state: as :func:`w4a16_ssm_step` takes them. The arithmetic is the
    chain's (module docstring)."""
    _check_layer(hidden, residual, layer, conv_state, ssm_state)
    impl = backend.select(LAYER_OP, hidden.device, backend_name,
                          cuda_lacks=_chain_lacks(hidden, layer.in_proj, layer.x_proj,
                                                  layer.out_proj))
    return impl(hidden, residual, layer, conv_state, ssm_state)


def _check_layer(hidden, residual, layer: W4A16LayerWeights, conv_state, ssm_state) -> None:
    """ValueError for inputs outside the layer op's scope, on every backend (the SSM side's
    shapes are :func:`w4a16_ssm_step`'s to check)."""
    residual_dtype = torch.float32 if layer.residual_in_fp32 else hidden.dtype
    check_block_step(LAYER_OP, hidden, residual, residual_dtype, layer.out_proj.packed.shape[0],
                     conv_state, ssm_state)


def chain_layer_step(hidden, residual, layer: W4A16LayerWeights, conv_state, ssm_state,
                     backend_name=None):
    """The block's step as its norm's and mixer's chain of ops on ``backend_name``'s
    implementations (the op's torch backend runs their references)."""
    normed, residual_out = rms_norm(hidden, residual, layer.norm_weight, layer.norm_eps,
                                    layer.residual_in_fp32, backend_name=backend_name)
    x, z = _linear(normed[:, 0], layer.in_proj, backend_name).chunk(2, dim=-1)
    y = w4a16_ssm_step(x, z, conv_state, ssm_state, layer.x_proj, layer.ssm,
                       backend_name=backend_name)
    return _linear(y, layer.out_proj, backend_name)[:, None], residual_out


def _linear(x, weight: W4A16Weight, backend_name):
    return w4a16_linear(x, weight.packed, weight.scales, weight.group_size,
                        backend_name=backend_name)


@backend.register(LAYER_OP, "torch")
def _w4a16_layer_step_torch(hidden, residual, layer, conv_state, ssm_state):
    return chain_layer_step(hidden, residual, layer, conv_state, ssm_state, backend_name="torch")


@backend.register(LAYER_OP, "cuda")
def _w4a16_layer_step_cuda(hidden, residual, layer, conv_state, ssm_state):
    from quamba.ops.fused_decode import w4a16_layer_cuda
    kernel_lacks = w4a16_layer_cuda.lacks(hidden, residual, layer, conv_state, ssm_state)
    if kernel_lacks is None:
        return w4a16_layer_cuda.layer_step(hidden, residual, layer, conv_state, ssm_state)
    _log_chain(LAYER_OP, kernel_lacks)
    return chain_layer_step(hidden, residual, layer, conv_state, ssm_state, backend_name="cuda")


@functools.lru_cache(maxsize=None)
def _log_chain(op: str, why: str) -> None:
    """Says once per op and reason that it runs the chain of CUDA ops, not its kernel."""
    log.warning("%s runs the chain of CUDA ops, not its kernel: %s", op, why)
