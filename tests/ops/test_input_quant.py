"""The int8 quantizers of a linear's float input (quamba.ops.linear.input_quant): the references
follow quamba.ops.quant's rule, and the cuda backend's Triton kernel (compiled on a GPU, under
Triton's interpreter on a CPU) writes the same codes and scales bit for bit, on strided rows,
odd widths, rows wider than one block, ties and saturated values; per token also of relu(x)² and
of silu(x) · up, which the reference computes as the float MLPs do (SwiGLU's within one code step:
the interpreter's exp is numpy's, not torch's)."""
import pytest
import torch

from quamba.errors import QuambaError
from quamba.ops.linear.input_quant import (activated, per_token_scales, quantize_per_tensor,
                                           quantize_per_token, relu2)
from quamba.ops.quant import INT8_MAX, SCALE_FLOOR, quantize, reciprocal, to_fp32
from tests.ops.standalone_backend import DEVICE, load_backend_file

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rows(shape, dtype, seed, extra=0):
    """Random activations with outliers, [*shape]; with ``extra`` channels more on each side of
    the rows' storage, as a slice of a wider tensor (strided rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape[:-1], shape[-1] + 2 * extra, generator=g)
    x[..., ::7] *= 20
    return x.to(dtype)[..., extra:extra + shape[-1]]


def test_per_token_scales_are_each_rows_floored_absmax_over_127():
    x = torch.tensor([[0.0, -2.54, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float16)
    scales = per_token_scales(x)
    assert scales.dtype == torch.float32 and scales.shape == (2, 1)
    assert scales[0, 0].item() == to_fp32(float(torch.tensor(2.54, dtype=torch.float16)) / 127)
    assert scales[1, 0].item() == to_fp32(SCALE_FLOOR / INT8_MAX)
    codes, same = quantize_per_token(x, backend_name="torch")
    assert torch.equal(same, scales) and torch.equal(codes, quantize(x, scales))
    assert codes[0].tolist() == [0, -127, 50] and codes[1].tolist() == [0, 0, 0]


def test_bad_input_is_one_line_error():
    with pytest.raises(QuambaError, match="x must be a float tensor"):
        quantize_per_token(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(QuambaError, match="x must be a float tensor"):
        quantize_per_tensor(torch.tensor(1.0), 0.1)
    with pytest.raises(QuambaError, match="scale must be positive"):
        quantize_per_tensor(torch.ones(3), 0.0)
    with pytest.raises(QuambaError, match="activation must be one of"):
        quantize_per_token(torch.ones(3), activation="gelu")
    with pytest.raises(QuambaError, match="up goes with activation 'swiglu' alone"):
        quantize_per_token(torch.ones(3), activation="swiglu")
    with pytest.raises(QuambaError, match="up must be x's"):
        quantize_per_token(torch.ones(3), activation="swiglu", up=torch.ones(4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_swiglu_reference_quantizes_the_float_mlps_product(dtype):
    gate, up = rows((3, 50), dtype, seed=3), rows((3, 50), dtype, seed=4)
    codes, scales = quantize_per_token(gate, backend_name="torch", activation="swiglu", up=up)
    product = torch.nn.functional.silu(gate) * up
    assert torch.equal(activated(gate, "swiglu", up), product)
    assert torch.equal(codes, quantize_per_token(product, backend_name="torch")[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_relu2_reference_quantizes_relu2s_output(dtype):
    x = rows((3, 50), dtype, seed=2)
    codes, scales = quantize_per_token(x, backend_name="torch", activation="relu2")
    expected_codes, expected_scales = quantize_per_token(relu2(x), backend_name="torch")
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    assert relu2(x).dtype == dtype and torch.equal(relu2(x), (x.float().relu() ** 2).to(dtype))


@pytest.mark.parametrize("shape,extra", [((1, 7), 0), ((2, 5, 33), 3), ((3, 4103), 0)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu2", "swiglu"])
def test_per_token_kernel_equals_the_reference(shape, extra, dtype, activation, monkeypatch):
    """4103 channels: two blocks of the kernel's loop, the second one nearly empty. SwiGLU's up
    is a strided slice too."""
    kernels = load_backend_file(monkeypatch, "linear/input_quant_triton.py")
    x = rows(shape, dtype, seed=shape[-1], extra=extra)
    x[0, ..., :] = 0  # an all-zero row: the floored scale
    up = rows(shape, dtype, seed=shape[-1] + 5, extra=extra) if activation == "swiglu" else None
    codes, scales = quantize_per_token(x, backend_name="torch", activation=activation, up=up)
    got_codes, got_scales = kernels._quantize_per_token_cuda(
        x.to(DEVICE), activation, None if up is None else up.to(DEVICE))
    assert got_codes.dtype == torch.int8 and got_scales.dtype == torch.float32
    if activation == "swiglu":  # silu's exp: numpy's here, libdevice's (torch's) on a GPU
        assert torch.allclose(got_scales.cpu(), scales, rtol=2 ** -7, atol=0)
        assert (got_codes.cpu().int() - codes.int()).abs().max() <= 1
    else:
        assert torch.equal(got_scales.cpu(), scales) and torch.equal(got_codes.cpu(), codes)


@pytest.mark.parametrize("shape,extra", [((1, 7), 0), ((2, 5, 33), 3), ((3, 4103), 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_kernel_equals_the_reference(shape, extra, dtype, monkeypatch):
    """A scale that saturates the outliers (127 · 0.05 = 6.35)."""
    kernels = load_backend_file(monkeypatch, "linear/input_quant_triton.py")
    x = rows(shape, dtype, seed=shape[-1] + 1, extra=extra)
    x[..., -1] = -9.0
    expected = quantize_per_tensor(x, 0.05, backend_name="torch")
    assert (expected.abs() == INT8_MAX).any()
    assert torch.equal(kernels._quantize_per_tensor_cuda(x.to(DEVICE), 0.05).cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_round_half_to_even(dtype, monkeypatch):
    """x · fp32(1/scale) exactly k + 0.5 for a scale of 0.5: codes round to the even neighbour,
    in both kernels (per token: a row whose absmax sets the scale to 0.5)."""
    kernels = load_backend_file(monkeypatch, "linear/input_quant_triton.py")
    ties = torch.tensor([0.25, 0.75, -1.25, 2.25, -0.25, 63.5], dtype=dtype)
    expected = torch.tensor([0, 2, -2, 4, 0, 127], dtype=torch.int8)
    assert reciprocal(0.5) == 2.0
    assert torch.equal(kernels._quantize_per_tensor_cuda(ties.to(DEVICE), 0.5).cpu(), expected)
    assert torch.equal(quantize_per_tensor(ties, 0.5, backend_name="torch"), expected)
    row = torch.cat([ties[:-1], torch.tensor([63.5], dtype=dtype)])
    codes, scales = kernels._quantize_per_token_cuda(row.to(DEVICE))
    assert scales.item() == to_fp32(63.5 / 127) == 0.5 and torch.equal(codes.cpu(), expected)


def test_empty_rows_launch_nothing(monkeypatch):
    kernels = load_backend_file(monkeypatch, "linear/input_quant_triton.py")
    codes, scales = kernels._quantize_per_token_cuda(torch.zeros(2, 0, 16, device=DEVICE))
    assert codes.shape == (2, 0, 16) and scales.shape == (2, 0, 1)
    assert kernels._quantize_per_tensor_cuda(torch.zeros(0, 16, device=DEVICE), 0.1).shape == (0, 16)
