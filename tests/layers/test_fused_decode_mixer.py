"""The quantized Mamba1 mixer's fused decode step (QMambaMixer.fuses_decode, qmixer_ssm_step)
on the trained test model: through the torch backend it is the unfused step bit for bit; with
the op's Triton kernels (under Triton's interpreter on the CPU) greedy decoding picks the same
tokens as the unfused step. tests/ops/test_cuda_fused_decode.py does the same on a GPU. The
unfused step folds dt_proj into its scan step (qsscan_update's dt_proj) up to batch 8, bit for
bit."""
import os

import pytest
import torch

import quamba
from quamba.calibrate import load_calibration_set
from quamba.layers.qmixer import FOLD_DT_PROJ_MAX_BATCH, QMambaMixer
from quamba.ops import backend
from quamba.ops.fused_decode.mixer_step import OP

CALIB_SAMPLES, CALIB_SEQLEN = 8, 128
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def fp_model(tiny_model_dir):
    return quamba.load_model(tiny_model_dir)


def _quantized(fp_model, shared_data_dir, **config):
    model, tokenizer = fp_model
    calib = load_calibration_set(str(shared_data_dir / "text" / "c4_sample.jsonl"), tokenizer,
                                 CALIB_SAMPLES, CALIB_SEQLEN, seed=0)
    return quamba.quantize(model, tokenizer, quamba.QuantConfig(**config), calib_data=calib,
                           progress=False)


@pytest.fixture(scope="module")
def w8a8(fp_model, shared_data_dir):
    return _quantized(fp_model, shared_data_dir)


@pytest.fixture(scope="module")
def w4a8(fp_model, shared_data_dir):
    return _quantized(fp_model, shared_data_dir, w_bits=4, a_bits=8, group_size=64)


@pytest.fixture
def prompt(fp_model):
    _, tokenizer = fp_model
    ids = tokenizer(["The history of the city", "In the first year of the war, the"])["input_ids"]
    width = min(map(len, ids))
    return torch.tensor([row[:width] for row in ids])


def mixers(model):
    return [m for m in model.modules() if isinstance(m, QMambaMixer)]


def decode_logits(model, prompt, steps: int):
    """Logits [batch, steps, vocab] of ``steps`` decode steps fed the prompt's greedy tokens."""
    cache = model.allocate_cache(prompt.shape[0])
    with torch.no_grad():
        logits = model(prompt, cache=cache)[:, -1:]
        out = [logits]
        for _ in range(steps - 1):
            logits = model(logits.argmax(-1), cache=cache)
            out.append(logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("recipe", ["w8a8", "w4a8"])
@pytest.mark.parametrize("state_cache", ["int8", "fp32"])
def test_the_fused_step_on_the_torch_backend_is_the_unfused_step(request, recipe, state_cache,
                                                                  prompt):
    model = request.getfixturevalue(recipe)
    model.set_state_cache(state_cache)
    try:
        with backend.recording() as ran:
            fused = decode_logits(model.set_fused_decode(True), prompt, 8)
        assert ran[OP] == {"torch"}
        with backend.recording() as ran:
            unfused = decode_logits(model.set_fused_decode(False), prompt, 8)
        assert OP not in ran
    finally:
        model.set_state_cache("int8").set_fused_decode(False)
    assert torch.equal(fused, unfused)


def test_the_switch_and_where_the_step_fuses(w8a8):
    assert not any(m.fused_decode or m.fuses_decode() for m in mixers(w8a8))  # off by default
    w8a8.set_fused_decode(True)
    try:
        assert all(m.fuses_decode() for m in mixers(w8a8))
        mixer = mixers(w8a8)[0]
        for mode in ("fp32-ssm-input", "fp32-conv", "float-sim-asic-int8"):
            mixer.set_mode(mode)
            assert not mixer.fuses_decode(), mode
        mixer.set_mode("int8")
        mixer.discretization = "foh"
        assert not mixer.fuses_decode()
        mixer.discretization = "zoh"
        assert mixer.fuses_decode()
    finally:
        w8a8.set_fused_decode(False)


@pytest.mark.parametrize("recipe", ["w8a8", "w4a8"])
def test_the_unfused_step_folds_dt_proj_into_the_scan_bit_for_bit(request, recipe, prompt,
                                                                  monkeypatch):
    model = request.getfixturevalue(recipe)
    mixer = mixers(model)[0]
    assert mixer._step_dt_projection(FOLD_DT_PROJ_MAX_BATCH) is not None
    assert mixer._step_dt_projection(FOLD_DT_PROJ_MAX_BATCH + 1) is None
    mixer.set_mode("fp32-ssm-input")  # its scan takes dt as floats: dt_proj runs on its own
    try:
        assert mixer._step_dt_projection(1) is None
    finally:
        mixer.set_mode("int8")
    folded = decode_logits(model, prompt, 8)
    monkeypatch.setattr(QMambaMixer, "_step_dt_projection", lambda self, batch: None)
    assert torch.equal(folded, decode_logits(model, prompt, 8))


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernels: needs a CUDA device or TRITON_INTERPRET=1")
@pytest.mark.parametrize("recipe", ["w8a8", "w4a8"])
def test_greedy_tokens_of_the_fused_kernels_are_the_unfused_steps(request, recipe, prompt,
                                                                  monkeypatch):
    """The op's Triton kernels stand in for its torch backend (the CPU has no cuda backend):
    greedy decoding picks the unfused reference steps' tokens, and their logits agree closely
    (the kernels' int8 codes may differ by one step where exp rounds differently)."""
    from quamba.ops.fused_decode import mixer_step_triton
    model = request.getfixturevalue(recipe)
    unfused = decode_logits(model.set_fused_decode(False), prompt, NEW_TOKENS)
    monkeypatch.setitem(backend._IMPLS[OP], "torch", mixer_step_triton.ssm_step)
    try:
        fused = decode_logits(model.set_fused_decode(True), prompt, NEW_TOKENS)
    finally:
        model.set_fused_decode(False)
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))
    assert (fused - unfused).norm() / unfused.norm() < 1e-3  # equal here, on numpy's exp
