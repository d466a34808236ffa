"""The SSM-side ops on the kernels of ``quamba._C`` (csrc/conv1d, csrc/qsscan, csrc/norm):
``qconv1d``, ``qconv1d_update``, their per-channel-scale variants ``qconv1d_channelwise`` and
``qconv1d_channelwise_update`` (Mamba2's xBC), ``qsscan``, ``qsscan_update`` (every
discretization; foh's decode step reads and updates its ``drive``), ``rmsnorm_quant`` and
``hadamard_quant``, with the torch references' signatures.

Every fp32 constant a kernel applies (epilogue multiplier, reciprocal of an output scale, 1/sqrt(n))
is computed here by the functions of :mod:`quamba.ops.quant` that the references use, so both
backends multiply by the same numbers.

Layouts: qconv1d and qsscan read [batch, dim, seqlen] inputs with any strides (coalesced when
the time or the channel dimension has stride 1) and return outputs in their input's layout
family: channel-last (a transposed [batch, seqlen, dim] tensor) when ``x``/``u`` has
``stride(1) == 1``, else contiguous. rmsnorm_quant and hadamard_quant take rows: a
non-contiguous input is copied once by ``.contiguous()`` (the module never passes one).
"""
from __future__ import annotations

import functools
import math

import torch

import quamba._C  # noqa: F401  loads torch.ops.quamba.*
from quamba.ops import backend
from quamba.ops.constants import cached
from quamba.ops.discretization import DEFAULT
from quamba.ops.hadamard import hadamard_factors, hadamard_sign_matrix
from quamba.ops.quant import (fp32_multiplier, fp32_reciprocal, fp32_value, reciprocal,
                              requant_multiplier)


def _scale(value) -> float | None:
    """A scale as a hashable Python float (0-d tensors are read once)."""
    return None if value is None else float(value)


def _inverse_or_none(scale) -> float | None:
    return None if scale is None else fp32_reciprocal(_scale(scale))


def _silu_flag(activation) -> bool:
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return activation == "silu"


def _conv_constants(x_scale, weight_scale, bias, bias_scale, out_scale):
    multiplier = fp32_multiplier(_scale(x_scale), _scale(weight_scale))
    bias_scale32 = fp32_value(_scale(bias_scale)) if bias is not None else 1.0
    return multiplier, bias_scale32, _inverse_or_none(out_scale)


@backend.register("qconv1d", "cuda")
def _qconv1d_cuda(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale, activation):
    silu = _silu_flag(activation)
    multiplier, bias_scale32, out_inv = _conv_constants(x_scale, weight_scale, bias, bias_scale,
                                                        out_scale)
    return torch.ops.quamba.qconv1d(x, weight, bias, multiplier, bias_scale32, out_inv, silu)


@backend.register("qconv1d_update", "cuda")
def _qconv1d_update_cuda(x, conv_state, x_scale, weight, weight_scale, bias, bias_scale,
                         out_scale, activation):
    silu = _silu_flag(activation)
    multiplier, bias_scale32, out_inv = _conv_constants(x_scale, weight_scale, bias, bias_scale,
                                                        out_scale)
    return torch.ops.quamba.qconv1d_update(x, conv_state, weight, bias, multiplier, bias_scale32,
                                           out_inv, silu)


def _channel_conv_constants(x_scale, weight_scale, out_scale, device):
    """(multipliers fp32 [dim], out_inv_scales fp32 [dim] or None) on ``device``, computed by the
    reference's functions, kept per version of the scale tensors (quamba.ops.constants)."""
    def make():
        multipliers = requant_multiplier(x_scale.float(), weight_scale).to(device).contiguous()
        out_inv = None if out_scale is None else reciprocal(out_scale).to(device).contiguous()
        return multipliers, out_inv
    if out_scale is not None and out_scale.is_inference():
        return make()
    out_key = None if out_scale is None else (id(out_scale), out_scale._version)
    return cached(x_scale, (out_key, float(weight_scale), device), make)


@backend.register("qconv1d_channelwise", "cuda")
def _qconv1d_channelwise_cuda(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale,
                              activation):
    silu = _silu_flag(activation)
    multipliers, out_inv = _channel_conv_constants(x_scale, weight_scale, out_scale, x.device)
    bias_scale32 = fp32_value(_scale(bias_scale)) if bias is not None else 1.0
    return torch.ops.quamba.qconv1d_channelwise(x, weight, bias, multipliers, bias_scale32,
                                                out_inv, silu)


