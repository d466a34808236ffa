"""Falcon-Mamba's and Jamba's norms of dt, B and C (quamba.ops.norm.mixer_norm): the cuda
backend's Triton kernel (compiled on a GPU, under Triton's interpreter on a CPU) against the torch
reference, on the three slices of x_proj's output rows as the mixers pass them, and what makes
``auto`` keep the reference."""
import pytest
import torch

from quamba.ops import backend
from quamba.ops.norm.mixer_norm import kernel_lacks, mixer_rms_norm
from quamba.ops.quant import quantize
from tests.ops.standalone_backend import DEVICE, load_backend_file

MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
SMALLEST_EXPONENT = {torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s numbers at |x| (x in fp32)."""
    _, exponent = torch.frexp(x.abs())
    exponent = torch.clamp(exponent - 1, min=SMALLEST_EXPONENT[dtype])
    return torch.ldexp(torch.ones_like(x), exponent - MANTISSA_BITS[dtype])


def x_proj_output(shape, dt_rank, d_state, dtype, seed):
    """(dt_low, B, C): slices of one [..., dt_rank + 2 d_state] tensor, in x_proj's scale."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, dt_rank + 2 * d_state, generator=g) * 3
    return torch.split(rows.to(dtype), [dt_rank, d_state, d_state], dim=-1)


def norm_weights(dt_rank, d_state, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.rand(width, generator=g) + 0.5).to(dtype)
                 for width in (dt_rank, d_state, d_state))


def assert_within_ulps(got, expected, weighted):
    """fp32: 8 ulps (the sum of squares in another order, rsqrt approximated on a GPU); fp16 /
    bf16 without a weight: one ulp of their dtype. With a weight (up to 1.5), the norm's one ulp
    grows with it: 2 ulps of the product (seen on an H200: 1024-token cases past one ulp). Triton's
    interpreter (not a GPU) rounds each cast to bf16 towards zero: the norm one ulp low, grown by
    the weight, then the product one ulp low again, 3 ulps."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    expected = expected.float()
    half_ulps = 1 if not weighted else 2 if DEVICE.type == "cuda" else 3
    ulps = {torch.float32: 8, torch.float16: 2 if weighted else 1, torch.bfloat16: half_ulps}
    bound = ulp(expected, got.dtype) * ulps[got.dtype]
    assert ((got.float() - expected).abs() <= bound).all()


@pytest.mark.parametrize("shape,dt_rank,d_state",
                         [((1, 1), 8, 16), ((2, 7), 5, 3), ((3, 5), 33, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_matches_the_reference(shape, dt_rank, d_state, dtype, weighted, monkeypatch):
    """fp16 / bf16 within one ulp of their dtype (equal but where the fp32 norm lies next to a
    rounding boundary), fp32 within 8 ulps: the sum's order and rsqrt differ."""
    kernels = load_backend_file(monkeypatch, "norm/mixer_norm_triton.py")
    parts = x_proj_output(shape, dt_rank, d_state, dtype, seed=dt_rank)
    weights = norm_weights(dt_rank, d_state, dtype, seed=d_state) if weighted else None
    expected = mixer_rms_norm(*parts, 1e-5, backend_name="torch", weights=weights)
    got = kernels._mixer_rms_norm_cuda(
        *(part.to(DEVICE) for part in parts), 1e-5,
        None if weights is None else tuple(weight.to(DEVICE) for weight in weights))
    for got_part, expected_part in zip(got, expected):
        assert_within_ulps(got_part.cpu(), expected_part, weighted)
    if dtype == torch.float16:  # only values next to a rounding boundary may move
        differ = sum((g.cpu() != e).sum().item() for g, e in zip(got, expected))
        assert differ <= 0.05 * sum(e.numel() for e in expected)


