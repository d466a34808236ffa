"""Inputs of qmixer_ssm_step (quamba.ops.fused_decode.mixer_step) and the checks of its kernels
against the chain of reference ops, shared by tests/ops/test_fused_decode.py (CPU, Triton's
interpreter) and tests/ops/test_cuda_fused_decode.py (GPU).

The inputs are random int8 codes with scales that keep every stage in its working range: x_proj's
and dt_proj's outputs spread over the int8 codes (some saturate), Δ = softplus(dt + dt_bias)
between about 0.0015 and 6.5, A = -exp(A_log) in [-16, -1], an int8 SSM state whose steps
saturate rarely.

The kernels' integer outputs are checked link by link: each against the reference op applied to
the kernel's own input codes, so that one code rounded the other way upstream (exp differs by an
ulp between libraries) does not make every later comparison inexact. The conv state and the
linears' codes (integer sums, one epilogue) must be equal; u codes and an int8 SSM state within
one step on a tiny fraction; y within 1e-3 relative plus a 16-bit output's ulp (the tolerance of
the qsscan_update GPU tests, tests/ops/test_cuda_ssm.py).
"""
from __future__ import annotations

import dataclasses
import math
import zlib

import torch

from quamba.ops.conv.qconv1d import qconv1d_update
from quamba.ops.fused_decode.mixer_step import project, qmixer_ssm_step
from quamba.ops.fused_decode.weights import ConvWeights, StepScales, W4A8Weight, W8A8Weight
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.ops.quant4 import quantize_weight_w4a8
from quamba.ops.scan.qsscan import SSMParams, qsscan_update

ULP_16 = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 0.0}
CODE_STD = 127 / math.sqrt(3)  # of codes uniform in [-127, 127]
XZ_SCALE, U_SCALE, XDBL_SCALE, DT_SCALE = 0.05, 0.03, 0.04, 0.02


def step_case(batch, d_inner, d_state, dt_rank, width=4, int4=False, int8_state=True,
              group_size=64, seed=0, device="cpu") -> dict:
    """qmixer_ssm_step's arguments (but out_dtype) for one decode step, on ``device``."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((batch, d_inner, d_state, dt_rank, width,
                                                          int4, int8_state, seed)).encode()))

    def codes(*shape, low=-127):
        return torch.randint(low, 128, shape, generator=gen, dtype=torch.int8)

    n_out = dt_rank + 2 * d_state
    if int4:
        # as W8A8's x_proj below, for u codes spread CODE_STD
        std = 150 * XDBL_SCALE / (U_SCALE * CODE_STD * math.sqrt(d_inner))
        weight = std * torch.randn(n_out, d_inner, generator=gen)
        x_proj = W4A8Weight(*quantize_weight_w4a8(weight, group_size), U_SCALE, XDBL_SCALE)
    else:
        x_proj = W8A8Weight(codes(n_out, d_inner), _weight_scale(d_inner, U_SCALE, XDBL_SCALE, 150),
                            U_SCALE, XDBL_SCALE)
    state, state_scale = codes(batch, d_inner, d_state), 0.08
    case = dict(
        conv_state=codes(batch, d_inner, width - 1),
        ssm_state=state if int8_state else state.float() * state_scale,
        conv=ConvWeights(codes(d_inner, width), _weight_scale(width, XZ_SCALE, 1.0, 1.5),
                         codes(d_inner), 0.004),
        x_proj=x_proj,
        dt_proj=W8A8Weight(codes(d_inner, dt_rank),
                           _weight_scale(dt_rank, XDBL_SCALE, DT_SCALE, 60), XDBL_SCALE, DT_SCALE),
        params=SSMParams(codes(d_inner, d_state, low=0), math.log(16) / 127, codes(d_inner), 0.01,
                         codes(d_inner), 4.0 / 127),
        scales=StepScales(XZ_SCALE, U_SCALE, XDBL_SCALE, DT_SCALE, state_scale))
    case = {name: _moved(value, device) for name, value in case.items()}
    # x and z: the halves of in_proj's [batch, 2 d_inner] output, views with a row stride
    xz = codes(batch, 2 * d_inner).to(device)
    return dict(case, x=xz[:, :d_inner], z=xz[:, d_inner:])


def _weight_scale(fan_in, in_scale, out_scale, out_std):
    """A weight scale giving outputs of about ``out_std`` (in units of out_scale) for int8 codes."""
    return out_std * out_scale / (in_scale * CODE_STD * CODE_STD * math.sqrt(fan_in))


def _moved(value, device):
    """A tensor, or a dataclass of tensors and floats, on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value):
        return type(value)(**{field.name: _moved(getattr(value, field.name), device)
                              for field in dataclasses.fields(value)})
    return value


