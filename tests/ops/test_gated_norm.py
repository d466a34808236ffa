"""Mamba2's gated RMSNorm (quamba.ops.norm.gated_norm): the output dtype, and the cuda backend's
Triton kernel (compiled on a GPU, under Triton's interpreter on a CPU) against the torch reference
on strided inputs as the quantized mixer passes them."""
import pytest
import torch

from quamba.ops.norm.gated_norm import gated_rms_norm
from quamba.ops.norm.qhadamard import gated_norm_hadamard_quant, hadamard_quant
from tests.ops.standalone_backend import DEVICE, load_backend_file


def test_out_dtype_is_the_norm_of_the_fp32_input():
    """fp16 y normed to fp32 equals the norm of y.float() (the reference computes in fp32 either
    way): the quantized mixer asks for fp32 instead of casting y first, one copy less a step."""
    g = torch.Generator().manual_seed(0)
    y, z = torch.randn(2, 3, 12, generator=g).half(), torch.randn(2, 3, 12, generator=g)
    weight = torch.rand(12, generator=g)
    normed = gated_rms_norm(y, z, weight, 4, 1e-5, out_dtype=torch.float32)
    assert normed.dtype == torch.float32
    assert torch.equal(normed, gated_rms_norm(y.float(), z, weight, 4, 1e-5))
    assert gated_rms_norm(y, z, weight, 4, 1e-5).dtype == torch.float16


@pytest.mark.parametrize("rows,dim,group_size", [(1, 40, 40), (3, 48, 16), (5, 30, 10)])
@pytest.mark.parametrize("int8_z", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_kernel_matches_the_reference_on_strided_rows(rows, dim, group_size, int8_z, out_dtype,
                                                      monkeypatch):
    kernels = load_backend_file(monkeypatch, "norm/gated_norm_triton.py")
    g = torch.Generator().manual_seed(rows * dim)
    y = torch.randn(rows, dim, generator=g).half()
    # z as the mixer passes it: a slice of in_proj's wider output rows
    projected = (torch.randint(-127, 128, (rows, dim + 7), generator=g, dtype=torch.int8)
                 if int8_z else torch.randn(rows, dim + 7, generator=g))
    z, z_scale = projected[:, 3:3 + dim], (0.02 if int8_z else None)
    for weight in (torch.rand(dim, generator=g) + 0.5, None):
        expected = gated_rms_norm(y, z, weight, group_size, 1e-5, z_scale, out_dtype,
                                  backend_name="torch")
        got = kernels._gated_rms_norm_cuda(
            y.to(DEVICE), z.to(DEVICE), None if weight is None else weight.to(DEVICE), group_size,
            1e-5, z_scale, out_dtype)
        assert got.dtype == out_dtype and got.shape == expected.shape
        tolerance = 1e-5 if out_dtype == torch.float32 else 1e-3
        torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=tolerance,
                                   atol=tolerance)


def test_gated_norm_hadamard_quant_is_the_chain():
    """The one-op form of Quamba2's out_proj input is, in the torch reference, exactly the gated
    norm in fp32 followed by hadamard_quant; z must be int8 codes of y's shape."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 40, generator=g).half()
    z = torch.randint(-127, 128, (3, 40), generator=g, dtype=torch.int8)
    weight = torch.rand(40, generator=g) + 0.5
    normed = gated_rms_norm(y, z, weight, 20, 1e-5, 0.03, torch.float32)
    expected = hadamard_quant(normed, 0.02)
    assert torch.equal(gated_norm_hadamard_quant(y, z, 0.03, weight, 20, 1e-5, 0.02), expected)
    with pytest.raises(ValueError, match="z must be int8 codes"):
        gated_norm_hadamard_quant(y, z.float(), 0.03, weight, 20, 1e-5, 0.02)
