"""The input quantizers' Triton kernels (quamba.ops.linear.input_quant_triton) on the GPU against
the torch reference run on the CPU (the specification): codes and scales bit for bit at
Nemotron-H-8B's linear inputs (hidden 4096: the static attention / MLP inputs; intermediate
21504: the per-token down_proj input) and Falcon-Mamba-7B's (d_inner 8192: out_proj's input
without rotation; d_state 16: B and C), decode and 1024-token prefills at batch 1 and 8.

(torch's own CUDA division by a Python number multiplies by its reciprocal, so the reference run
on a GPU can differ from the CPU's by an ulp of a per-token scale; the kernel divides as the
CPU does.)"""
import pytest
import torch

from quamba.ops import backend
from quamba.ops.linear.input_quant import quantize_per_tensor, quantize_per_token

OPS = ("quantize_per_tensor", "quantize_per_token")
WHY_NOT = ("needs a CUDA device" if not torch.cuda.is_available()
           else next(filter(None, map(backend.cuda_missing, OPS)), None))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]
DEVICE = torch.device("cuda")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOKENS = [(1, 1), (8, 1), (1, 1024), (8, 1024)]  # (batch, tokens): decode, prefill


def activations(batch, tokens, width, dtype, seed):
    """Random activations with a few large channels, as the linears' inputs have."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(batch, tokens, width, device=DEVICE, generator=gen)
    x[..., ::97] *= 30
    return x.to(dtype)


@pytest.mark.parametrize("batch,tokens", TOKENS)
@pytest.mark.parametrize("width,activation", [(4096, None), (21504, None), (8192, None),
                                              (21504, "relu2"), (14336, "swiglu")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_codes_and_scales_equal_the_reference(batch, tokens, width, activation, dtype,
                                                        monkeypatch):
    """relu2: Nemotron-H-8B's MLP activation, applied by the quantizer of down_proj's input;
    swiglu: Bamba-9B's (silu's exp is libdevice's here, as torch's CUDA silu's, and the CPU
    reference's own: within one code step)."""
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    x = activations(batch, tokens, width, dtype, seed=width + tokens)
    up = activations(batch, tokens, width, dtype, seed=width + 1) if activation == "swiglu" else None
    with backend.recording() as ran:
        codes, scales = quantize_per_token(x, activation=activation, up=up)
    assert backend.summary(ran) == {"quantize_per_token": "cuda"}
    expected_codes, expected_scales = quantize_per_token(
        x.cpu(), backend_name="torch", activation=activation, up=None if up is None else up.cpu())
    assert scales.shape == (batch, tokens, 1) and scales.dtype == torch.float32
    if activation == "swiglu":
        assert torch.allclose(scales.cpu(), expected_scales, rtol=2 ** -7, atol=0)
        assert (codes.cpu().int() - expected_codes.int()).abs().max() <= 1
        return
    assert torch.equal(scales.cpu(), expected_scales)
    assert torch.equal(codes.cpu(), expected_codes)


@pytest.mark.parametrize("batch,tokens", TOKENS)
@pytest.mark.parametrize("width,scale", [(4096, 0.031), (8192, 0.0123), (16, 0.0079)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_codes_equal_the_reference(batch, tokens, width, scale, dtype, monkeypatch):
    """The scales saturate the large channels (|x| up to ~120 against 127 · scale)."""
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    x = activations(batch, tokens, width, dtype, seed=width + tokens + 1)
    with backend.recording() as ran:
        codes = quantize_per_tensor(x, scale)
    assert backend.summary(ran) == {"quantize_per_tensor": "cuda"}
    assert torch.equal(codes.cpu(), quantize_per_tensor(x.cpu(), scale, backend_name="torch"))


def test_strided_rows_and_the_torch_backend_on_the_gpu(monkeypatch):
    """Rows that are a slice of wider rows (B of x_proj's output); QUAMBA_BACKEND=torch runs the
    reference on the GPU instead, whose codes agree (same per-tensor reciprocal)."""
    wide = activations(3, 37, 256 + 32, torch.float16, seed=3)
    B = wide[..., 256:272]
    expected = quantize_per_tensor(B.cpu(), 0.02, backend_name="torch")
    assert torch.equal(quantize_per_tensor(B, 0.02).cpu(), expected)
    monkeypatch.setenv("QUAMBA_BACKEND", "torch")
    with backend.recording() as ran:
        on_gpu = quantize_per_tensor(B, 0.02)
    assert backend.summary(ran) == {"quantize_per_tensor": "torch"}
    assert torch.equal(on_gpu.cpu(), expected)
