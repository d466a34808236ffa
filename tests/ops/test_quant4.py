"""The 4-bit weight format: rule, two-level scales, packing."""
import pytest
import torch

from quamba.errors import QuambaError
from quamba.ops.quant4 import (W4A8_MAX_MULTIPLIER, dequantize_int4, effective_scales,
                               expand_groups, group_scales, group_size_for, pack_int4,
                               quantize_int4, quantize_weight_w4a8, quantize_weight_w4a16,
                               two_level_scales, unpack_int4)


def test_pack_unpack_roundtrip_and_byte_layout():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-7, 8, (5, 64), generator=gen, dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert torch.equal(unpack_int4(packed), codes)
    byte = pack_int4(torch.tensor([[-1, 3]], dtype=torch.int8))
    assert byte.item() == 0x3F  # even k in the low nibble, two's complement
    with pytest.raises(QuambaError, match="odd number"):
        pack_int4(torch.zeros(1, 3, dtype=torch.int8))


def test_group_size_rules():
    assert group_size_for(80) == 80
    assert group_size_for(5120) == 128
    with pytest.raises(QuambaError, match="not a multiple"):
        group_size_for(200)


def test_codes_follow_the_symmetric_rule():
    weight = torch.tensor([[0.7, -0.35, 0.05, -0.7]])
    scales = group_scales(weight, 4)
    assert torch.allclose(scales, torch.tensor([[0.1]]))
    assert quantize_int4(weight, scales, 4).tolist() == [[7, -4, 0, -7]]  # -3.5 rounds to even


@pytest.mark.parametrize("shape", [(16, 128), (24, 512), (8, 80)])
def test_w4a8_two_level_scales_stay_close(shape):
    gen = torch.Generator().manual_seed(shape[1])
    weight = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen)
    packed, multiplier, channel_scale, size = quantize_weight_w4a8(weight)
    scales = effective_scales(channel_scale, multiplier)
    assert multiplier.min() >= 1 and multiplier.max() <= 18
    exact = group_scales(weight, size)
    unclamped = multiplier > 1
    half_step = 0.5 * channel_scale[:, None].expand_as(exact)
    assert ((scales - exact).abs() <= half_step * (1 + 1e-6))[unclamped].all()
    restored = dequantize_int4(packed, scales, size)
    error = (restored - weight).norm() / weight.norm()
    assert error < 0.15  # 4-bit RTN of Gaussian weights: about 0.1 (larger groups: larger)
    assert unpack_int4(packed).abs().max() <= 7


def test_w4a16_codes_use_the_fp16_scales():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 256, generator=gen)
    packed, scales, size = quantize_weight_w4a16(weight)
    assert scales.dtype == torch.float16 and size == 128
    assert torch.equal(unpack_int4(packed), quantize_int4(weight, scales.float(), size))


def test_two_level_scales_of_equal_groups_are_exact():
    scales = torch.full((3, 4), 0.25)
    channel, multiplier = two_level_scales(scales)
    assert multiplier.eq(18).all()
    torch.testing.assert_close(effective_scales(channel, multiplier), scales)


def test_multiplier_cap_keeps_expanded_weights_in_int8():
    """code · multiplier is the int8 weight the W4A8 GEMM runs on: it must lie in [-127, 127],
    also for groups whose scales span orders of magnitude (multipliers clamp to 1 and 18)."""
    assert W4A8_MAX_MULTIPLIER == 18
    gen = torch.Generator().manual_seed(3)
    group_gains = 10.0 ** torch.empty(64, 8).uniform_(-3, 0, generator=gen)
    weight = torch.randn(64, 8 * 32, generator=gen) * expand_groups(group_gains, 32)
    packed, multiplier, _, size = quantize_weight_w4a8(weight, group_size=32)
    assert multiplier.min() == 1 and multiplier.max() == 18
    expanded = unpack_int4(packed).int() * expand_groups(multiplier.int(), size)
    assert expanded.abs().max() <= 127
    assert expanded.abs().max() == 7 * 18  # the largest group of a channel uses the full range


def test_multiplier_rule():
    channel, multiplier = two_level_scales(torch.tensor([[1.8, 0.94, 0.5, 0.01]]))
    torch.testing.assert_close(channel, torch.tensor([0.1]))
    assert multiplier.tolist() == [[18, 9, 5, 1]]  # channel scale = max / 18; tiny groups clamp to 1
