"""W4A16 (weight-only 4-bit) on the trained test model: structure, no calibration, decode,
checkpoints, SSM modes, GPTQ, the W4A16 blocks of a mixed-precision model."""
import json

import pytest
import torch
import torch.nn as nn

import quamba
from quamba.errors import QuambaError
from quamba.layers.qlinear import W4A16Linear
from quamba.layers.weight_only import WeightOnlyMambaMixer
from quamba.models import MambaConfig, MambaLMHeadModel, randomize_
from quamba.models.mamba import RMSNorm
from quamba.models.quantized import QMambaBlock, WeightOnlyBlock
from quamba.ops import backend
from quamba.ops.backend import BackendError
from quamba.quantization.checkpoint import FORMAT_VERSION

GROUP = 64  # d_model 192 is no multiple of 128


def w4a16_config(**overrides):
    return quamba.QuantConfig(**{"w_bits": 4, "a_bits": 16, "group_size": GROUP, **overrides})


@pytest.fixture(scope="module")
def fp_model(tiny_model_dir):
    return quamba.load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def w4a16_model(fp_model):
    model, tokenizer = fp_model
    return quamba.quantize(model, tokenizer, w4a16_config(), progress=False)


@pytest.fixture(scope="module")
def held_out_ids(fp_model, shared_data_dir):
    """4 × 256 tokens of held-out text (wikitext2 test; the model never trained on it)."""
    _, tokenizer = fp_model
    with open(shared_data_dir / "eval" / "wikitext2_test_docs.jsonl") as f:
        text = "\n\n".join(json.loads(line)["page"] for _, line in zip(range(3), f))
    return torch.tensor(tokenizer(text)["input_ids"][: 4 * 256]).view(4, 256)


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


def top1_agreement(a, b):
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def max_relative_error(got, expected):
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_structure_and_no_calibration(fp_model, monkeypatch):
    import quamba.calibrate

    def no_calibration(*args, **kwargs):
        raise AssertionError("W4A16 must not calibrate")

    monkeypatch.setattr(quamba.calibrate, "calibrate", no_calibration)
    monkeypatch.setattr(quamba.calibrate, "load_calibration_set", no_calibration)
    model, tokenizer = fp_model
    qmodel = quamba.quantize(model, tokenizer, w4a16_config(), progress=False)
    config = qmodel.quant_config
    assert config.weight_only and not config.hadamard and config.ssm_mode == "fp16"
    assert qmodel.ssm_mode == "fp16" and qmodel.calibration == {}
    block = qmodel.backbone.layers[0]
    assert type(block) is WeightOnlyBlock  # its decode step one op where the layer kernel runs
    assert type(block.norm) is RMSNorm and type(block.mixer) is WeightOnlyMambaMixer
    mixer = block.mixer
    assert all(isinstance(getattr(mixer, name), W4A16Linear)
               for name in ("in_proj", "x_proj", "out_proj"))
    assert type(mixer.dt_proj) is nn.Linear and isinstance(mixer.online_hadamard, nn.Identity)
    fp_mixer = model.backbone.layers[0].mixer
    for name in ("conv1d.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D"):
        assert torch.equal(mixer.get_parameter(name), fp_mixer.get_parameter(name)), name


def test_close_to_fp_and_deterministic(w4a16_model, fp_model, held_out_ids):
    model, tokenizer = fp_model
    fp, quantized = logits(model, held_out_ids), logits(w4a16_model, held_out_ids)
    assert not torch.equal(fp, quantized)
    assert top1_agreement(quantized, fp) > 0.8
    again = quamba.quantize(model, tokenizer, w4a16_config(), progress=False)
    assert torch.equal(logits(again, held_out_ids), quantized)


def test_prefill_and_decode_follow_the_plain_forward(w4a16_model, held_out_ids):
    ids = held_out_ids[:2, :40]
    full = logits(w4a16_model, ids)
    cache = w4a16_model.allocate_cache(2)
    assert cache.states[0].conv.dtype == torch.float32  # the FP mixer's float state
    with torch.no_grad():
        prefill = w4a16_model(ids[:, :24], cache=cache)
        assert max_relative_error(prefill, full[:, :24]) <= 1e-5  # as the FP model's test
        for t in range(24, 40):
            step = w4a16_model(ids[:, t:t + 1], cache=cache)
            assert max_relative_error(step[:, 0], full[:, t]) <= 1e-4, t
    assert cache.seqlen_offset == 40
    out = w4a16_model.generate(ids[:1, :8], max_new_tokens=6)
    greedy = logits(w4a16_model, out[:, :-1])[0, 7:].argmax(-1)
    assert torch.equal(out[0, 8:], greedy)


