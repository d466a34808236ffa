"""The norms of dt, B and C in one Triton launch (quamba.ops.norm.mixer_norm_triton) on the GPU
against the torch reference run on the CPU: Falcon-Mamba-7B's and Jamba's sizes (dt_rank 256,
d_state 16), decode and 1024-token prefills at batch 1 and 8, fp16 / bf16 / fp32, without and with
the three weights. fp16 and bf16 outputs within one ulp of their dtype (the norm's sum is reduced
in another order and rsqrt is the GPU's approximation: only values next to a rounding boundary
move), fp32 within 8 ulps; the int8 codes the quantized mixer asks for are quamba.ops.quant's
codes of the kernel's floats, so within one step of the reference's."""
import pytest
import torch

from quamba.ops import backend
from quamba.ops.norm.mixer_norm import mixer_rms_norm
from quamba.ops.quant import quantize
from tests.ops.test_mixer_norm import assert_within_ulps, norm_weights, x_proj_output

WHY_NOT = ("needs a CUDA device" if not torch.cuda.is_available()
           else backend.cuda_missing("mixer_rms_norm"))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]
DEVICE = torch.device("cuda")


@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 1), (1, 1024), (8, 1024), (3, 37)])
@pytest.mark.parametrize("dt_rank,d_state", [(256, 16), (160, 16), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_matches_the_reference(batch, tokens, dt_rank, d_state, dtype, weighted,
                                      monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    parts = x_proj_output((batch, tokens), dt_rank, d_state, dtype, seed=tokens + dt_rank)
    weights = norm_weights(dt_rank, d_state, dtype, seed=d_state) if weighted else None
    expected = mixer_rms_norm(*parts, 1e-5, backend_name="torch", weights=weights)
    with backend.recording() as ran:
        got = mixer_rms_norm(*(part.to(DEVICE) for part in parts), 1e-5,
                             weights=None if weights is None
                             else tuple(weight.to(DEVICE) for weight in weights))
    assert backend.summary(ran) == {"mixer_rms_norm": "cuda"}
    moved = 0
    for got_part, expected_part in zip(got, expected):
        assert_within_ulps(got_part.cpu(), expected_part, weighted)
        moved += (got_part.cpu() != expected_part).sum().item()
    if dtype != torch.float32:
        assert moved <= 0.01 * sum(part.numel() for part in expected)


@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 1), (8, 1024)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_int8_codes_are_one_step_from_the_reference(batch, tokens, dtype, weighted, monkeypatch):
    """Falcon-Mamba-7B's sizes; scale 0.02 saturates the largest normalized values."""
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    parts = x_proj_output((batch, tokens), 256, 16, dtype, seed=tokens)
    weights = norm_weights(256, 16, dtype, seed=1) if weighted else None
    on_gpu = [part.to(DEVICE) for part in parts]
    gpu_weights = None if weights is None else tuple(weight.to(DEVICE) for weight in weights)
    floats = mixer_rms_norm(*on_gpu, 1e-5, weights=gpu_weights)
    codes = mixer_rms_norm(*on_gpu, 1e-5, weights=gpu_weights, out_scale=0.02)
    expected = mixer_rms_norm(*parts, 1e-5, backend_name="torch", weights=weights,
                              out_scale=0.02)
    for got, own, reference in zip(codes, floats, expected):
        assert got.dtype == torch.int8
        assert torch.equal(got.cpu(), quantize(own.cpu(), 0.02))
        assert (got.cpu().int() - reference.int()).abs().max() <= 1


def test_parts_of_other_dtypes_run_the_reference_on_the_gpu():
    dt_low, B, C = (part.to(DEVICE) for part in x_proj_output((2, 5), 8, 4, torch.float16, 0))
    with backend.recording() as ran:
        mixer_rms_norm(dt_low, B.float(), C, 1e-5)
    assert backend.summary(ran) == {"mixer_rms_norm": "torch"}
