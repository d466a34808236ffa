"""Learned activation scales (QuantConfig.learn_scales) on the trained test model: they lower the
block output error, are deterministic, reload bit-identically, and fail loudly."""
import copy
from pathlib import Path

import pytest
import torch

import quamba
from quamba.calibrate import calibrate, load_calibration_set
from quamba.errors import QuambaError
from quamba.quantization.learn_scales import LEARNED_KINDS, _BlockWeights, _learn_block, learn_ranges
from quamba.quantization.quantize import quantized_block
from quamba.quantization.rotation import quantization_basis_

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
TINY_MODEL = REPO / "tests" / "fixtures" / "tiny-mamba"
TINY_MAMBA2 = REPO / "tests" / "fixtures" / "tiny-mamba2"
CALIB = str(SHARED_DATA / "text" / "c4_sample.jsonl")
SAMPLES, SEQLEN = 8, 64


def learn_config(**overrides):
    values = dict(w_bits=4, group_size=64, calib_source=CALIB, calib_num_samples=SAMPLES,
                  calib_seqlen=SEQLEN, learn_scales=True, learn_steps=30, learn_lr=0.02,
                  learn_num_samples=SAMPLES, learn_batch_size=4)
    values.update(overrides)
    return quamba.QuantConfig(**values)


@pytest.fixture(scope="module")
def fp_model():
    return quamba.load_model(TINY_MODEL)


@pytest.fixture(scope="module")
def calib_tokens(fp_model):
    _, tokenizer = fp_model
    return load_calibration_set(CALIB, tokenizer, SAMPLES, SEQLEN, seed=0).tokens


@pytest.fixture(scope="module")
def basis_and_ranges(fp_model, calib_tokens):
    config = learn_config()
    work = quantization_basis_(copy.deepcopy(fp_model[0]), config.hadamard)
    return work, calibrate(work, calib_tokens, observers=config.observer_specs(), progress=False)


@pytest.fixture(scope="module")
def learned(basis_and_ranges, calib_tokens):
    work, ranges = basis_and_ranges
    return learn_ranges(work, ranges, calib_tokens, learn_config(), progress=False)


def test_learned_scales_lower_the_block_output_error(learned, basis_and_ranges):
    _, calibrated = basis_and_ranges
    ranges, record = learned
    first = record["layers"]["0"]
    assert first["loss_learned"] < 0.97 * first["loss_calibrated"]  # same inputs in layer 0
    for layer, entry in record["layers"].items():
        kept = ranges[int(layer)]
        assert entry["kept"] in ("learned", "calibrated")
        assert min(entry["loss_learned"], entry["loss_calibrated"]) <= entry["loss_calibrated"]
        source = entry["learned"] if entry["kept"] == "learned" else entry["calibrated"]
        assert {kind: kept[kind] for kind in LEARNED_KINDS} == source
    assert ranges[0] != calibrated[0]
    assert calibrated[0]["x_proj.input"] == record["layers"]["0"]["calibrated"]["x_proj.input"]


def test_learned_scales_are_deterministic(learned, basis_and_ranges, calib_tokens):
    work, ranges = basis_and_ranges
    again, _ = learn_ranges(work, ranges, calib_tokens, learn_config(), progress=False)
    assert again == learned[0]  # bit-identical floats


def test_learned_model_saves_and_reloads_bit_identically(fp_model, calib_tokens, tmp_path):
    model, tokenizer = fp_model
    qmodel = quamba.quantize(model, tokenizer, learn_config(learn_steps=5), calib_data=calib_tokens,
                             progress=False)
    assert qmodel.quant_config.learn_scales
    assert qmodel.calibration["learned_scales"]["layers"]
    qmodel.save_pretrained(tmp_path / "q")
    loaded, _ = quamba.from_pretrained(tmp_path / "q")
    assert loaded.quant_config.same_recipe(qmodel.quant_config) and loaded.quant_config.learn_scales
    assert loaded.calibration["learned_scales"] == qmodel.calibration["learned_scales"]
    expected, found = qmodel.state_dict(), loaded.state_dict()
    assert expected.keys() == found.keys()
    for name in expected:
        assert torch.equal(expected[name], found[name]), name
    ids = calib_tokens[:2, :32]
    with torch.no_grad():
        assert torch.equal(qmodel(ids), loaded(ids))


def test_recipe_tells_learned_from_calibrated_scales():
    plain = quamba.QuantConfig()
    assert "learn_steps" not in plain.recipe()  # the pass did not run: its settings do not matter
    assert not plain.same_recipe(quamba.QuantConfig(learn_scales=True))
    assert quamba.QuantConfig(learn_scales=True).recipe()["learn_steps"] == 200


@pytest.mark.parametrize("overrides, message", [
    (dict(a_bits=16), "learn_scales learns activation scales; a W4A16 recipe has none"),
    (dict(learn_steps=0), "learn_steps must be positive"),
    (dict(learn_lr=float("nan")), "learn_lr must be positive"),
])
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(QuambaError, match=message):
        learn_config(**overrides)


def test_non_finite_loss_stops_with_an_error(basis_and_ranges, calib_tokens):
    work, ranges = basis_and_ranges
    config = learn_config()
    block = quantized_block(work.backbone.layers[0], 0, ranges, config, work.config)
    hidden = work.backbone.embedding(calib_tokens[:4]).detach()
    hidden[:, 3, 5] = float("nan")
    weights = _BlockWeights(work.backbone.layers[0], block)
    with pytest.raises(QuambaError, match="learning the scales of layer 0: the loss is nan at step 0"):
        _learn_block(weights, (hidden, None), hidden.clone(), ranges[0], config, 0, progress=False)


def test_mamba2_is_refused_before_calibrating(calib_tokens):
    model, tokenizer = quamba.load_model(TINY_MAMBA2)
    with pytest.raises(QuambaError, match="--learn_scales supports Mamba1 blocks; layer 0 is a Mamba2Mixer"):
        quamba.quantize(model, tokenizer, learn_config(), calib_data=calib_tokens, progress=False)