def decode_steps(model, ids, prompt_len: int):
    """(logits of each decode step after a prefill of prompt_len tokens, the cache, the ops run)."""
    cache = model.allocate_cache(ids.shape[0])
    with torch.no_grad(), backend.recording() as ran:
        model(ids[:, :prompt_len], cache=cache)
        steps = [model(ids[:, t:t + 1], cache=cache) for t in range(prompt_len, ids.shape[1])]
    return torch.cat(steps, dim=1), cache, ran


def test_decode_step_runs_its_ssm_side_as_one_op_with_the_chains_numbers(w4a16_model,
                                                                         held_out_ids):
    assert all(isinstance(block.mixer, WeightOnlyMambaMixer)
               for block in w4a16_model.backbone.layers)
    ids = held_out_ids[:2, :24]
    fused, fused_cache, fused_ran = decode_steps(w4a16_model, ids, 16)
    try:
        unfused, unfused_cache, unfused_ran = decode_steps(w4a16_model.set_fused_ssm_step(False),
                                                           ids, 16)
    finally:
        w4a16_model.set_fused_ssm_step(True)
    assert "w4a16_ssm_step" in fused_ran and "w4a16_ssm_step" not in unfused_ran
    assert torch.equal(fused, unfused)  # the op's torch backend is the chain of torch references
    for fused_state, unfused_state in zip(fused_cache.states, unfused_cache.states):
        assert torch.equal(fused_state.ssm, unfused_state.ssm)
        assert torch.equal(fused_state.conv, unfused_state.conv)


def test_save_load_gives_identical_logits(w4a16_model, held_out_ids, tmp_path):
    w4a16_model.save_pretrained(tmp_path / "q")
    reloaded, tokenizer = quamba.from_pretrained(tmp_path / "q")
    assert tokenizer is not None and reloaded.quant_config.weight_only
    assert all(type(block) is WeightOnlyBlock and type(block.mixer) is WeightOnlyMambaMixer
               for block in reloaded.backbone.layers)
    assert torch.equal(logits(reloaded, held_out_ids), logits(w4a16_model, held_out_ids))
    recorded = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert recorded["format_version"] == FORMAT_VERSION == 5
    assert recorded["a_bits"] == 16 and recorded["ssm_mode"] == "fp16"
    assert recorded["observer_specs"] == {} and recorded["calibration"] == {}
    state = reloaded.state_dict()
    assert state["backbone.layers.0.mixer.in_proj.weight"].dtype == torch.uint8
    assert state["backbone.layers.0.mixer.in_proj.scales"].dtype == torch.float16
    half, _ = quamba.from_pretrained(tmp_path / "q", dtype="bfloat16", tokenizer=False)
    assert half.backbone.layers[0].mixer.conv1d.weight.dtype == torch.bfloat16
    assert half.backbone.layers[0].mixer.in_proj.scales.dtype == torch.float16
    assert half.backbone.layers[0].mixer.A_log.dtype == torch.float32
    assert top1_agreement(logits(half, held_out_ids).float(), logits(reloaded, held_out_ids)) > 0.9


def test_mixed_precision_rebuilds_its_w4a16_blocks_as_weight_only_blocks(fp_model,
                                                                       shared_data_dir):
    """Mixed precision rebuilds some W4A8 blocks (QMambaBlocks) W4A16: they become
    WeightOnlyBlocks, whose decode step takes their weight-only mixer, as after a reload."""
    from quamba.calibrate import load_calibration_set
    model, tokenizer = fp_model
    calib = load_calibration_set(str(shared_data_dir / "text" / "c4_sample.jsonl"), tokenizer,
                                 4, 64, seed=0)
    config = quamba.QuantConfig(w_bits=4, group_size=GROUP, mixed_precision=0.5)
    mixed = quamba.quantize(model, tokenizer, config, calib_data=calib, progress=False)
    layer_bits = mixed.quant_config.layer_bits
    assert [type(block) for block in mixed.backbone.layers] == [
        WeightOnlyBlock if bits == (4, 16) else QMambaBlock for bits in layer_bits]
    assert mixed.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4).shape == (1, 7)


