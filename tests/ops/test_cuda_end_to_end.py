"""End to end on the GPU: the quantized test model with the cuda backend against the torch backend.

The text comes from this repository's own sources (the GPU machine has no shared data folder):
it is English-like enough to give realistic activations for calibration and comparison.
"""
from pathlib import Path

import pytest
import torch

import quamba
from quamba.ops.backend import cuda_missing, used_backends

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "tests" / "fixtures" / "tiny-mamba"
W8A8_OPS = ("w8a8_linear", "qconv1d", "qconv1d_update", "qsscan", "qsscan_update", "rmsnorm_quant",
            "hadamard_quant")
WHY_NOT = ("needs a CUDA device" if not torch.cuda.is_available()
           else next(filter(None, map(cuda_missing, W8A8_OPS)), None))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]


def repository_paragraphs() -> list[str]:
    texts = [p.read_text() for p in sorted((REPO / "quamba").rglob("*.py"))]
    texts.append((REPO / "README.md").read_text())
    return [block for text in texts for block in text.split("\n\n") if len(block) > 200]


@pytest.fixture(scope="module")
def quantized():
    model, tokenizer = quamba.load_model(TINY_MODEL, dtype="fp16", device="cuda")
    paragraphs = repository_paragraphs()
    config = quamba.QuantConfig(calib_num_samples=16, calib_seqlen=256)
    qmodel = quamba.quantize(model, tokenizer, config, calib_data=paragraphs[::2], progress=False)
    tokens = tokenizer("\n\n".join(paragraphs[1::2]))["input_ids"][: 8 * 512]
    ids = torch.tensor(tokens, device="cuda").view(8, 512)
    return qmodel, ids


def logits_with(qmodel, backend, ids, monkeypatch, mode="int8"):
    monkeypatch.setenv("QUAMBA_BACKEND", backend)
    qmodel.set_ssm_mode(mode)
    with torch.no_grad():
        return qmodel(ids).float()


# Logit gap between the reference's first and second choice below which a position is a near-tie.
NEAR_TIE = 0.05


@pytest.mark.parametrize("mode", ["int8", "fp32-ssm-input", "fp32-conv"])
def test_cuda_and_torch_backends_agree(quantized, monkeypatch, mode):
    """Top-1 agreement ≥ 99.9% on every position that is not a near-tie, ≥ 98.5% overall.

    The small test model is unsure of much of this text: on the CPU, 9% of positions have a
    top-2 logit gap under 0.05, and two float formulations of the same int8 arithmetic (modes
    int8 and float-sim-asic-int8) already disagree on 0.5% of positions, all of them near-ties.
    The kernels differ from the reference by such roundings (one int8 step here and there), so
    the strict bound applies where the reference has decided. The text is this repository's
    sources, so its share of near-ties moves as they change: adding the layer kernel's sources
    took the overall agreement in int8 mode from at least 99% to 98.999% (4055 of 4096 positions,
    an H200), while the bound on decided positions held."""
    qmodel, ids = quantized
    reference = logits_with(qmodel, "torch", ids, monkeypatch, mode)
    fast = logits_with(qmodel, "cuda", ids, monkeypatch, mode)
    same = fast.argmax(-1) == reference.argmax(-1)
    top2 = reference.topk(2, dim=-1).values
    decided = top2[..., 0] - top2[..., 1] > NEAR_TIE
    assert same[decided].float().mean().item() >= 0.999, f"mode {mode}"
    assert same.float().mean().item() >= 0.985, f"mode {mode}"
    assert (fast - reference).norm() / reference.norm() < 2e-2
    assert "cuda" in used_backends()["qsscan"]


