"""The quantized model ends and the fp32 decode state on the GPU: an int8 lm_head (the W8A8
GEMM / GEMV with one weight scale per vocabulary row), an int4 lm_head and int8 embedding rows
against the torch backend, and decode with ``state_cache="fp32"`` on the scan kernels continuing
the prefill, for Mamba1 and Mamba2."""
import pytest
import torch

import quamba
from quamba.ops import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda")


def tokens(batch, seqlen, seed, vocab=4096):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randint(0, vocab, (batch, seqlen), device=DEVICE, generator=gen)


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_mamba2_dir"])
def fp_model(request):
    model, tokenizer = quamba.load_model(request.getfixturevalue(request.param), dtype="fp16",
                                         device="cuda")
    return model, tokenizer


def quantized(fp_model, **options):
    model, tokenizer = fp_model
    config = quamba.QuantConfig(group_size=64, calib_num_samples=8, calib_seqlen=128, **options)
    return quamba.quantize(model, tokenizer, config, calib_data=tokens(8, 128, seed=0),
                           progress=False)


def logits(model, ids, backend_name, monkeypatch):
    monkeypatch.setenv("QUAMBA_BACKEND", backend_name)
    with torch.inference_mode():
        return model(ids).float()


@pytest.mark.parametrize("bits,lm_head", [((8, 8), "int8"), ((4, 8), "int8"), ((8, 8), "int4")])
def test_quantized_ends_on_the_kernels_match_the_torch_backend(fp_model, bits, lm_head,
                                                               monkeypatch):
    qmodel = quantized(fp_model, w_bits=bits[0], a_bits=bits[1], lm_head=lm_head,
                       quantize_embedding=True)
    ids = tokens(3, 67, seed=1)
    with backend.recording() as ran:
        fast = logits(qmodel, ids, "cuda", monkeypatch)
    assert backend.on_reference(ran) == [], backend.summary(ran)
    reference = logits(qmodel, ids, "torch", monkeypatch)
    # the body's int8 roundings (one step here and there, test_cuda_end_to_end.py) reach the head
    assert (fast - reference).norm() / reference.norm() < 2e-2
    assert (fast.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95


def test_fp32_state_cache_decode_continues_the_prefill(fp_model):
    qmodel = quantized(fp_model)
    qmodel.set_state_cache("fp32")
    ids = tokens(2, 48, seed=2)
    with torch.inference_mode():
        full = qmodel(ids).float()
        cache = qmodel.allocate_cache(2)
        prefill = qmodel(ids[:, :40], cache=cache).float()
        steps = qmodel(ids[:, 40:], cache=cache).float()
    assert all(state.ssm.dtype == torch.float32 for state in cache.states)
    assert (prefill - full[:, :40]).norm() / full[:, :40].norm() < 2e-2
    assert (steps - full[:, 40:]).norm() / full[:, 40:].norm() < 5e-2