@pytest.mark.parametrize("shape,dt_rank,d_state", [((2, 7), 5, 3), ((3, 5), 33, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_int8_codes_are_the_references_codes_of_the_kernels_floats(shape, dt_rank, d_state,
                                                                    dtype, weighted,
                                                                    monkeypatch):
    """With ``out_scale``: the codes quamba.ops.quant.quantize gives the kernel's own floats, bit
    for bit, so at most one step from the reference's codes (where the floats moved one ulp, less
    than a step here; two under the interpreter's bf16 with weights, 3 ulps off)."""
    kernels = load_backend_file(monkeypatch, "norm/mixer_norm_triton.py")
    parts = [part.to(DEVICE) for part in x_proj_output(shape, dt_rank, d_state, dtype, seed=7)]
    weights = norm_weights(dt_rank, d_state, dtype, seed=8) if weighted else None
    weights = None if weights is None else tuple(weight.to(DEVICE) for weight in weights)
    floats = kernels._mixer_rms_norm_cuda(*parts, 1e-5, weights)
    codes = kernels._mixer_rms_norm_cuda(*parts, 1e-5, weights, 0.013)
    reference = mixer_rms_norm(*(part.cpu() for part in parts), 1e-5, backend_name="torch",
                               weights=None if weights is None else [w.cpu() for w in weights],
                               out_scale=0.013)
    for got, own, expected in zip(codes, floats, reference):
        assert got.dtype == torch.int8 and got.shape == expected.shape
        assert torch.equal(got.cpu(), quantize(own.cpu(), 0.013))
        steps = 2 if dtype == torch.bfloat16 and weighted and DEVICE.type != "cuda" else 1
        assert (got.cpu().int() - expected.int()).abs().max() <= steps
    assert any((part.abs() == 127).any() for part in reference)  # some saturate


def test_fp32_weights_promote_a_half_input(monkeypatch):
    """Jamba's weights in fp32 under an fp16 input: the product in fp32, as the reference's."""
    kernels = load_backend_file(monkeypatch, "norm/mixer_norm_triton.py")
    parts = x_proj_output((2, 3), 6, 4, torch.float16, seed=3)
    weights = norm_weights(6, 4, torch.float32, seed=4)
    expected = mixer_rms_norm(*parts, 1e-6, backend_name="torch", weights=weights)
    got = kernels._mixer_rms_norm_cuda(*(p.to(DEVICE) for p in parts), 1e-6,
                                       tuple(w.to(DEVICE) for w in weights))
    for got_part, expected_part in zip(got, expected):
        assert got_part.dtype == torch.float32
        torch.testing.assert_close(got_part.cpu(), expected_part, rtol=2e-3, atol=0)


def test_empty_rows_launch_nothing(monkeypatch):
    kernels = load_backend_file(monkeypatch, "norm/mixer_norm_triton.py")
    parts = x_proj_output((2, 0), 4, 2, torch.float16, seed=0)
    assert [p.shape for p in kernels._mixer_rms_norm_cuda(*parts, 1e-5)] == [p.shape for p in parts]


def test_mismatched_parts_keep_the_reference():
    dt_low, B, C = x_proj_output((2, 3), 4, 2, torch.float16, seed=0)
    assert kernel_lacks((dt_low, B, C), None) is None
    assert "dtype" in kernel_lacks((dt_low, B.float(), C), None)
    assert "fp32, fp16 or bf16" in kernel_lacks((dt_low.double(), B.double(), C.double()), None)
    assert "leading" in kernel_lacks((dt_low, B[:1], C), None)
    weights = norm_weights(4, 2, torch.float16, seed=0)
    assert "weights" in kernel_lacks((dt_low, B, C), (weights[0].float(),) + weights[1:])


def test_the_op_is_a_quantized_op_strict_counts():
    """mixer_rms_norm has a kernel of quamba's own: ``python -m quamba.env --strict`` counts it,
    and on a GPU it needs quamba._C's kernel modules as every other one does."""
    assert "mixer_rms_norm" in backend.quamba_ops()
    assert backend.resolve("mixer_rms_norm", torch.device("cpu")) == (
        "torch", "its inputs are on cpu, not a CUDA device")
