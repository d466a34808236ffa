"""Each int8 op (torch backend) against an independent fp64 fake-quant formulation.

The independent references compute in float64 from dequantized values and quantize with a plain
round-half-even of x / scale. Integer outputs must match exactly except where the two
formulations round differently at a .5 boundary (fp32 vs fp64 arithmetic): then by one step,
for a tiny fraction of elements.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from quamba.errors import QuambaError
from quamba.ops.conv.qconv1d import qconv1d, qconv1d_update
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.ops.norm.hadamard import hadamard_matrix
from quamba.ops.norm.qhadamard import hadamard_quant
from quamba.ops.norm.qnorm import rmsnorm_quant
from quamba.ops.quant import (
    dequantize,
    quantize,
    quantize_weight,
    requant_multiplier,
    scale_from_range,
)
from quamba.ops.scan.qsscan import DtProjection, SSMParams, qsscan, qsscan_update


def codes(*shape, gen):
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


def quantize64(x, scale):
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8)


def assert_codes_close(actual, expected, max_fraction=1e-3):
    diff = (actual.int() - expected.int()).abs()
    assert diff.max() <= 1, f"codes differ by {int(diff.max())}"
    assert (diff > 0).float().mean() <= max_fraction


def test_rule_rounds_half_to_even_and_saturates():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 1000.0, -1000.0, 126.5])
    assert quantize(x, 1.0).tolist() == [0, 2, 2, 0, -2, 127, -127, 126]
    assert scale_from_range(0.0) > 0


@pytest.mark.parametrize("shape", [(1, 16, 32), (3, 17, 40), (2, 5, 64, 48), (7, 1, 96, 80)])
@pytest.mark.parametrize("int8_out", [True, False])
def test_w8a8_linear(shape, int8_out):
    gen = torch.Generator().manual_seed(hash(shape) % 1000)
    *lead, n, k = shape
    x, w = codes(*lead, k, gen=gen), codes(n, k, gen=gen)
    x_scale, w_scale, out_scale = 0.02, 0.003, 0.9
    out = w8a8_linear(x, x_scale, w, w_scale, out_scale if int8_out else None,
                      out_dtype=torch.float32)
    exact = (x.double() * x_scale) @ (w.double() * w_scale).t()
    if int8_out:
        assert out.dtype == torch.int8 and out.shape == (*lead, n)
        assert_codes_close(out, quantize64(exact, out_scale))
    else:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_w8a8_linear_per_channel_scale():
    gen = torch.Generator().manual_seed(3)
    x, w = codes(9, 64, gen=gen), codes(24, 64, gen=gen)
    w_scale = torch.rand(24, generator=gen) * 0.01 + 1e-3
    out = w8a8_linear(x, 0.05, w, w_scale, None, out_dtype=torch.float32)
    exact = (x.double() * 0.05) @ (w.double() * w_scale.double()[:, None]).t()
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def conv_reference(x, x_scale, w, w_scale, b, b_scale):
    """fp64 causal depthwise conv + bias + SiLU of the dequantized codes."""
    dim, width = w.shape
    xf, wf = x.double() * x_scale, w.double() * w_scale
    y = F.conv1d(xf, wf.unsqueeze(1), b.double() * b_scale, padding=width - 1, groups=dim)
    return F.silu(y[..., :x.shape[-1]])


@pytest.mark.parametrize("batch,dim,seqlen,width", [(1, 8, 1, 4), (2, 24, 37, 4), (3, 16, 5, 3),
                                                     (2, 32, 129, 2)])
def test_qconv1d(batch, dim, seqlen, width):
    gen = torch.Generator().manual_seed(batch * 1000 + seqlen)
    x, w, b = codes(batch, dim, seqlen, gen=gen), codes(dim, width, gen=gen), codes(dim, gen=gen)
    scales = dict(x_scale=0.03, w_scale=0.004, b_scale=0.002)
    expected = conv_reference(x, scales["x_scale"], w, scales["w_scale"], b, scales["b_scale"])
    out = qconv1d(x, scales["x_scale"], w, scales["w_scale"], b, scales["b_scale"], out_scale=0.01)
    assert_codes_close(out, quantize64(expected, 0.01))
    fp = qconv1d(x, scales["x_scale"], w, scales["w_scale"], b, scales["b_scale"], out_scale=None)
    torch.testing.assert_close(fp.double(), expected, rtol=1e-5, atol=1e-6)
    # the channel-last view the mixer passes gives the same result
    x_cl = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(qconv1d(x_cl, scales["x_scale"], w, scales["w_scale"], b,
                               scales["b_scale"], out_scale=0.01), out)


def test_qconv1d_update_chain_equals_prefill():
    gen = torch.Generator().manual_seed(5)
    batch, dim, seqlen, width = 2, 12, 9, 4
    x, w, b = codes(batch, dim, seqlen, gen=gen), codes(dim, width, gen=gen), codes(dim, gen=gen)
    args = (0.03, w, 0.004, b, 0.002)
    prefill = qconv1d(x, 0.03, w, 0.004, b, 0.002, out_scale=0.01)
    state = torch.zeros(batch, dim, width - 1, dtype=torch.int8)
    steps = [qconv1d_update(x[:, :, t], state, *args, out_scale=0.01) for t in range(seqlen)]
    assert torch.equal(torch.stack(steps, -1), prefill)
    assert torch.equal(state, x[:, :, -(width - 1):])


def scan_reference(u, delta, A, B, C, D, z):
    """Naive fp64 recurrence, one time step at a time."""
    batch, dim, seqlen = u.shape
    h = torch.zeros(batch, dim, A.shape[1], dtype=torch.float64)
    ys = []
    for t in range(seqlen):
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[..., None] \
            * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1) + D * u[:, :, t])
    return torch.stack(ys, -1) * F.silu(z), h


def random_ssm_params(dim, d_state, gen):
    A_log_q, A_log_scale = quantize_weight(torch.log(torch.rand(dim, d_state, generator=gen) * 15 + 1))
    D_q, D_scale = quantize_weight(torch.rand(dim, generator=gen) + 0.5)
    bias_q, bias_scale = quantize_weight(torch.randn(dim, generator=gen) - 3)
    return SSMParams(A_log_q, A_log_scale, D_q, D_scale, bias_q, bias_scale)


@pytest.mark.parametrize("batch,dim,d_state,seqlen", [(1, 8, 16, 1), (2, 16, 16, 33), (3, 6, 4, 300)])
def test_qsscan(batch, dim, d_state, seqlen):
    gen = torch.Generator().manual_seed(seqlen)
    p = random_ssm_params(dim, d_state, gen)
    u, dt, z = (codes(batch, dim, seqlen, gen=gen) for _ in range(3))
    B, C = codes(batch, d_state, seqlen, gen=gen), codes(batch, d_state, seqlen, gen=gen)
    s = dict(u=0.02, dt=0.01, bc=0.05, z=0.03)
    y, last = qsscan(u, s["u"], dt, s["dt"], B, s["bc"], C, s["bc"], z, s["z"], p,
                     out_dtype=torch.float32)
    A = -torch.exp(p.A_log.double() * p.A_log_scale)
    delta = F.softplus(dt.double() * s["dt"] + (p.dt_bias.double() * p.dt_bias_scale)[:, None])
    y_ref, h_ref = scan_reference(u.double() * s["u"], delta, A, B.double() * s["bc"],
                                  C.double() * s["bc"], p.D.double() * p.D_scale,
                                  z.double() * s["z"])
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(last.double(), h_ref, rtol=1e-4, atol=1e-5)
    state_scale = float(h_ref.abs().max()) / 127
    _, last_q = qsscan(u, s["u"], dt, s["dt"], B, s["bc"], C, s["bc"], z, s["z"], p,
                       state_scale=state_scale)
    assert_codes_close(last_q, quantize64(h_ref, state_scale))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int8])
def test_qsscan_update_chain_matches_prefill(state_dtype):
    gen = torch.Generator().manual_seed(11)
    batch, dim, d_state, seqlen = 2, 10, 16, 7
    p = random_ssm_params(dim, d_state, gen)
    u, dt, z = (codes(batch, dim, seqlen, gen=gen) for _ in range(3))
    B, C = codes(batch, d_state, seqlen, gen=gen), codes(batch, d_state, seqlen, gen=gen)
    scales = [0.02, 0.01, 0.05, 0.05, 0.03]
    y, last = qsscan(u, scales[0], dt, scales[1], B, scales[2], C, scales[3], z, scales[4], p,
                     out_dtype=torch.float32)
    state_scale = float(last.abs().max()) / 100  # headroom: earlier states may be larger
    state = torch.zeros(batch, dim, d_state, dtype=state_dtype)
    steps = [qsscan_update(state, state_scale, u[..., t], scales[0], dt[..., t], scales[1],
                           B[..., t], scales[2], C[..., t], scales[3], z[..., t], scales[4], p,
                           out_dtype=torch.float32) for t in range(seqlen)]
    steps = torch.stack(steps, -1)
    if state_dtype == torch.float32:
        torch.testing.assert_close(steps, y, rtol=1e-5, atol=1e-5)
    else:  # the int8 state is requantized every step: close, not equal
        assert (steps - y).norm() / y.norm() < 0.05


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("dt_rank", [7, 16])
def test_qsscan_update_folds_dt_proj(state_dtype, dt_rank):
    """dt_proj folded into the step is w8a8_linear (int8 out) then the step, bit for bit; its dt
    codes are the fp64 product's, requantized."""
    gen = torch.Generator().manual_seed(dt_rank)
    batch, dim, d_state = 3, 10, 16
    p = random_ssm_params(dim, d_state, gen)
    u, z = codes(batch, dim, gen=gen), codes(batch, dim, gen=gen)
    dt_low, B, C = codes(batch, dt_rank + 2 * d_state, gen=gen).split([dt_rank, d_state, d_state],
                                                                       dim=-1)
    weight, weight_scale = quantize_weight(torch.randn(dim, dt_rank, generator=gen))
    xdbl_scale, dt_scale, state_scale = 0.05, 0.02, 0.01
    dt = w8a8_linear(dt_low, xdbl_scale, weight, float(weight_scale), dt_scale)
    product = dt_low.double() @ weight.double().t() * xdbl_scale * float(weight_scale)
    assert_codes_close(dt, quantize64(product, dt_scale))
    state = (codes(batch, dim, d_state, gen=gen) if state_dtype == torch.int8
             else torch.randn(batch, dim, d_state, generator=gen))
    folded_state = state.clone()
    y = qsscan_update(state, state_scale, u, 0.02, dt, dt_scale, B, xdbl_scale, C, xdbl_scale, z,
                      0.03, p, out_dtype=torch.float32)
    projection = DtProjection(weight, requant_multiplier(xdbl_scale, float(weight_scale), dt_scale))
    y_folded = qsscan_update(folded_state, state_scale, u, 0.02, dt_low, dt_scale, B, xdbl_scale,
                             C, xdbl_scale, z, 0.03, p, out_dtype=torch.float32,
                             dt_proj=projection)
    assert torch.equal(y_folded, y)
    assert torch.equal(folded_state, state)