def test_cuda_decode_follows_cuda_prefill(quantized, monkeypatch):
    qmodel, ids = quantized
    ids = ids[:4, :160]
    monkeypatch.setenv("QUAMBA_BACKEND", "cuda")
    qmodel.set_ssm_mode("int8")
    with torch.no_grad():
        full = qmodel(ids)
        cache = qmodel.allocate_cache(4)
        steps = [qmodel(ids[:, :128], cache=cache)]
        steps += [qmodel(ids[:, t:t + 1], cache=cache) for t in range(128, 160)]
    steps = torch.cat(steps, 1)
    assert (steps[:, :128].argmax(-1) == full[:, :128].argmax(-1)).float().mean() == 1.0
    # decode requantizes the int8 SSM state each step; the prefill scan keeps it in fp32
    assert (steps[:, 128:].argmax(-1) == full[:, 128:].argmax(-1)).float().mean() >= 0.85


def test_cuda_backend_generates(quantized, monkeypatch):
    """Greedy generation on the cuda backend picks, at every step, the torch backend's first choice
    given the same tokens before it, or a token within NEAR_TIE of it. (Comparing the two
    generations token by token fails on the first near-tie: from there on the prefixes differ.)"""
    qmodel, ids = quantized
    prompt, new_tokens = ids[:2, :32], 16
    monkeypatch.setenv("QUAMBA_BACKEND", "cuda")
    qmodel.set_ssm_mode("int8")
    out = qmodel.generate(prompt, max_new_tokens=new_tokens, eos_token_id=-1)
    assert out.shape == (2, 32 + new_tokens) and torch.equal(out[:, :32], prompt)
    monkeypatch.setenv("QUAMBA_BACKEND", "torch")
    with torch.no_grad():  # the torch backend's decode steps along the cuda backend's tokens
        cache = qmodel.allocate_cache(2)
        logits = [qmodel(prompt, cache=cache)[:, -1:]]
        logits += [qmodel(out[:, t:t + 1], cache=cache) for t in range(32, 32 + new_tokens - 1)]
    logits = torch.cat(logits, 1).float()
    gap = logits.max(-1).values - logits.gather(-1, out[:, 32:, None]).squeeze(-1)
    assert float(gap.max()) <= NEAR_TIE, f"gaps to the torch backend's first choice: {gap.tolist()}"


# rk4 is left out: this model's steps reach Δa ≈ -8.3 (measured on CPU), where rk4's
# Ā = 1 + z + z²/2 + z³/6 + z⁴/24 ≈ 130, so its state grows without bound and two correct
# summation orders part ways (the H100 run of 7169e1b failed this test for rk4, and the FP model's
# rk4 logits are NaN on this text). tests/ops/test_cuda_ssm.py checks rk4's kernels at stable steps.
@pytest.mark.parametrize("method", ["zoh-exact", "bilinear", "foh"])
def test_cuda_runs_every_discretization(quantized, monkeypatch, method):
    """The quantized mixers switched to another discretization (calibrated with zoh: this checks
    the kernels, not the method): the cuda prefill agrees with the torch one, and cuda decode
    steps continue the cuda prefill (foh from the prefill's last drive)."""
    qmodel, ids = quantized
    ids = ids[:4, :160]
    for mixer in (m for m in qmodel.modules() if hasattr(m, "discretization")):
        monkeypatch.setattr(mixer, "discretization", method)
    reference = logits_with(qmodel, "torch", ids, monkeypatch)
    assert reference.isfinite().all(), method
    full = logits_with(qmodel, "cuda", ids, monkeypatch)
    assert (full - reference).norm() / reference.norm() < 2e-2
    assert "cuda" in used_backends()["qsscan"]
    with torch.no_grad():
        cache = qmodel.allocate_cache(4)
        steps = [qmodel(ids[:, :128], cache=cache)]
        steps += [qmodel(ids[:, t:t + 1], cache=cache) for t in range(128, 160)]
    steps = torch.cat(steps, 1)
    assert (steps[:, 128:].argmax(-1) == full[:, 128:].argmax(-1)).float().mean() >= 0.85
    assert "cuda" in used_backends()["qsscan_update"]