def test_ssm_modes_do_not_apply(w4a16_model, held_out_ids):
    before = logits(w4a16_model, held_out_ids)
    for mode in ("int8", "fp32-ssm-input", "float-sim-asic-int8", "fp32-conv"):
        with pytest.raises(QuambaError, match=f"SSM mode '{mode}' needs 8-bit activations") as info:
            w4a16_model.set_ssm_mode(mode)
        assert "\n" not in str(info.value)
        with pytest.raises(QuambaError, match="needs 8-bit activations"):
            w4a16_config(ssm_mode=mode)
    w4a16_model.set_ssm_mode("fp16")  # its only mode: still the W4A16 model, not the FP one
    assert torch.equal(logits(w4a16_model, held_out_ids), before)
    w4a16_model.set_ssm_mode("fp16", backend="cuda")
    with pytest.raises(BackendError, match="w4a16_linear"):
        logits(w4a16_model, held_out_ids)
    w4a16_model.set_ssm_mode("fp16")


def test_recipe():
    assert w4a16_config().same_recipe(w4a16_config(calib_num_samples=4, percentile_alpha=0.99))
    assert not w4a16_config().same_recipe(w4a16_config(group_size=32))
    assert quamba.QuantConfig().hadamard and quamba.QuantConfig().ssm_mode == "int8"
    with pytest.raises(QuambaError, match="w_bits=8 a_bits=16 is not supported; "
                                          "supported: W4A8, W4A16, W8A8"):
        quamba.QuantConfig(w_bits=8, a_bits=16)


def test_with_hadamard_rotation(fp_model, held_out_ids, tmp_path):
    model, tokenizer = fp_model
    rotated = quamba.quantize(model, tokenizer, w4a16_config(hadamard=True), progress=False)
    assert not isinstance(rotated.backbone.layers[0].mixer.online_hadamard, nn.Identity)
    quantized = logits(rotated, held_out_ids)
    assert top1_agreement(quantized, logits(model, held_out_ids)) > 0.8
    rotated.save_pretrained(tmp_path / "rotated")
    reloaded, _ = quamba.from_pretrained(tmp_path / "rotated", tokenizer=False)
    assert torch.equal(logits(reloaded, held_out_ids), quantized)


def test_models_with_linear_biases_are_rejected():
    model = randomize_(MambaLMHeadModel(MambaConfig(d_model=64, n_layer=1, vocab_size=256,
                                                    bias=True)))
    with pytest.raises(QuambaError, match="biases in in_proj and out_proj are not supported"):
        quamba.quantize(model, None, w4a16_config())


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_layer_error_on_held_out_text(fp_model, w4a16_model, held_out_ids,
                                                      shared_data_dir, act_order):
    from quamba.quantization.gptq import collect_hessians
    model, tokenizer = fp_model
    config = w4a16_config(apply_gptq=True, gptq_act_order=act_order, gptq_num_samples=16,
                          gptq_seqlen=256,
                          gptq_source=str(shared_data_dir / "text" / "c4_sample.jsonl"))
    gptq = quamba.quantize(model, tokenizer, config, progress=False)
    held_out = collect_hessians(model, held_out_ids, ("in_proj", "out_proj"), progress=False)

    def output_error(qmodel, layer, name):
        fp_weight = getattr(model.backbone.layers[layer].mixer, name).weight.double()
        quantized = getattr(qmodel.backbone.layers[layer].mixer, name).dequantized_weight()
        delta = quantized.double() - fp_weight
        return torch.trace(delta @ held_out[(layer, name)].double() @ delta.t()).item()

    for layer, name in held_out:
        rtn_layer = getattr(w4a16_model.backbone.layers[layer].mixer, name)
        assert torch.equal(getattr(gptq.backbone.layers[layer].mixer, name).scales,
                           rtn_layer.scales)  # GPTQ changes the codes, never the scales
        assert output_error(gptq, layer, name) < output_error(w4a16_model, layer, name), (layer, name)
    assert top1_agreement(logits(gptq, held_out_ids), logits(model, held_out_ids)) > 0.8
