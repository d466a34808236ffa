"""The Mamba2 int8 ops (quamba.ops.ssd.qssd) against the ops they generalise."""
import pytest
import torch

from quamba.ops.conv.qconv1d import qconv1d
from quamba.ops.quant import dequantize, quantize, quantize_weight
from quamba.ops.scan.qsscan import SSMParams
from quamba.ops.ssd.qssd import (
    qconv1d_channelwise,
    qconv1d_channelwise_update,
    qssd_scan,
    qssd_state_update,
)
from quamba.ops.ssd.ssd import ssd_scan, ssd_state_update
from tests.ops.standalone_backend import DEVICE, load_backend_file


def int8(*shape, generator):
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator)


def positive(*shape, generator, low=0.005, high=0.05):
    return low + (high - low) * torch.rand(*shape, generator=generator)


@pytest.mark.parametrize("batch,dim,seqlen,width", [(1, 6, 1, 4), (3, 10, 37, 4), (2, 5, 8, 3)])
@pytest.mark.parametrize("int8_out", [True, False])
def test_channelwise_conv_is_qconv1d_per_channel(batch, dim, seqlen, width, int8_out):
    g = torch.Generator().manual_seed(dim * seqlen)
    x, weight, bias = int8(batch, dim, seqlen, generator=g), int8(dim, width, generator=g), int8(dim, generator=g)
    x_scale, out_scale = positive(dim, generator=g), positive(dim, generator=g, low=0.01, high=0.1)
    out = qconv1d_channelwise(x, x_scale, weight, 0.01, bias, 0.02, out_scale if int8_out else None)
    for d in range(dim):
        expected = qconv1d(x[:, d:d + 1], float(x_scale[d]), weight[d:d + 1], 0.01, bias[d:d + 1],
                           0.02, float(out_scale[d]) if int8_out else None)
        assert torch.equal(out[:, d:d + 1], expected)


def test_channelwise_conv_update_chain_equals_prefill():
    g = torch.Generator().manual_seed(0)
    batch, dim, seqlen, width = 2, 12, 9, 4
    x, weight, bias = int8(batch, dim, seqlen, generator=g), int8(dim, width, generator=g), int8(dim, generator=g)
    x_scale, out_scale = positive(dim, generator=g), positive(dim, generator=g)
    prefill = qconv1d_channelwise(x, x_scale, weight, 0.01, bias, 0.02, out_scale)
    state = torch.zeros(batch, dim, width - 1, dtype=torch.int8)
    steps = [qconv1d_channelwise_update(x[..., t], state, x_scale, weight, 0.01, bias, 0.02, out_scale)
             for t in range(seqlen)]
    assert torch.equal(torch.stack(steps, dim=-1), prefill)


def ssd_case(batch, seqlen, nheads, headdim, ngroups, d_state, generator):
    """int8 x, dt, B, C with per-head-channel / per-group scales, and int8 SSM parameters."""
    g = generator
    inputs = dict(x=int8(batch, seqlen, nheads, headdim, generator=g),
                  x_scale=positive(nheads, headdim, generator=g),
                  dt=int8(batch, seqlen, nheads, generator=g), dt_scale=0.02,
                  B=int8(batch, seqlen, ngroups, d_state, generator=g),
                  B_scale=positive(ngroups, 1, generator=g),
                  C=int8(batch, seqlen, ngroups, d_state, generator=g),
                  C_scale=positive(ngroups, 1, generator=g))
    A_log, A_log_scale = quantize_weight(torch.log(torch.rand(nheads, generator=g) * 15 + 1))
    D, D_scale = quantize_weight(torch.rand(nheads, generator=g) + 0.5)
    dt_bias, dt_bias_scale = quantize_weight(torch.rand(nheads, generator=g) * 2 - 3)
    return inputs, SSMParams(A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale)


def dequantized(inputs):
    return [dequantize(inputs[name], inputs[name + "_scale"]) for name in ("x", "dt", "B", "C")]


@pytest.mark.parametrize("batch,seqlen,nheads,headdim,ngroups,d_state,chunk",
                         [(1, 1, 2, 4, 1, 8, 4), (2, 37, 6, 12, 2, 16, 8), (3, 20, 4, 8, 4, 5, 64)])
def test_qssd_scan_is_the_ssd_on_dequantized_inputs(batch, seqlen, nheads, headdim, ngroups,
                                                    d_state, chunk):
    inputs, params = ssd_case(batch, seqlen, nheads, headdim, ngroups, d_state,
                              torch.Generator().manual_seed(seqlen))
    y, state = qssd_scan(**inputs, params=params, chunk_size=chunk, out_dtype=torch.float32)
    x, dt, B, C = dequantized(inputs)
    A, D, dt_bias = params.dequantized()
    y_ref, state_ref = ssd_scan(x, dt, A, B, C, D, dt_bias, chunk)
    assert torch.equal(y, y_ref) and torch.equal(state, state_ref)
    _, state_q = qssd_scan(**inputs, params=params, chunk_size=chunk, state_scale=0.05)
    assert state_q.dtype == torch.int8 and torch.equal(state_q, quantize(state_ref, 0.05))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int8])
