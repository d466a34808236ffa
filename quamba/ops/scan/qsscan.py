"""QSScan: the selective scan on int8 inputs, fp32 inside, fp16/bf16 output.

Each activation input (u, dt, B, C, z) is either int8 codes with its scale or a float tensor
(its scale is then ignored): the int8 mode passes codes, the fp32-conv mode passes a float u, the
fp32-ssm-input mode dequantized floats. The SSM parameters A_log, D and dt_bias are always int8
codes with per-tensor scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quamba.errors import QuambaError
from quamba.ops import backend
from quamba.ops.linear.qlinear import int8_matmul
from quamba.ops.quant import dequantize, quantize, requantize
from quamba.ops.scan.discretization import DEFAULT, METHODS, input_drive, require_drive, select_scan
from quamba.ops.scan.selective_scan import selective_scan, selective_state_update

# The QSScan kernels' limits (csrc/qsscan/qsscan.cu): kMaxState states a channel, a prefill's
# batch in the grid's y dimension, a decode step's batch · d_inner channels of 32 lanes indexed in
# 32 bits, and kMaxDtRank for a dt_proj folded into the step (its rows staged in shared memory).
KERNEL_MAX_D_STATE = 32
KERNEL_MAX_BATCH = 65535
KERNEL_MAX_STEP_CHANNELS = 2**26 - 1
KERNEL_MAX_DT_RANK = 1024


def kernel_lacks(d_state: int, batch: int) -> str | None:
    """Why the prefill kernels cannot scan this shape (None: they can)."""
    if d_state > KERNEL_MAX_D_STATE:
        return f"its kernels take d_state up to {KERNEL_MAX_D_STATE}, not {d_state}"
    if batch > KERNEL_MAX_BATCH:
        return f"its prefill kernel takes a batch up to {KERNEL_MAX_BATCH}, not {batch}"
    return None


def step_kernel_lacks(d_state: int, batch: int, d_inner: int, dt_rank: int | None) -> str | None:
    """Why the decode-step kernel cannot step this shape (``dt_rank``: of a folded dt_proj, or
    None); None where it can."""
    if d_state > KERNEL_MAX_D_STATE:
        return f"its kernels take d_state up to {KERNEL_MAX_D_STATE}, not {d_state}"
    if batch * d_inner > KERNEL_MAX_STEP_CHANNELS:
        return f"its step kernel takes batch · d_inner below 2^26, not {batch * d_inner}"
    if dt_rank is not None and dt_rank > KERNEL_MAX_DT_RANK:
        return (f"its step kernel folds in a dt_proj of dt_rank up to {KERNEL_MAX_DT_RANK}, "
                f"not {dt_rank}")
    return None


@dataclass
class SSMParams:
    """The int8 SSM parameters of one layer and their fp32 scales."""

    A_log: torch.Tensor  # int8 [d_inner, d_state]
    A_log_scale: float
    D: torch.Tensor  # int8 [d_inner]
    D_scale: float
    dt_bias: torch.Tensor  # int8 [d_inner]
    dt_bias_scale: float

    def dequantized(self):
        """(A = -exp(A_log), D, dt_bias) in fp32."""
        A = -torch.exp(dequantize(self.A_log, self.A_log_scale))
        return A, dequantize(self.D, self.D_scale), dequantize(self.dt_bias, self.dt_bias_scale)


@dataclass
class DtProjection:
    """dt_proj folded into a decode step (:func:`qsscan_update`'s ``dt_proj``): a W8A8 linear
    with int8 output and per-tensor scales, dt codes = ``requantize(dt_low · weightᵀ,
    multiplier)`` exactly as quamba.ops.linear.qlinear.w8a8_linear computes them."""

    weight: torch.Tensor  # int8 [d_inner, dt_rank]
    multiplier: float  # requant_multiplier(dt_low's scale, the weight's scale, dt's scale)

    def project(self, dt_low: torch.Tensor) -> torch.Tensor:
        """dt codes [batch, d_inner] of dt_low codes [batch, dt_rank] (the torch reference)."""
        return requantize(int8_matmul(dt_low, self.weight), self.multiplier)


def as_float(t: torch.Tensor, scale) -> torch.Tensor:
    """fp32 values of an op input that is either int8 codes (with scale) or already float."""
    return dequantize(t, scale) if t.dtype == torch.int8 else t.float()


def qsscan(u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale, params: SSMParams,
           state_scale=None, out_dtype=torch.float16, backend_name=None, discretization=DEFAULT):
    """Selective scan of a prefill.

    u, dt, z: [batch, d_inner, seqlen]; B, C: [batch, d_state, seqlen] (any strides); int8 codes
    with their float scales, or float tensors (scale ignored). z may be None (no gate).

        Δ = softplus(dt + dt_bias)  (PyTorch's softplus: x if x > 20 else log1p(exp(x)))
        A = -exp(A_log);  h_t = Ā_t ⊙ h_{t-1} + B̄u_t
        y_t = (C_t · h_t + D u_t) ⊙ silu(z_t)

    all in fp32, with Ā and B̄u of ``discretization`` (per channel d and state n: a = A[d, n],
    z = Δ_t a, v_t = u_t B_t; φ1, φ2 as in quamba.ops.scan.discretization):

        zoh (default)  Ā = exp(z)                  B̄u_t = Δ_t u_t B_t
        zoh-exact      Ā = exp(z)                  B̄u_t = (exp(z) - 1)/a · v_t
        bilinear       Ā = (1 + z/2)/(1 - z/2)     B̄u_t = Δ_t/(1 - z/2) · v_t
        foh            Ā = exp(z)                  B̄u_t = Δ_t(φ1 - φ2)(z) v_{t-1} + Δ_t φ2(z) v_t
        rk4            Ā = 1 + z + z²/2 + z³/6 + z⁴/24,  B̄u_t = Δ_t(1 + z/2 + z²/6 + z³/24) v_t

    foh starts from v_{-1} = 0; :func:`qsscan_last_drive` is the drive a decode continues from.
    The CUDA kernels run every method: zoh's arithmetic unchanged; for the others the prefill
    computes the coefficients in fp32 with fast exponentials and reciprocals (within a few ulps
    of the reference's), the decode step operation by operation as the reference does.

    Returns ``(y, last_state)``: y [batch, d_inner, seqlen] in out_dtype (fp16/bf16/fp32);
    last_state [batch, d_inner, d_state], int8 ``quantize(h_L, state_scale)`` when state_scale is
    given, else fp32.
    """
    impl = select_scan("qsscan", u.device, backend_name, discretization, kernel_methods=METHODS,
                       kernel_lacks=kernel_lacks(params.A_log.shape[-1], u.shape[0]))
    return impl(u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale, params,
                state_scale, out_dtype)


def qsscan_update(state, state_scale, u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z,
                  z_scale, params: SSMParams, out_dtype=torch.float16, backend_name=None,
                  discretization=DEFAULT, drive=None, dt_proj: DtProjection | None = None):
    """One decode step; updates ``state`` in place and returns y [batch, d_inner] in out_dtype.

    state: int8 [batch, d_inner, d_state] with ``state_scale`` (dequantized, stepped, requantized
    in place) or fp32 (stepped in place; state_scale ignored). u, dt, z: [batch, d_inner];
    B, C: [batch, d_state]; int8 codes with scales, or floats. Same arithmetic as :func:`qsscan`
    for ``discretization``; foh needs ``drive``, the previous step's v = u ⊗ B in fp32
    [batch, d_inner, d_state] (zeros before a sequence's first step, else
    :func:`qsscan_last_drive` of the prefill), which it overwrites with this step's (never
    quantized).

    ``dt_proj`` folds the mixer's dt_proj into the step: ``dt`` is then dt_low, int8 codes
    [batch, dt_rank], and the step takes dt = ``dt_proj.project(dt_low)`` (codes of
    ``dt_scale``), the w8a8_linear → qsscan_update chain in one op (one kernel on a GPU), with the
    same dt codes bit for bit.
    """
    require_drive(discretization, drive)
    if dt_proj is not None:
        _check_dt_projection(dt, dt_proj, u)
    lacks = step_kernel_lacks(state.shape[-1], u.shape[0], u.shape[1],
                              None if dt_proj is None else dt_proj.weight.shape[1])
    impl = select_scan("qsscan_update", u.device, backend_name, discretization,
                       kernel_methods=METHODS, kernel_lacks=lacks, drive=drive)
    return impl(state, state_scale, u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale,
                params, out_dtype, dt_proj=dt_proj)


def _check_dt_projection(dt_low, dt_proj: DtProjection, u) -> None:
    weight = dt_proj.weight
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[0] != u.shape[-1]:
        raise QuambaError(f"dt_proj.weight must be int8 [d_inner={u.shape[-1]}, dt_rank], got "
                          f"{weight.dtype} {list(weight.shape)}")
    if dt_low.dtype != torch.int8 or list(dt_low.shape) != [u.shape[0], weight.shape[1]]:
        raise QuambaError(f"with dt_proj, dt must be dt_low's int8 codes [batch={u.shape[0]}, "
                          f"dt_rank={weight.shape[1]}], got {dt_low.dtype} {list(dt_low.shape)}")


def qsscan_last_drive(u, u_scale, B, B_scale) -> torch.Tensor:
    """The drive v = u ⊗ B of a prefill's last step (u [batch, d_inner, seqlen], B [batch,
    d_state, seqlen], codes with scales or floats, as :func:`qsscan` takes them): what a foh
    :func:`qsscan_update` continues from."""
    return input_drive(as_float(u[..., -1], u_scale), as_float(B[..., -1], B_scale))


@backend.register("qsscan", "torch")
def _qsscan_torch(u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale, params,
                  state_scale, out_dtype, discretization=DEFAULT):
    A, D, dt_bias = params.dequantized()
    y, last_state = selective_scan(
        as_float(u, u_scale), as_float(dt, dt_scale), A, as_float(B, B_scale),
        as_float(C, C_scale), D, z=None if z is None else as_float(z, z_scale),
        delta_bias=dt_bias, delta_softplus=True, discretization=discretization)
    if state_scale is not None:
        last_state = quantize(last_state, state_scale)
    return y.to(out_dtype), last_state


@backend.register("qsscan_update", "torch")
def _qsscan_update_torch(state, state_scale, u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z,
                         z_scale, params, out_dtype, discretization=DEFAULT, drive=None,
                         dt_proj=None):
    if dt_proj is not None:
        dt = dt_proj.project(dt)
    A, D, dt_bias = params.dequantized()
    h = dequantize(state, state_scale) if state.dtype == torch.int8 else state
    y = selective_state_update(h, as_float(u, u_scale), as_float(dt, dt_scale), A,
                               as_float(B, B_scale), as_float(C, C_scale), D,
                               z=None if z is None else as_float(z, z_scale),
                               delta_bias=dt_bias, delta_softplus=True,
                               discretization=discretization, drive=drive)
    if state.dtype == torch.int8:
        state.copy_(quantize(h, state_scale))
    return y.to(out_dtype)
