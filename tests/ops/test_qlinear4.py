"""W4A8 and W4A16 linear ops (torch backend) against fp64 references of the dequantized values."""
import pytest
import torch

from quamba.ops.linear.qlinear4 import w4a8_linear, w4a16_linear, w4a16_linear_channel_major
from quamba.ops.quant4 import (
    dequantize_int4,
    effective_scales,
    expand_groups,
    pack_int4,
    quantize_weight_w4a8,
    quantize_weight_w4a16,
)


def random_weight(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) + 0.1) * 0.05


@pytest.mark.parametrize("lead,n,k", [((1,), 16, 128), ((3, 7), 24, 256), ((5,), 8, 80),
                                      ((2, 9), 40, 512)])
@pytest.mark.parametrize("int8_out", [True, False])
def test_w4a8_linear_matches_fp64(lead, n, k, int8_out):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randint(-127, 128, (*lead, k), generator=gen, dtype=torch.int8)
    packed, multiplier, channel_scale, size = quantize_weight_w4a8(random_weight(n, k, k))
    x_scale, out_scale = 0.02, 0.05
    out = w4a8_linear(x, x_scale, packed, multiplier, channel_scale, size,
                      out_scale if int8_out else None, out_dtype=torch.float32)
    weight = dequantize_int4(packed, effective_scales(channel_scale, multiplier), size).double()
    exact = (x.double() * x_scale) @ weight.t()
    assert out.shape == (*lead, n)
    if int8_out:
        expected = torch.round(exact / out_scale).clamp(-127, 127)
        diff = (out.double() - expected).abs()
        assert diff.max() <= 1 and (diff > 0).double().mean() < 1e-2
    else:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-6)


def test_w4a8_linear_runs_multipliers_of_old_checkpoints():
    """Checkpoints written before the cap of 18 hold multipliers up to 127: the reference op
    stays exact for them."""
    gen = torch.Generator().manual_seed(4)
    n, k, size = 16, 256, 64
    x = torch.randint(-127, 128, (5, k), generator=gen, dtype=torch.int8)
    codes = torch.randint(-7, 8, (n, k), generator=gen, dtype=torch.int8)
    multiplier = torch.randint(1, 128, (n, k // size), generator=gen, dtype=torch.int8)
    channel_scale = torch.rand(n, generator=gen) * 1e-3
    out = w4a8_linear(x, 0.02, pack_int4(codes), multiplier, channel_scale, size,
                      out_dtype=torch.float32)
    weight = codes.double() * expand_groups(multiplier.double(), size)
    exact = (x.double() @ weight.t()) * 0.02 * channel_scale.double()
    assert multiplier.max() > 18
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 9, 37])
def test_w4a16_linear_channel_major_is_the_transpose(dtype, m):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, 256, generator=gen).to(dtype)
    packed, scales, size = quantize_weight_w4a16(random_weight(48, 256, 8))
    out = w4a16_linear_channel_major(x, packed, scales, size)
    assert out.dtype == dtype and out.shape == (48, m)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, w4a16_linear(x, packed, scales, size).t(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_linear_matches_fp64(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 256, generator=gen).to(dtype)
    packed, scales, size = quantize_weight_w4a16(random_weight(32, 256, 7))
    out = w4a16_linear(x, packed, scales, size)
    exact = x.double() @ dequantize_int4(packed, scales, size).double().t()
    assert out.dtype == dtype and out.shape == (3, 5, 32)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), exact, rtol=tolerance, atol=tolerance)