def test_qssd_update_chain_matches_prefill(state_dtype):
    batch, seqlen, nheads, headdim, ngroups, d_state = 2, 11, 4, 6, 2, 8
    inputs, params = ssd_case(batch, seqlen, nheads, headdim, ngroups, d_state,
                              torch.Generator().manual_seed(1))
    y_prefill, _ = qssd_scan(**inputs, params=params, chunk_size=4, out_dtype=torch.float32)
    state = torch.zeros(batch, nheads, headdim, d_state, dtype=state_dtype)
    steps = []
    for t in range(seqlen):
        step = {name: value[:, t] if isinstance(value, torch.Tensor) and name in ("x", "dt", "B", "C")
                else value for name, value in inputs.items()}
        steps.append(qssd_state_update(state, 0.5, **step, params=params, out_dtype=torch.float32))
    steps = torch.stack(steps, dim=1)
    if state_dtype == torch.float32:  # same arithmetic up to the chunked sum's order
        torch.testing.assert_close(steps, y_prefill, rtol=1e-4, atol=1e-4)
    else:  # the int8 state is requantized every step: close, not equal
        assert (steps - y_prefill).abs().max() < 0.1 * y_prefill.abs().max()


def test_qssd_update_on_floats_is_the_ssd_step():
    inputs, params = ssd_case(2, 1, 4, 6, 2, 8, torch.Generator().manual_seed(2))
    x, dt, B, C = (t[:, 0] for t in dequantized(inputs))
    state = torch.randn(2, 4, 6, 8)
    expected_state = state.clone()
    A, D, dt_bias = params.dequantized()
    expected = ssd_state_update(expected_state, x, dt, A, B, C, D, dt_bias)
    y = qssd_state_update(state, None, x, None, dt, None, B, None, C, None, params, torch.float32)
    assert torch.equal(y, expected) and torch.equal(state, expected_state)


def on_device(values) -> list:
    """The tensors among ``values`` on the kernels' device (DEVICE), the rest as they are."""
    return [v.to(DEVICE) if isinstance(v, torch.Tensor) else v for v in values]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("heads,headdim,groups,d_state", [(4, 6, 2, 8), (3, 20, 1, 40)])
@pytest.mark.parametrize("block_p", [None, 8, 64])
def test_step_kernel_matches_the_torch_step(state_dtype, heads, headdim, groups, d_state, block_p,
                                            monkeypatch):
    """The cuda backend's SSD step kernel (compiled on a GPU, under Triton's interpreter on a CPU),
    which dequantizes A_log, D and dt_bias itself, against the torch step: int8 state codes within
    one step, y within fp32 rounding, with a head's channels in blocks of 8, 16 (chosen) or 64. The
    FP path (fp32 parameters) is checked too."""
    kernels = load_backend_file(monkeypatch, "ssd/ssd_triton.py")
    monkeypatch.setattr(kernels, "STEP_BLOCK_P", block_p)

    inputs, params = ssd_case(2, 1, heads, headdim, groups, d_state,
                              torch.Generator().manual_seed(d_state))
    step = {name: value[:, 0] if name in ("x", "dt", "B", "C") else value
            for name, value in inputs.items()}
    if state_dtype == torch.int8:
        state = int8(2, heads, headdim, d_state, generator=torch.Generator().manual_seed(3))
    else:
        state = torch.randn(2, heads, headdim, d_state)
    reference_state, state = state.clone(), state.to(DEVICE)
    y = kernels._qssd_state_update_cuda(state, 0.05, *on_device(step.values()), params,
                                        torch.float32).cpu()
    y_ref = qssd_state_update(reference_state, 0.05, **step, params=params,
                              out_dtype=torch.float32, backend_name="torch")
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4 * float(y_ref.abs().max()))
    state = state.cpu()
    if state_dtype == torch.int8:
        assert int((state.int() - reference_state.int()).abs().max()) <= 1
    else:
        torch.testing.assert_close(state, reference_state, rtol=1e-5, atol=1e-5)
    x, dt, B, C = (t[:, 0] for t in dequantized(inputs))
    float_state = torch.randn(2, heads, headdim, d_state)
    expected_state, float_state = float_state.clone(), float_state.to(DEVICE)
    A, D, dt_bias = params.dequantized()
    expected = ssd_state_update(expected_state, x, dt, A, B, C, D, dt_bias)
    y_fp = kernels._ssd_state_update_cuda(float_state, *on_device((x, dt, A, B, C, D, dt_bias)))
    float_state = float_state.cpu()
    torch.testing.assert_close(y_fp.cpu(), expected, rtol=1e-4,
                               atol=1e-4 * float(expected.abs().max()))
    torch.testing.assert_close(float_state, expected_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seqlen", [0, 37])
def test_prefill_kernels_write_the_int8_last_state(seqlen, monkeypatch):
    """The cuda backend's SSD prefill (compiled on a GPU, under Triton's interpreter on a CPU)
    writes the decode cache's int8 last state in its state-passing pass: exactly ``quantize`` of
    the fp32 last state the same kernels give, with the same y."""
    kernels = load_backend_file(monkeypatch, "ssd/ssd_triton.py")
    inputs, params = ssd_case(2, seqlen, 3, 8, 1, 16, torch.Generator().manual_seed(seqlen))
    args = dict(zip(inputs, on_device(inputs.values())))
    y, state = kernels._qssd_scan_cuda(**args, params=params, chunk_size=256, state_scale=None,
                                       out_dtype=torch.float32)
    y8, codes = kernels._qssd_scan_cuda(**args, params=params, chunk_size=256, state_scale=0.003,
                                        out_dtype=torch.float32)
    assert codes.dtype == torch.int8 and torch.equal(y8, y)
    assert torch.equal(codes.cpu(), quantize(state.cpu(), 0.003))
    assert seqlen == 0 or int(codes.abs().max()) > 10  # the scale leaves codes to compare
