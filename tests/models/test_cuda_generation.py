"""Generation on the GPU: the CUDA-graph decode path gives the eager path's tokens, for the FP16
test model (on mamba-ssm's kernels where installed) and the W8A8 one (quamba's kernels)."""
from copy import deepcopy

import pytest
import torch

import quamba
from quamba.models.generation import graphed_decoder
from quamba.models.mamba import step_ssm_A
from quamba.ops import fp_kernels
from quamba.ops.backend import cuda_extension_error, used_backends

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def fp_model(tiny_model_dir):
    model, _ = quamba.load_model(tiny_model_dir, dtype="fp16", device="cuda", tokenizer=False)
    return model


@pytest.fixture(scope="module")
def w8a8_model(fp_model):
    if cuda_extension_error() is not None:
        pytest.skip(cuda_extension_error())
    calib = torch.randint(0, fp_model.config.vocab_size, (8, 128), device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(0))
    return quamba.quantize(fp_model, config=quamba.QuantConfig(), calib_data=calib, progress=False)


def prompts(batch: int, length: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 4000, (batch, length), device="cuda", generator=gen)


@pytest.mark.parametrize("batch", [1, 3, 8, 40])  # 40: in_proj and dt_proj on CUTLASS's wgmma
@pytest.mark.parametrize("which", ["fp", "w8a8"])
def test_graph_decode_gives_the_eager_tokens(request, which, batch):
    model = request.getfixturevalue(f"{which}_model")
    for seed in (0, 1):  # the second generation replays the graph captured by the first
        ids = prompts(batch, 37 + seed, seed)
        eager = model.generate(ids, max_new_tokens=24)
        graphed = model.generate(ids, max_new_tokens=24, cache_graph=True)
        assert torch.equal(eager, graphed)


@pytest.mark.parametrize("which", ["fp", "w8a8"])
def test_graph_decode_stops_at_eos_as_the_eager_path(request, which):
    """Graphed decoding checks for every row having finished every few tokens, the eager path
    after each one: the same tokens, eos where rows stopped, both cut where all had."""
    model = request.getfixturevalue(f"{which}_model")
    ids = prompts(2, 21, 2)
    free = model.generate(ids, max_new_tokens=30, eos_token_id=-1)[:, 21:]
    for eos in {int(free[0, 3]), int(free[0, 12]), int(free[1, 20])}:
        eager = model.generate(ids, max_new_tokens=30, eos_token_id=eos)
        graphed = model.generate(ids, max_new_tokens=30, eos_token_id=eos, cache_graph=True)
        assert torch.equal(eager, graphed)


def test_step_ssm_A_equals_each_mixers_own_A_on_the_gpu(fp_model):
    """The multi-tensor exp and neg of the decode step give each mixer's -exp(A_log) to the bit."""
    layers = fp_model.backbone.layers
    for block, A in zip(layers, step_ssm_A(layers)):
        assert A.is_cuda and torch.equal(A, -torch.exp(block.mixer.A_log.float()))


def test_fp_model_runs_mamba_ssm_kernels_when_installed(fp_model):
    fp_model.generate(prompts(2, 16, 0), max_new_tokens=2)
    expected = "torch" if fp_kernels.missing() else "cuda"
    for op in ("selective_scan", "selective_state_update", "causal_conv1d", "causal_conv1d_update",
               "rms_norm"):
        assert expected in used_backends()[op], op


def test_fp_kernels_agree_with_the_reference(fp_model, monkeypatch):
    if fp_kernels.missing():
        pytest.skip(fp_kernels.missing())
    ids = prompts(2, 200, 3)
    with torch.no_grad():
        fast = fp_model(ids).float()
        monkeypatch.setenv("QUAMBA_BACKEND", "torch")
        reference = fp_model(ids).float()
    assert (fast - reference).norm() / reference.norm() < 1e-2
    assert (fast.argmax(-1) == reference.argmax(-1)).float().mean() > 0.98


def test_graphed_decoder_is_kept_per_batch_size(fp_model):
    cache, step = graphed_decoder(fp_model, 2, "cuda")
    assert graphed_decoder(fp_model, 2, "cuda")[1] is step
    assert graphed_decoder(fp_model, 4, "cuda")[1] is not step


def test_a_copy_of_the_model_captures_its_own_graphs(fp_model):
    graphed_decoder(fp_model, 2, "cuda")
    copy = deepcopy(fp_model)
    assert graphed_decoder(copy, 2, "cuda")[0] is not graphed_decoder(fp_model, 2, "cuda")[0]
