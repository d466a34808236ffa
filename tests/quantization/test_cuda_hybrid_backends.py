"""Quantized Falcon-Mamba and Nemotron-H on the GPU (small random models, W8A8 and W4A8): the
norms of dt, B and C (with their int8 codes) and the int8 input quantizers of the hybrids'
linears run their Triton kernels (op_backends records a prefill and a decode step), and
the model's logits stay finite on them. Nemotron-H's small widths (hidden 36) also take its FP
conv through causal-conv1d's kernel where installed, on a view whose strides that kernel's
channel-last path refuses (quamba.ops.fp_kernels). Every hybrid family at kernel sizes:
test_cuda_quantize_hybrids.py."""
import pytest
import torch

import quamba
from quamba.ops import backend
from tests.models.test_falcon_mamba import random_falcon_mamba
from tests.models.test_nemotron_h import HF_CONFIG, random_reference

NEW_OPS = ("mixer_rms_norm", "quantize_per_tensor", "quantize_per_token")
WHY_NOT = ("needs a CUDA device" if not torch.cuda.is_available()
           else next(filter(None, map(backend.cuda_missing, NEW_OPS)), None))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]
DEVICE = torch.device("cuda")
FALCON_SHAPE = dict(hidden_size=128, num_hidden_layers=2, vocab_size=256, state_size=16,
                    time_step_rank=16)


def ids(vocab, batch, seqlen, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randint(0, vocab, (batch, seqlen), device=DEVICE, generator=gen)


def quantized(reference, directory, vocab, w_bits):
    reference.save_pretrained(directory)
    model, _ = quamba.load_model(directory, dtype="fp16", device="cuda", tokenizer=False)
    return quamba.quantize(model, None, quamba.QuantConfig(w_bits=w_bits),
                           calib_data=ids(vocab, 8, 64, seed=0), progress=False)


@pytest.fixture(scope="module", params=[8, 4], ids=["w8a8", "w4a8"])
def falcon(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("falcon-cuda")
    return quantized(random_falcon_mamba(**FALCON_SHAPE), directory, FALCON_SHAPE["vocab_size"],
                     request.param)


@pytest.fixture(scope="module", params=[8, 4], ids=["w8a8", "w4a8"])
def nemotron(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("nemotron-cuda")
    return quantized(random_reference(), directory, HF_CONFIG["vocab_size"], request.param)


def finite_logits(model, tokens) -> bool:
    with torch.inference_mode():
        return bool(model(tokens).float().isfinite().all())


def test_falcon_mamba_norms_and_codes_run_their_kernels(falcon, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    ran = falcon.op_backends()
    assert ran["mixer_rms_norm"] == "cuda"
    assert finite_logits(falcon, ids(FALCON_SHAPE["vocab_size"], 3, 41, seed=1))


def test_nemotron_h_input_quantizers_run_their_kernels(nemotron, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    ran = nemotron.op_backends()
    assert ran["quantize_per_tensor"] == "cuda" and ran["quantize_per_token"] == "cuda"
    assert "mixer_rms_norm" not in ran  # Mamba2 layers: no norms of dt, B and C
    assert finite_logits(nemotron, ids(HF_CONFIG["vocab_size"], 2, 37, seed=1))
