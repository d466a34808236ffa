"""Falcon-Mamba (the norms of dt, B and C) quantized W8A8, W4A8 and W4A16 on the torch reference:
every SSM mode, decoding, checkpoints, the norm op's backend, what its recipes refuse."""
import json
import sys
from pathlib import Path

import pytest
import torch

import quamba
from quamba.errors import QuambaError
from quamba.ops import backend
from quamba.quantization.checkpoint import MIXER_NORMS_FORMAT_VERSION

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_falcon_mamba import max_relative_error, random_falcon_mamba  # noqa: E402

from tests.ops.standalone_backend import kernels_for_references  # noqa: E402
from tests.quantization.hybrid_checks import prefill_and_step  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, vocab_size=128, state_size=16, time_step_rank=8)
RECIPES = {"w8a8": {}, "w4a8": dict(w_bits=4, group_size=32),
           "w4a16": dict(w_bits=4, a_bits=16, group_size=32)}
# measured on this model: W8A8 0.043, W4A8 0.105, W4A16 0.127 (see docs/checkpoints.md)
MAX_ERROR = {"w8a8": 0.08, "w4a8": 0.2, "w4a16": 0.2}


def ids(batch, seqlen, seed):
    return torch.randint(0, SHAPE["vocab_size"], (batch, seqlen),
                         generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def fp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("falcon-q") / "fp"
    random_falcon_mamba(**SHAPE).save_pretrained(path)
    return quamba.load_model(path, tokenizer=False)[0]


@pytest.fixture(scope="module")
def held_out():
    return ids(4, 48, seed=1)


@pytest.fixture(scope="module", params=list(RECIPES))
def recipe(request, fp_model):
    config = quamba.QuantConfig(**RECIPES[request.param])
    return request.param, quamba.quantize(fp_model, None, config, calib_data=ids(16, 64, seed=0),
                                          progress=False)


def modes_of(name):
    return ("fp16",) if name == "w4a16" else quamba.SSM_MODES


def logits(model, mode, tokens):
    model.set_ssm_mode(mode)
    with torch.no_grad():
        return model(tokens)


def test_every_mode_is_close_to_fp(recipe, fp_model, held_out):
    name, qmodel = recipe
    with torch.no_grad():
        fp = fp_model(held_out)
    for mode in modes_of(name):
        error = max_relative_error(logits(qmodel, mode, held_out), fp)
        assert error == 0 if mode == "fp16" and name != "w4a16" else error <= MAX_ERROR[name], mode


def test_decode_steps_follow_prefill(recipe, held_out):
    name, qmodel = recipe
    tokens = held_out[:2, :30]
    for mode in modes_of(name):
        full = logits(qmodel, mode, tokens)
        cache = qmodel.allocate_cache(2)
        with torch.no_grad():
            steps = [qmodel(tokens[:, :20], cache=cache)]
            steps += [qmodel(tokens[:, t:t + 1], cache=cache) for t in range(20, 30)]
        steps = torch.cat(steps, 1)
        assert torch.equal(steps[:, :20], full[:, :20]), mode
        # the int8 decode state is requantized every step; the prefill keeps it in fp32
        assert max_relative_error(steps[:, 20:], full[:, 20:]) <= 0.05, mode


def test_save_and_reload_are_bit_identical(recipe, held_out, tmp_path):
    name, qmodel = recipe
    qmodel.save_pretrained(tmp_path / name)
    reloaded, _ = quamba.from_pretrained(tmp_path / name, tokenizer=False)
    assert reloaded.config.mixer_rms_eps == qmodel.config.mixer_rms_eps == 1e-5
    # version 6: a quamba that knows no norms of dt, B and C refuses it (newer than its 5)
    recorded = json.loads((tmp_path / name / "config.json").read_text())
    assert recorded["quantization_config"]["format_version"] == MIXER_NORMS_FORMAT_VERSION == 6
    for mode in modes_of(name):
        if mode != "fp16" or name == "w4a16":  # fp16 of an A8 model runs the FP model
            assert torch.equal(logits(qmodel, mode, held_out), logits(reloaded, mode, held_out))


def test_the_decode_step_runs_op_by_op(recipe):
    """The fused decode ops know no norms of dt, B and C: a Falcon-Mamba mixer never takes them."""
    name, qmodel = recipe
    qmodel.set_fused_decode(True)
    try:
        for block in qmodel.backbone.layers:
            mixer = block.mixer
            if name == "w4a16":
                assert not mixer.fuses_step(mixer.allocate_state(1))
            else:
                assert not mixer.fuses_decode() and mixer.layer_weights(block.norm) is None
    finally:
        qmodel.set_fused_decode(False)


def test_the_norm_op_is_logged_and_is_a_kernel_op_on_a_gpu(recipe):
    name, qmodel = recipe
    qmodel.set_ssm_mode(modes_of(name)[0])
    assert qmodel.op_backends()["mixer_rms_norm"] == "torch"
    # on a GPU it takes quamba's Triton kernel wherever the other Triton norm does
    cuda = torch.device("cuda")
    assert backend.resolve("mixer_rms_norm", cuda) == backend.resolve("gated_rms_norm", cuda)
    assert "mixer_rms_norm" in backend.quamba_ops()


def test_the_triton_kernels_give_the_same_logits(recipe, held_out, monkeypatch):
    """The Triton kernel of the norms (interpreted here; with dt, B and C's codes in W8A8 and W4A8)
    in place of its torch reference, in prefill and decode: W8A8 and W4A8 give the same logits
    bit for bit (on this model the codes absorb the norms' last-ulp differences), W4A16 (float
    dt, B and C) within 1e-5."""
    name, qmodel = recipe
    tokens = held_out[:2, :9]
    qmodel.set_ssm_mode(modes_of(name)[0])
    expected = prefill_and_step(qmodel, tokens)
    kernels_for_references(monkeypatch, "norm/mixer_norm_triton.py",
                           {"mixer_rms_norm": "_mixer_rms_norm_cuda"})
    with backend.recording() as ran:
        got = prefill_and_step(qmodel, tokens)
    assert "mixer_rms_norm" in ran
    for got_logits, expected_logits in zip(got, expected):
        if name == "w4a16":
            assert max_relative_error(got_logits, expected_logits) < 1e-5
        else:
            assert torch.equal(got_logits, expected_logits)


def test_learned_scales_are_refused(fp_model):
    with pytest.raises(QuambaError, match="--learn_scales does not support the norms of dt, B"):
        quamba.quantize(fp_model, None, quamba.QuantConfig(learn_scales=True),
                        calib_data=ids(4, 16, seed=0), progress=False)