@backend.register("qconv1d_channelwise_update", "cuda")
def _qconv1d_channelwise_update_cuda(x, conv_state, x_scale, weight, weight_scale, bias,
                                     bias_scale, out_scale, activation):
    silu = _silu_flag(activation)
    multipliers, out_inv = _channel_conv_constants(x_scale, weight_scale, out_scale, x.device)
    bias_scale32 = fp32_value(_scale(bias_scale)) if bias is not None else 1.0
    return torch.ops.quamba.qconv1d_channelwise_update(x, conv_state, weight, bias, multipliers,
                                                       bias_scale32, out_inv, silu)


def _input_scale(t: torch.Tensor, scale) -> float:
    """fp32 scale of int8 codes; float inputs ignore theirs (0.0 makes a missing one an error)."""
    if t.dtype != torch.int8:
        return 1.0
    return 0.0 if scale is None else fp32_value(_scale(scale))


def _param_args(params):
    return (params.A_log, fp32_value(_scale(params.A_log_scale)), params.D,
            fp32_value(_scale(params.D_scale)), params.dt_bias, fp32_value(_scale(params.dt_bias_scale)))


def qsscan_op_args(u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale, params,
                   state_scale, out_dtype) -> tuple:
    """torch.ops.quamba.qsscan's arguments for :func:`quamba.ops.qsscan.qsscan`'s (its launch
    configuration, the last argument, left to the default)."""
    z_scale32 = 1.0 if z is None else _input_scale(z, z_scale)
    return (u, _input_scale(u, u_scale), dt, _input_scale(dt, dt_scale), B,
            _input_scale(B, B_scale), C, _input_scale(C, C_scale), z, z_scale32,
            *_param_args(params), _inverse_or_none(state_scale), out_dtype)


@backend.register("qsscan", "cuda")
def _qsscan_cuda(u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale, params,
                 state_scale, out_dtype, discretization=DEFAULT):
    args = qsscan_op_args(u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale, params,
                          state_scale, out_dtype)
    return torch.ops.quamba.qsscan(*args, discretization=discretization)


@backend.register("qsscan_update", "cuda")
def _qsscan_update_cuda(state, state_scale, u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z,
                        z_scale, params, out_dtype, discretization=DEFAULT, drive=None,
                        dt_proj=None):
    state_scale32 = _input_scale(state, state_scale)
    z_scale32 = 1.0 if z is None else _input_scale(z, z_scale)
    projection = {} if dt_proj is None else dict(dt_proj=dt_proj.weight,
                                                 dt_multiplier=fp32_value(dt_proj.multiplier))
    return torch.ops.quamba.qsscan_update(
        state, state_scale32, u, _input_scale(u, u_scale), dt, _input_scale(dt, dt_scale), B,
        _input_scale(B, B_scale), C, _input_scale(C, C_scale), z, z_scale32,
        *_param_args(params), out_dtype, drive=drive, discretization=discretization,
        **projection)


@backend.register("rmsnorm_quant", "cuda")
def _rmsnorm_quant_cuda(x, residual, weight, eps, out_scale, residual_in_fp32):
    residual = None if residual is None else residual.contiguous()
    weight = None if weight is None else weight.contiguous()
    return torch.ops.quamba.rmsnorm_quant(x.contiguous(), residual, weight, fp32_value(float(eps)),
                                          fp32_reciprocal(_scale(out_scale)), residual_in_fp32)


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
                                           fp32_reciprocal(_scale(out_scale)))


@backend.register("gated_norm_hadamard_quant", "cuda", kernels=("hadamard_quant",))
def _gated_norm_hadamard_quant_cuda(y, z, z_scale, weight, group_size, eps, out_scale):
    m, p, masks, norm = _hadamard_plan(y.shape[-1])
    if weight is not None:
        weight = cached(weight, ("fp32", y.device),
                        lambda: weight.to(device=y.device, dtype=torch.float32).contiguous())
    return torch.ops.quamba.hadamard_quant(y.contiguous(), m, p, masks, norm,
                                           fp32_reciprocal(_scale(out_scale)), z,
                                           fp32_value(_scale(z_scale)), weight, group_size, eps)