def test_qsscan_update_with_dt_proj_rejects_dt_of_the_wrong_shape():
    gen = torch.Generator().manual_seed(0)
    p = random_ssm_params(10, 16, gen)
    u, B = codes(2, 10, gen=gen), codes(2, 16, gen=gen)
    projection = DtProjection(codes(10, 8, gen=gen), 1e-3)
    with pytest.raises(QuambaError, match=r"^with dt_proj, dt must be dt_low's int8 codes "
                                          r"\[batch=2, dt_rank=8\], got torch.int8 \[2, 10\]$"):
        qsscan_update(torch.zeros(2, 10, 16), None, u, 0.02, u, 0.02, B, 0.05, B, 0.05, None, 1.0,
                      p, dt_proj=projection)
    with pytest.raises(QuambaError, match=r"^dt_proj.weight must be int8 \[d_inner=10, dt_rank\]"):
        qsscan_update(torch.zeros(2, 10, 16), None, u, 0.02, u[:, :8], 0.02, B, 0.05, B, 0.05,
                      None, 1.0, p, dt_proj=DtProjection(codes(12, 8, gen=gen), 1e-3))


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 7, 96), (3, 5, 384)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_quant(shape, with_residual):
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen).half()
    residual = torch.randn(shape, generator=gen) if with_residual else None
    weight = torch.rand(shape[-1], generator=gen) + 0.5
    q, res_out = rmsnorm_quant(x, residual, weight, 1e-5, out_scale=0.03)
    r = x.double() + (residual.double() if with_residual else 0)
    normed = r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert_codes_close(q, quantize64(normed, 0.03))
    torch.testing.assert_close(res_out.double(), r)
    assert res_out.dtype == torch.float32


@pytest.mark.parametrize("n", [64, 384, 1536])
def test_hadamard_quant(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, 5, n, generator=gen).half()
    rotated = x.double() @ hadamard_matrix(n)
    scale = float(rotated.abs().max()) / 127
    assert_codes_close(hadamard_quant(x, scale), quantize64(rotated, scale))


def test_dequantize_inverts_quantize_on_grid():
    gen = torch.Generator().manual_seed(0)
    q = codes(1000, gen=gen)
    assert torch.equal(quantize(dequantize(q, 0.0123), 0.0123), q)
    assert math.isclose(float(dequantize(torch.tensor([127], dtype=torch.int8), 0.5)), 63.5)
