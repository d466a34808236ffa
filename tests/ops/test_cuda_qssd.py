"""Mamba2's int8 kernels against their torch references: the per-channel-scale conv over xBC
(qconv1d_channelwise and its update: int8 codes equal, fp32 outputs within 1e-4 relative) and the
Triton SSD (qssd_scan: products in fp16 for int8 inputs, in tf32 for fp32 ones, so within 3e-3 of
the output's range; qssd_state_update: fp32, summation order apart)."""
import pytest
import torch

from quamba.ops.quant import dequantize, quantize_weight
from quamba.ops.scan.qsscan import SSMParams
from quamba.ops.ssd.qssd import (
    qconv1d_channelwise,
    qconv1d_channelwise_update,
    qssd_scan,
    qssd_state_update,
)
from quamba.ops.ssd.ssd import ssd_scan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda")


def codes(*shape, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randint(-127, 128, shape, dtype=torch.int8, device=DEVICE, generator=gen)


def channel_scales(dim, seed, low, high):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return low + (high - low) * torch.rand(dim, device=DEVICE, generator=gen)


def conv_case(dim, width, seed):
    return dict(x_scale=channel_scales(dim, seed, 0.005, 0.05), weight=codes(dim, width, seed=seed + 1),
                weight_scale=0.004, bias=codes(dim, seed=seed + 2), bias_scale=0.01)


def in_layout(xbc, layout):
    """[batch, dim, seqlen] codes as the module passes them ("slice": a transposed view of xBC's
    channels inside in_proj's wider [batch, seqlen, ·] output rows), channel-last on their own
    ("channel_last") or contiguous."""
    if layout == "slice":
        batch, dim, seqlen = xbc.shape
        rows = torch.zeros(batch, seqlen, 32 + dim + 16, dtype=xbc.dtype, device=xbc.device)
        rows[..., 32:32 + dim] = xbc.transpose(1, 2)
        return rows[..., 32:32 + dim].transpose(1, 2)
    if layout == "channel_last":
        return xbc.transpose(1, 2).contiguous().transpose(1, 2)
    return xbc.contiguous()


# (1, 1792, 1024) and (2, 64, 48) take the vector kernels in every layout, (3, 200, 37) and
# (2, 40, 9) the scalar ones.
@pytest.mark.parametrize("layout", ["slice", "channel_last", "contiguous"])
@pytest.mark.parametrize("batch,dim,seqlen,width",
                         [(1, 1792, 1024, 4), (2, 64, 48, 3), (3, 200, 37, 4), (2, 40, 9, 3)])
@pytest.mark.parametrize("int8_out", [True, False])
def test_channelwise_conv_matches_the_reference(layout, batch, dim, seqlen, width, int8_out):
    case = conv_case(dim, width, seed=dim + seqlen)
    x = in_layout(codes(batch, dim, seqlen, seed=seqlen), layout)
    out_scale = channel_scales(dim, seed=7, low=0.01, high=0.04) if int8_out else None
    fast, reference = (qconv1d_channelwise(x, out_scale=out_scale, backend_name=name, **case)
                       for name in ("cuda", "torch"))
    if int8_out:
        assert fast.dtype == torch.int8 and int(fast.min()) >= -127
        assert int((fast != reference).sum()) == 0
    else:
        torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch,dim,width", [(1, 1792, 4), (8, 200, 4), (3, 40, 2)])
def test_channelwise_update_chain_equals_the_prefill(batch, dim, width):
    case = conv_case(dim, width, seed=dim)
    out_scale = channel_scales(dim, seed=8, low=0.01, high=0.04)
    seqlen = 12
    x = codes(batch, dim, seqlen, seed=batch)
    prefill = qconv1d_channelwise(x, out_scale=out_scale, backend_name="cuda", **case)
    state = torch.zeros(batch, dim, width - 1, dtype=torch.int8, device=DEVICE)
    reference_state = state.clone()
    for t in range(seqlen):
        step = qconv1d_channelwise_update(x[..., t], state, out_scale=out_scale, backend_name="cuda", **case)
        reference = qconv1d_channelwise_update(x[..., t], reference_state, out_scale=out_scale,
                                               backend_name="torch", **case)
        assert torch.equal(step, prefill[..., t]) and torch.equal(step, reference), f"step {t}"
    assert torch.equal(state, reference_state)


def ssd_inputs(batch, seqlen, nheads, headdim, ngroups, d_state, seed):
    """int8 x, dt, B, C with per-channel / per-group scales on the GPU, and int8 SSM parameters."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(x=codes(batch, seqlen, nheads, headdim, seed=seed),
                  x_scale=channel_scales(nheads * headdim, seed, 0.005, 0.05).view(nheads, headdim),
                  dt=codes(batch, seqlen, nheads, seed=seed + 1), dt_scale=0.02,
                  B=codes(batch, seqlen, ngroups, d_state, seed=seed + 2),
                  B_scale=channel_scales(ngroups, seed + 3, 0.005, 0.05).view(ngroups, 1),
                  C=codes(batch, seqlen, ngroups, d_state, seed=seed + 4),
                  C_scale=channel_scales(ngroups, seed + 5, 0.005, 0.05).view(ngroups, 1))
    params = [quantize_weight(values.to(DEVICE)) for values in (
        torch.log(torch.rand(nheads, generator=gen) * 15 + 1), torch.rand(nheads, generator=gen) + 0.5,
        torch.rand(nheads, generator=gen) * 2 - 3)]
    return inputs, SSMParams(*params[0], *params[1], *params[2])


SSD_SHAPES = [(1, 2048, 24, 64, 1, 128), (2, 300, 8, 48, 2, 32), (3, 37, 4, 12, 2, 16), (1, 1, 2, 8, 1, 5)]


@pytest.mark.parametrize("batch,seqlen,nheads,headdim,ngroups,d_state", SSD_SHAPES)
@pytest.mark.parametrize("floats", [False, True])
def test_ssd_kernel_matches_the_reference(batch, seqlen, nheads, headdim, ngroups, d_state, floats):
    inputs, params = ssd_inputs(batch, seqlen, nheads, headdim, ngroups, d_state, seed=seqlen)
    if floats:  # the fp32-ssm-input mode passes dequantized floats
        for name in ("x", "dt", "B", "C"):
            inputs[name] = dequantize(inputs[name], inputs[name + "_scale"])
    results = {name: qssd_scan(**inputs, params=params, out_dtype=torch.float32, backend_name=name)
               for name in ("cuda", "torch")}
    (y, state), (y_ref, state_ref) = results["cuda"], results["torch"]
    torch.testing.assert_close(y, y_ref, rtol=1e-3, atol=3e-3 * float(y_ref.abs().max()))
    torch.testing.assert_close(state, state_ref, rtol=1e-3, atol=3e-3 * float(state_ref.abs().max()))


@pytest.mark.parametrize("batch,seqlen,nheads,headdim,ngroups,d_state", SSD_SHAPES[1:])
def test_ssd_step_kernel_continues_the_prefill(batch, seqlen, nheads, headdim, ngroups, d_state):
    inputs, params = ssd_inputs(batch, seqlen + 3, nheads, headdim, ngroups, d_state, seed=seqlen + 1)
    y_all, _ = qssd_scan(**inputs, params=params, out_dtype=torch.float32, backend_name="cuda")
    prefix = {k: v[:, :seqlen] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
    _, state = qssd_scan(**prefix, params=params, out_dtype=torch.float32, backend_name="cuda")
    reference_state = state.clone()
    for t in range(seqlen, seqlen + 3):
        step = {k: v[:, t] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
        y = qssd_state_update(state, None, **step, params=params, out_dtype=torch.float32,
                              backend_name="cuda")
        y_ref = qssd_state_update(reference_state, None, **step, params=params,
                                  out_dtype=torch.float32, backend_name="torch")
        scale = float(y_all[:, t].abs().max())
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4 * scale)
        torch.testing.assert_close(y, y_all[:, t], rtol=1e-3, atol=3e-3 * scale)
    int8_state = torch.zeros(batch, nheads, headdim, d_state, dtype=torch.int8, device=DEVICE)
    reference_int8 = int8_state.clone()
    step = {k: v[:, 0] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
    qssd_state_update(int8_state, 0.05, **step, params=params, backend_name="cuda")
    qssd_state_update(reference_int8, 0.05, **step, params=params, backend_name="torch")
    assert int((int8_state.int() - reference_int8.int()).abs().max()) <= 1


@pytest.mark.parametrize("batch,seqlen,nheads,headdim,ngroups,d_state", [
    (2, 700, 8, 64, 2, 128), (1, 513, 4, 32, 1, 256), (3, 90, 6, 20, 3, 40)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp_ssd_kernel_matches_the_reference(batch, seqlen, nheads, headdim, ngroups, d_state, dtype):
    """The FP model's ssd_scan on the same kernels (products in its input dtype, tf32 for fp32),
    carrying an initial state, against the reference on the same inputs."""
    gen = torch.Generator(device=DEVICE).manual_seed(seqlen)
    def randn(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)
    x, dt = randn(batch, seqlen, nheads, headdim).to(dtype), randn(batch, seqlen, nheads).to(dtype)
    B, C = (randn(batch, seqlen, ngroups, d_state).to(dtype) for _ in range(2))
    A, D, dt_bias = -torch.rand(nheads, device=DEVICE, generator=gen) * 4, randn(nheads), randn(nheads) - 2
    initial = randn(batch, nheads, headdim, d_state)
    (y, state), (y_ref, state_ref) = (
        ssd_scan(x, dt, A, B, C, D, dt_bias, 256, initial_state=initial, backend_name=name)
        for name in ("cuda", "torch"))
    assert y.dtype == dtype and state.dtype == torch.float32
    ulp = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-3}[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=ulp, atol=3 * ulp * float(y_ref.abs().max()))
    torch.testing.assert_close(state, state_ref, rtol=ulp, atol=3 * ulp * float(state_ref.abs().max()))
