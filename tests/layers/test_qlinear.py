"""W4A16Linear: weight-only 4-bit linear layer against an fp64 reference."""
import pytest
import torch

from quamba.errors import QuambaError
from quamba.layers.qlinear import W4A16Linear
from quamba.ops.backend import BackendError


def random_weight(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) + 0.1) * 0.05


def reference_weight(weight, group_size):
    """fp64 W4A16 weight computed independently: fp16 scales absmax / 7, codes rne(w / s)."""
    n, k = weight.shape
    groups = weight.double().view(n, k // group_size, group_size)
    scales = (groups.abs().amax(-1, keepdim=True) / 7).half().double()
    codes = torch.round(groups / scales).clamp(-7, 7)
    return (codes * scales).view(n, k)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3),
                                             (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,k,group_size", [(48, 256, 128), (44, 384, 64), (24, 80, 128)])
def test_matches_fp64_reference(dtype, tolerance, n, k, group_size):
    weight = random_weight(n, k, seed=n + k)
    layer = W4A16Linear(k, n, group_size)
    layer.load_float_weight(weight)
    expected_weight = reference_weight(weight, layer.group_size)
    assert torch.equal(layer.dequantized_weight().double(), expected_weight)
    x = torch.randn(3, 7, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (3, 7, n)
    exact = x.double() @ expected_weight.t()
    torch.testing.assert_close(out.double(), exact, rtol=tolerance, atol=tolerance * 0.1)
    relative_weight_error = (expected_weight - weight.double()).norm() / weight.double().norm()
    assert relative_weight_error < 0.15


def test_buffers_and_given_codes():
    weight = random_weight(32, 256, seed=1)
    layer = W4A16Linear(256, 32, group_size=64)
    state = layer.state_dict()
    assert state["weight"].dtype == torch.uint8 and tuple(state["weight"].shape) == (32, 128)
    assert state["scales"].dtype == torch.float16 and tuple(state["scales"].shape) == (32, 4)
    codes = torch.randint(-7, 8, (32, 256), generator=torch.Generator().manual_seed(2),
                          dtype=torch.int8)
    layer.load_float_weight(weight, codes)
    scales = layer.scales.double().repeat_interleave(64, dim=1)
    assert torch.equal(layer.dequantized_weight().double(), codes.double() * scales)
    rtn = W4A16Linear(256, 32, group_size=64)
    rtn.load_float_weight(weight)
    assert torch.equal(rtn.scales, layer.scales)  # given codes use the RTN layer's scales


def test_bad_group_size_and_backend():
    with pytest.raises(QuambaError, match="not a multiple of the group size"):
        W4A16Linear(192, 8, group_size=128)
    layer = W4A16Linear(64, 8)
    layer.backend = "cuda"
    with pytest.raises(BackendError, match="w4a16_linear"):
        layer(torch.zeros(1, 64))


@pytest.mark.parametrize("weight_bits", [8, 4])
@pytest.mark.parametrize("mode", ["int8", "float-sim-asic-int8"])
def test_per_channel_output_scales_are_the_per_tensor_layer_per_channel(weight_bits, mode):
    """An int8 output with one scale per output channel (Quamba2's in_proj segments) gives, in
    each channel, what the layer with that channel's scale as its per-tensor scale gives."""
    from quamba.layers.qlinear import W4A8Linear, W8A8Linear
    n, k = 12, 64
    weight = random_weight(n, k, seed=3)
    out_scales = torch.linspace(0.002, 0.02, n)

    def layer(out_scale):
        if weight_bits == 4:
            built = W4A8Linear(k, n, 0.05, out_scale, group_size=32)
        else:
            built = W8A8Linear(k, n, 0.05, out_scale)
        built.load_float_weight(weight)
        built.set_mode(mode)
        return built

    gen = torch.Generator().manual_seed(4)
    x = torch.randint(-127, 128, (2, 5, k), dtype=torch.int8, generator=gen)
    if mode == "float-sim-asic-int8":
        x = x.float() * 0.05
    out = layer(out_scales)(x)
    assert out.dtype == (torch.int8 if mode == "int8" else torch.float32)
    for channel in range(n):
        expected = layer(float(out_scales[channel]))(x)[..., channel]
        assert torch.equal(out[..., channel], expected)
