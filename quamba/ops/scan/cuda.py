"""QSScan on the kernels of ``quamba._C`` (csrc/qsscan): ``qsscan`` and ``qsscan_update`` (every
discretization; foh's decode step reads and updates its ``drive``), with the torch references'
signatures (quamba.ops.scan.qsscan).

Every fp32 constant a kernel applies is computed here by the functions of :mod:`quamba.ops.quant`
that the references use, so both backends multiply by the same numbers. The kernels read ``u``
as [batch, dim, seqlen] with any strides and return ``y`` in its layout family (channel-last when
``u.stride(1) == 1``, else contiguous).
"""
from __future__ import annotations

import torch

import quamba._C  # noqa: F401  loads torch.ops.quamba.*
from quamba.ops import backend
from quamba.ops.constants import reciprocal_or_none, scale_float
from quamba.ops.quant import fp32_value
from quamba.ops.scan.discretization import DEFAULT


def _input_scale(t: torch.Tensor, scale) -> float:
    """fp32 scale of int8 codes; float inputs ignore theirs (0.0 makes a missing one an error)."""
    if t.dtype != torch.int8:
        return 1.0
    return 0.0 if scale is None else fp32_value(scale_float(scale))


def _param_args(params):
    return (params.A_log, fp32_value(scale_float(params.A_log_scale)), params.D,
            fp32_value(scale_float(params.D_scale)), params.dt_bias,
            fp32_value(scale_float(params.dt_bias_scale)))


def qsscan_op_args(u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale, params,
                   state_scale, out_dtype) -> tuple:
    """torch.ops.quamba.qsscan's arguments for :func:`quamba.ops.qsscan.qsscan`'s (its launch
    configuration, the last argument, left to the default)."""
    z_scale32 = 1.0 if z is None else _input_scale(z, z_scale)
    return (u, _input_scale(u, u_scale), dt, _input_scale(dt, dt_scale), B,
            _input_scale(B, B_scale), C, _input_scale(C, C_scale), z, z_scale32,
            *_param_args(params), reciprocal_or_none(state_scale), out_dtype)


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
