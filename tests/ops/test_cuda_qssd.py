"""The per-channel-scale conv kernels of Mamba2's xBC (qconv1d_channelwise and its update) against
their torch reference: int8 codes equal, fp32 outputs within 1e-4 relative."""
import pytest
import torch

from quamba.ops.qssd import qconv1d_channelwise, qconv1d_channelwise_update

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
    """[batch, dim, seqlen] codes as the module passes them (a transposed view of in_proj's
    [batch, seqlen, ·] output, channel-last) or contiguous."""
    if layout == "module":
        return xbc.transpose(1, 2).contiguous().transpose(1, 2)
    return xbc.contiguous()


@pytest.mark.parametrize("layout", ["module", "contiguous"])
@pytest.mark.parametrize("batch,dim,seqlen,width", [(1, 1792, 1024, 4), (3, 200, 37, 4), (2, 40, 9, 3)])
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
