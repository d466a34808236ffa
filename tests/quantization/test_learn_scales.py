"""Learned activation scales (QuantConfig.learn_scales) and 4-bit weight clipping
(learn_weight_clipping) on the trained test model: they lower the block output error, are
deterministic, reload bit-identically, the clipped weights are the ones simulated, and bad
settings fail loudly."""
import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import quamba
from quamba.calibrate import calibrate, load_calibration_set
from quamba.errors import QuambaError
from quamba.ops.quant4 import dequantize_int4, effective_scales, quantize_weight_w4a8
from quamba.quantization.blocks import quantized_block
from quamba.quantization.learn_scales import (LEARNED_KINDS, _BlockWeights, _full_loss, _learn_block,
                                              clip_weights_, fake_quantize_w4a8_weight, learn_ranges)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_clipped_weight_simulated_is_the_round_to_nearest_weight_deployed(dtype):
    """fake_quantize_w4a8_weight at clip factors c is round-to-nearest W4A8 (quant4) of the weight
    clamped to c · each group's absmax, the weight clip_weights_ leaves, bit for bit; at c = 1 it
    is plain round-to-nearest; the clip factors get a gradient."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 192, generator=gen).to(dtype)
    group_size = 64

    def deployed(w):
        packed, multiplier, channel_scale, size = quantize_weight_w4a8(w, group_size)
        return dequantize_int4(packed, effective_scales(channel_scale, multiplier), size)

    assert torch.equal(fake_quantize_w4a8_weight(weight, torch.ones(24, 3), group_size),
                       deployed(weight))
    clip = (0.5 + 0.5 * torch.rand(24, 3, generator=gen)).requires_grad_(True)
    simulated = fake_quantize_w4a8_weight(weight, clip, group_size)
    block = SimpleNamespace(mixer=SimpleNamespace(in_proj=torch.nn.Linear(192, 24, bias=False)))
    block.mixer.in_proj.weight.data = weight.clone()
    clip_weights_(block, {"in_proj": clip.detach()}, SimpleNamespace(
        clipped={"in_proj": (weight, group_size)}))
    clamped = block.mixer.in_proj.weight.detach()
    assert clamped.dtype == dtype and not torch.equal(clamped, weight)
    assert torch.equal(simulated.detach(), deployed(clamped))
    (simulated - weight.float()).pow(2).sum().backward()
    assert clip.grad.abs().min() > 0


@pytest.fixture(scope="module")
def clipped(basis_and_ranges, calib_tokens):
    """(the FP model in the quantization basis, the same with learned clipping applied, the
    ranges and record of learn_ranges with learn_weight_clipping)."""
    work, ranges = basis_and_ranges
    clipped_work = copy.deepcopy(work)
    learned_ranges, record = learn_ranges(clipped_work, ranges, calib_tokens,
                                          learn_config(learn_weight_clipping=True), progress=False)
    return work, clipped_work, learned_ranges, record


def test_learned_weight_clipping_lowers_the_block_error_past_learned_scales(clipped, learned):
    """In layer 0 (same inputs either way) learning the 4-bit weights' clipping with the ranges
    lowers the block output error below learning the ranges alone; the record says how much each
    weight was clipped."""
    _, _, _, record = clipped
    first = record["layers"]["0"]
    assert first["kept"] == "learned"
    assert first["loss_learned"] < learned[1]["layers"]["0"]["loss_learned"]
    for name in ("in_proj", "x_proj", "out_proj"):
        summary = first["weight_clipping"][name]
        assert 0 < summary["min"] <= summary["mean"] < 1
        assert 0 < summary["groups_below_0.99"] <= 1


def test_clipped_weights_are_the_ones_the_pass_simulated(clipped, calib_tokens):
    """The quantized block rebuilt from the clamped FP weights and the learned ranges reproduces
    the pass's learned loss exactly; layers that kept the calibrated values keep their weights."""
    work, clipped_work, ranges, record = clipped
    config = learn_config(learn_weight_clipping=True)
    layer0 = clipped_work.backbone.layers[0]
    rebuilt = _BlockWeights(layer0, quantized_block(layer0, 0, ranges, config, work.config))
    hidden = work.backbone.embedding(calib_tokens).detach()
    fp_out = work.backbone.layers[0](hidden, None)
    target = fp_out[0].float() + fp_out[1].float()
    loss = _full_loss(rebuilt, (hidden, None), target, ranges[0], config.calib_batch_size)
    assert loss == record["layers"]["0"]["loss_learned"]
    for layer, entry in record["layers"].items():
        for name in ("in_proj", "x_proj", "out_proj"):
            before = getattr(work.backbone.layers[int(layer)].mixer, name).weight
            after = getattr(clipped_work.backbone.layers[int(layer)].mixer, name).weight
            assert torch.equal(before, after) == (entry["kept"] == "calibrated"), (layer, name)
            assert (after.abs() <= before.abs()).all()


def test_learned_weight_clipping_is_deterministic(clipped, basis_and_ranges, calib_tokens):
    work, ranges = basis_and_ranges
    again = copy.deepcopy(work)
    learn_ranges(again, ranges, calib_tokens, learn_config(learn_weight_clipping=True), progress=False)
    for mine, theirs in zip(again.parameters(), clipped[1].parameters()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("overrides, message", [
    (dict(learn_scales=False), "learn_weight_clipping is part of the learned-scales pass"),
    (dict(w_bits=8), "use it with w_bits=4 a_bits=8"),
    (dict(apply_gptq=True), "does not combine with GPTQ or mixed precision"),
    (dict(mixed_precision=0.5), "does not combine with GPTQ or mixed precision"),
])
def test_weight_clipping_settings_that_cannot_apply_are_one_line_errors(overrides, message):
    with pytest.raises(QuambaError, match=message):
        learn_config(learn_weight_clipping=True, **overrides)


def test_weight_clipping_is_part_of_the_recipe():
    plain = learn_config()
    clipping = learn_config(learn_weight_clipping=True)
    assert not plain.same_recipe(clipping)
    assert quamba.QuantConfig.from_dict(clipping.to_dict()).same_recipe(clipping)
