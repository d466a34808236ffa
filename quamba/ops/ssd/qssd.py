"""The int8 ops of a Quamba2 (Mamba2) mixer: the causal conv1d over xBC with per-channel scales,
and the SSD on int8 inputs (fp32 inside).

Quamba2 gives each part of xBC its own scales: x one per channel (a few distinct values per SSD
group, from quamba.quantization.cluster), B and C one per state group. So, unlike the Mamba1 ops
(quamba.ops.conv.qconv1d, quamba.ops.scan.qsscan), these take per-channel scale tensors. On a GPU
the conv runs the qconv1d kernels with per-channel epilogues (quamba.ops.conv.cuda), the SSD Triton
kernels (quamba.ops.ssd.ssd_triton).
"""
from __future__ import annotations

import torch

from quamba.ops import backend
from quamba.ops.conv.qconv1d import _qconv1d_torch, _qconv1d_update_torch
from quamba.ops.conv.qconv1d import kernel_lacks as conv_kernel_lacks
from quamba.ops.quant import dequantize, quantize
from quamba.ops.scan.qsscan import SSMParams, as_float
from quamba.ops.ssd.ssd import kernel_lacks, ssd_scan, ssd_state_update, step_kernel_lacks


def qconv1d_channelwise(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale=None,
                        activation: str | None = "silu", backend_name=None):
    """quamba.ops.qconv1d.qconv1d with fp32 [dim] tensors for ``x_scale`` and ``out_scale`` (one
    scale per channel); x int8 [batch, dim, seqlen]. Same arithmetic per channel; int8 [batch,
    dim, seqlen] out, or fp32 when ``out_scale`` is None."""
    impl = backend.select("qconv1d_channelwise", x.device, backend_name,
                          cuda_lacks=conv_kernel_lacks(x.shape, weight.shape[-1]))
    return impl(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale, activation)


def qconv1d_channelwise_update(x, conv_state, x_scale, weight, weight_scale, bias, bias_scale,
                               out_scale=None, activation: str | None = "silu", backend_name=None):
    """One decode step of :func:`qconv1d_channelwise`: x int8 [batch, dim], conv_state int8
    [batch, dim, width - 1] rolled in place; int8 [batch, dim] out (fp32 without ``out_scale``)."""
    impl = backend.select("qconv1d_channelwise_update", x.device, backend_name,
                          cuda_lacks=conv_kernel_lacks(x.shape, weight.shape[-1]))
    return impl(x, conv_state, x_scale, weight, weight_scale, bias, bias_scale, out_scale,
                activation)


def _column(scale):
    """A [dim] scale as [dim, 1], to broadcast over time."""
    return None if scale is None else scale.float().reshape(-1, 1)


@backend.register("qconv1d_channelwise", "torch")
def _qconv1d_channelwise_torch(x, x_scale, weight, weight_scale, bias, bias_scale, out_scale,
                               activation):
    return _qconv1d_torch(x, _column(x_scale).to(x.device), weight, weight_scale, bias, bias_scale,
                          _column(out_scale), activation)


@backend.register("qconv1d_channelwise_update", "torch")
def _qconv1d_channelwise_update_torch(x, conv_state, x_scale, weight, weight_scale, bias,
                                      bias_scale, out_scale, activation):
    return _qconv1d_update_torch(x, conv_state, x_scale.float().to(x.device), weight, weight_scale,
                                 bias, bias_scale, out_scale, activation)


def qssd_scan(x, x_scale, dt, dt_scale, B, B_scale, C, C_scale, params: SSMParams,
              chunk_size: int = 256, state_scale=None, out_dtype=torch.float16, backend_name=None):
    """The SSD of a prefill (quamba.ops.ssd.ssd.ssd_scan) on int8 inputs with their scales, or
    floats (scales ignored), as QSScan takes them.

    x: [batch, seqlen, nheads, headdim] with x_scale fp32 [nheads, headdim] (or a float);
    dt: [batch, seqlen, nheads] with a float dt_scale; B, C: [batch, seqlen, ngroups, d_state]
    with fp32 [ngroups, 1] (or [ngroups, d_state], or float) scales; params: A_log, D, dt_bias
    int8 [nheads] with per-tensor scales (A = -exp(A_log)). Returns ``(y, last_state)``: y
    [batch, seqlen, nheads, headdim] in out_dtype (no D-skip gate: Mamba2 gates in its norm);
    last_state [batch, nheads, headdim, d_state], int8 ``quantize(h_L, state_scale)`` when
    state_scale is given, else fp32.
    """
    impl = backend.select("qssd_scan", x.device, backend_name, cuda_lacks=kernel_lacks(x, B))
    return impl(x, x_scale, dt, dt_scale, B, B_scale, C, C_scale, params, chunk_size,
                state_scale, out_dtype)


def qssd_state_update(state, state_scale, x, x_scale, dt, dt_scale, B, B_scale, C, C_scale,
                      params: SSMParams, out_dtype=torch.float16, backend_name=None):
    """One decode step; ``state`` int8 (with ``state_scale``: dequantized, stepped, requantized
    in place) or fp32 [batch, nheads, headdim, d_state]. x [batch, nheads, headdim], dt [batch,
    nheads], B and C [batch, ngroups, d_state], scales as :func:`qssd_scan`. Returns y [batch,
    nheads, headdim] in out_dtype."""
    impl = backend.select("qssd_state_update", x.device, backend_name,
                          cuda_lacks=step_kernel_lacks(state))
    return impl(state, state_scale, x, x_scale, dt, dt_scale, B, B_scale, C, C_scale, params,
                out_dtype)


@backend.register("qssd_scan", "torch")
def _qssd_scan_torch(x, x_scale, dt, dt_scale, B, B_scale, C, C_scale, params, chunk_size,
                     state_scale, out_dtype):
    A, D, dt_bias = params.dequantized()
    y, last_state = ssd_scan(as_float(x, x_scale), as_float(dt, dt_scale), A, as_float(B, B_scale),
                             as_float(C, C_scale), D, dt_bias, chunk_size)
    if state_scale is not None:
        last_state = quantize(last_state, state_scale)
    return y.to(out_dtype), last_state


@backend.register("qssd_state_update", "torch")
def _qssd_state_update_torch(state, state_scale, x, x_scale, dt, dt_scale, B, B_scale, C, C_scale,
                             params, out_dtype):
    A, D, dt_bias = params.dequantized()
    h = dequantize(state, state_scale) if state.dtype == torch.int8 else state
    y = ssd_state_update(h, as_float(x, x_scale), as_float(dt, dt_scale), A, as_float(B, B_scale),
                         as_float(C, C_scale), D, dt_bias)
    if state.dtype == torch.int8:
        state.copy_(quantize(h, state_scale))
    return y.to(out_dtype)