def cloned_states(case: dict) -> dict:
    """``case`` with its own copies of the two states (each run updates them in place)."""
    return dict(case, conv_state=case["conv_state"].clone(), ssm_state=case["ssm_state"].clone())


def reference_step(case: dict, out_dtype):
    """y of the op's torch backend (the chain of reference ops), stepping ``case``'s states."""
    return qmixer_ssm_step(**case, out_dtype=out_dtype, backend_name="torch")


def check_step(case: dict, out_dtype, kernel_step) -> None:
    """Runs ``kernel_step`` (quamba.ops.fused_decode.mixer_step_triton.ssm_step_with_codes) on a
    copy of ``case``'s states and checks every output link by link (module docstring); ``case``'s
    own states are left stepped by the reference, ready for the next step."""
    ran = cloned_states(case)
    y, u, x_dbl, dt = kernel_step(**ran, out_dtype=out_dtype)
    conv_state = case["conv_state"].clone()
    u_ref = qconv1d_update(case["x"], conv_state, case["scales"].xz, *_conv_args(case["conv"]),
                           out_scale=case["scales"].u, backend_name="torch")
    assert torch.equal(ran["conv_state"], conv_state), "conv state"
    assert_codes_close(u, u_ref, "u")
    assert_codes_equal(x_dbl, project(case["x_proj"], u, backend_name="torch"), "x_proj codes")
    dt_rank, d_state = case["dt_proj"].weight.shape[1], case["ssm_state"].shape[2]
    dt_low, B, C = torch.split(x_dbl, [dt_rank, d_state, d_state], dim=-1)
    dt_proj = case["dt_proj"]
    assert_codes_equal(dt, w8a8_linear(dt_low, dt_proj.in_scale, dt_proj.weight,
                                       dt_proj.weight_scale, dt_proj.out_scale,
                                       backend_name="torch"), "dt codes")
    s = case["scales"]
    state = case["ssm_state"].clone()
    y_ref = qsscan_update(state, s.state, u, s.u, dt, s.dt, B, s.xdbl, C, s.xdbl, case["z"], s.xz,
                          case["params"], out_dtype=out_dtype, backend_name="torch")
    if state.dtype == torch.int8:
        assert_codes_close(ran["ssm_state"], state, "SSM state")
    else:
        assert_floats_close(ran["ssm_state"], state, "SSM state")
    assert_floats_close(y, y_ref, "y")
    reference_step(case, out_dtype)


def _conv_args(conv: ConvWeights) -> tuple:
    return conv.weight, conv.weight_scale, conv.bias, conv.bias_scale


def assert_codes_equal(out, ref, what):
    assert out.dtype == torch.int8 and out.shape == ref.shape, what
    differing = int((out != ref).sum())
    assert differing == 0, f"{what}: {differing} of {out.numel()} codes differ"


def assert_codes_close(out, ref, what):
    """Equal, or one step apart on at most max(2, 1e-3 · numel) elements."""
    assert out.dtype == torch.int8 and out.shape == ref.shape, what
    diff = (out.int() - ref.int()).abs()
    assert int(diff.max()) <= 1, f"{what}: codes differ by up to {int(diff.max())}"
    differing = int((diff > 0).sum())
    assert differing <= max(2, 1e-3 * out.numel()), f"{what}: {differing} of {out.numel()} differ"


def assert_floats_close(out, ref, what):
    assert out.dtype == ref.dtype and ref.isfinite().all() and out.isfinite().all(), what
    rtol = 1e-3 + ULP_16.get(ref.dtype, 0.0)
    rms = float(ref.float().pow(2).mean().sqrt()) if ref.numel() else 0.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-4 * rms + 1e-30,
                               msg=lambda message: f"{what}: {message}")
