"""W8A8 and W4A8 pipeline on the trained test model: modes, determinism, checkpoints, backends."""
import json
from pathlib import Path

import pytest
import torch

import quamba
from quamba.calibrate import load_calibration_set
from quamba.errors import CheckpointError, QuambaError
from quamba.ops.backend import BackendError
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.quantization.checkpoint import FORMAT_VERSION

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
TINY_MODEL = REPO / "tests" / "fixtures" / "tiny-mamba"
CALIB_SAMPLES, CALIB_SEQLEN = 32, 256


@pytest.fixture(scope="module")
def fp_model():
    return quamba.load_model(TINY_MODEL)


@pytest.fixture(scope="module")
def calib_set(fp_model):
    _, tokenizer = fp_model
    return load_calibration_set(str(SHARED_DATA / "text" / "c4_sample.jsonl"), tokenizer,
                                CALIB_SAMPLES, CALIB_SEQLEN, seed=0)


def quant_config(**overrides):
    values = dict(calib_source=str(SHARED_DATA / "text" / "c4_sample.jsonl"),
                  calib_num_samples=CALIB_SAMPLES, calib_seqlen=CALIB_SEQLEN)
    values.update(overrides)
    return quamba.QuantConfig(**values)


@pytest.fixture(scope="module")
def qmodel(fp_model, calib_set):
    model, tokenizer = fp_model
    return quamba.quantize(model, tokenizer, quant_config(), calib_data=calib_set, progress=False)


@pytest.fixture(scope="module")
def held_out_ids(fp_model):
    """4 × 256 tokens of held-out text (wikitext2 test; the model never trained on it)."""
    _, tokenizer = fp_model
    with open(SHARED_DATA / "eval" / "wikitext2_test_docs.jsonl") as f:
        text = "\n\n".join(json.loads(line)["page"] for _, line in zip(range(3), f))
    ids = torch.tensor(tokenizer(text)["input_ids"][: 4 * 256])
    return ids.view(4, 256)


def logits_in_mode(model, mode, ids):
    model.set_ssm_mode(mode)
    with torch.no_grad():
        return model(ids)


def top1_agreement(a, b):
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("mode", ["float-sim-asic-int8", "fp32-ssm-input"])
def test_mode_tracks_int8(qmodel, held_out_ids, mode):
    int8 = logits_in_mode(qmodel, "int8", held_out_ids)
    other = logits_in_mode(qmodel, mode, held_out_ids)
    qmodel.set_ssm_mode("int8")
    assert top1_agreement(int8, other) >= 0.99


def test_every_mode_runs_and_is_close_to_fp(qmodel, fp_model, held_out_ids):
    with torch.no_grad():
        fp = fp_model[0](held_out_ids)
    for mode in quamba.SSM_MODES:
        logits = logits_in_mode(qmodel, mode, held_out_ids)
        assert torch.isfinite(logits).all()
        assert top1_agreement(logits, fp) > 0.8, mode
    fp16_mode = logits_in_mode(qmodel, "fp16", held_out_ids)
    assert torch.equal(fp16_mode, fp)
    qmodel.set_ssm_mode("int8")


def test_switching_modes_keeps_the_calibration(qmodel, held_out_ids):
    before = {k: v.clone() for k, v in qmodel.state_dict().items()}
    first = logits_in_mode(qmodel, "int8", held_out_ids)
    logits_in_mode(qmodel, "fp32-conv", held_out_ids)
    again = logits_in_mode(qmodel, "int8", held_out_ids)
    assert torch.equal(first, again)
    assert all(torch.equal(before[k], v) for k, v in qmodel.state_dict().items())


@pytest.mark.parametrize("mode", ["int8", "float-sim-asic-int8", "fp32-conv"])
def test_decode_steps_follow_prefill(qmodel, held_out_ids, mode):
    ids = held_out_ids[:2, :40]
    full = logits_in_mode(qmodel, mode, ids)
    cache = qmodel.allocate_cache(2)
    with torch.no_grad():
        steps = [qmodel(ids[:, :24], cache=cache)]
        steps += [qmodel(ids[:, t:t + 1], cache=cache) for t in range(24, 40)]
    qmodel.set_ssm_mode("int8")
    steps = torch.cat(steps, 1)
    assert torch.equal(steps[:, :24], full[:, :24])
    # decode requantizes the int8 SSM state every step; the prefill scan keeps it in fp32
    assert top1_agreement(steps[:, 24:], full[:, 24:]) >= 0.85


def test_generate_on_quantized_model(qmodel, fp_model):
    tokenizer = fp_model[1]
    ids = torch.tensor([tokenizer("The king said")["input_ids"]])
    out = qmodel.generate(ids, max_new_tokens=12)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tokenizer.decode(out[0]), str)


def test_calibration_is_deterministic(fp_model, calib_set, qmodel):
    model, tokenizer = fp_model
    again = quamba.quantize(model, tokenizer, quant_config(), calib_data=calib_set, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(qmodel.state_dict().values(),
                                                 again.state_dict().values()))
    fresh_set = load_calibration_set(str(SHARED_DATA / "text" / "c4_sample.jsonl"), tokenizer,
                                     CALIB_SAMPLES, CALIB_SEQLEN, seed=0)
    assert torch.equal(fresh_set.tokens, calib_set.tokens)


def test_save_load_gives_identical_logits(qmodel, held_out_ids, tmp_path):
    qmodel.save_pretrained(tmp_path / "q")
    for mode in ("int8", "float-sim-asic-int8", "fp32-ssm-input", "fp32-conv"):
        reloaded, tokenizer = quamba.from_pretrained(tmp_path / "q", ssm_mode=mode)
        assert torch.equal(logits_in_mode(qmodel, mode, held_out_ids),
                           logits_in_mode(reloaded, mode, held_out_ids))
    qmodel.set_ssm_mode("int8")
    assert tokenizer is not None
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["format_version"] == FORMAT_VERSION and config["calibration"]["content_hash"]
    # a reloaded model finds its base model for the fp16 mode; load_model also accepts the dir
    reloaded, _ = quamba.load_model(tmp_path / "q")
    assert isinstance(reloaded, quamba.QuantizedMambaLM)
    reloaded.set_ssm_mode("fp16")


def corrupt(tmp_path, qmodel, edit):
    """Save qmodel, apply ``edit(directory)``, return the directory."""
    target = tmp_path / "bad"
    qmodel.save_pretrained(target)
    edit(target)
    return target


def _edit_tensors(change):
    def edit(directory):
        from safetensors.torch import load_file, save_file
        state = load_file(str(directory / "model.safetensors"))
        change(state)
        save_file(state, str(directory / "model.safetensors"))
    return edit


def _edit_config(change):
    def edit(directory):
        config = json.loads((directory / "config.json").read_text())
        change(config)
        (directory / "config.json").write_text(json.dumps(config))
    return edit


def _truncate(directory):
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BAD_CHECKPOINTS = {
    "missing tensor": (_edit_tensors(lambda s: s.pop("backbone.layers.1.mixer.A_log")),
                       "missing tensor backbone.layers.1.mixer.A_log"),
    "wrong shape": (_edit_tensors(lambda s: s.update({"backbone.layers.0.mixer.D": torch.zeros(3, dtype=torch.int8)})),
                    "tensor backbone.layers.0.mixer.D has shape (3,)"),
    "wrong dtype": (_edit_tensors(lambda s: s.update({"backbone.layers.0.mixer.in_proj.weight": s["backbone.layers.0.mixer.in_proj.weight"].float()})),
                    "has dtype torch.float32, expected torch.int8"),
    "unexpected tensor": (_edit_tensors(lambda s: s.update({"extra": torch.zeros(1)})),
                          "unexpected tensor extra"),
    "newer format": (_edit_config(lambda c: c["quantization_config"].update(format_version=99)),
                     "newer than this quamba supports"),
    "truncated": (_truncate, "truncated or corrupt"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoints_fail_with_one_line(qmodel, tmp_path, case):
    edit, message = BAD_CHECKPOINTS[case]
    directory = corrupt(tmp_path, qmodel, edit)
    with pytest.raises(CheckpointError) as info:
        quamba.from_pretrained(directory, tokenizer=False)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_failed_save_keeps_the_previous_checkpoint(qmodel, tmp_path, monkeypatch):
    qmodel.save_pretrained(tmp_path / "q")
    before = (tmp_path / "q" / "model.safetensors").read_bytes()

    class Broken:
        def save_pretrained(self, _):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        qmodel.save_pretrained(tmp_path / "q", tokenizer=Broken())
    assert (tmp_path / "q" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


@pytest.mark.parametrize("recipe,version", [("qmodel", 1), ("qmodel", 2), ("w4a8_model", 2)])
def test_older_format_versions_still_load(request, held_out_ids, tmp_path, recipe, version):
    model = request.getfixturevalue(recipe)
    directory = corrupt(tmp_path, model, _edit_config(
        lambda c: c["quantization_config"].update(format_version=version)))
    reloaded, _ = quamba.from_pretrained(directory, tokenizer=False)
    assert torch.equal(logits_in_mode(reloaded, "int8", held_out_ids),
                       logits_in_mode(model, "int8", held_out_ids))


@pytest.fixture(scope="module")
def w4a8_model(fp_model, calib_set):
    model, tokenizer = fp_model
    return quamba.quantize(model, tokenizer, quant_config(w_bits=4, a_bits=8, group_size=64),
                           calib_data=calib_set, progress=False)


def test_w4a8_runs_in_every_mode_and_reloads(w4a8_model, qmodel, fp_model, held_out_ids, tmp_path):
    from quamba.layers.qlinear import W4A8Linear, W8A8Linear
    mixer = w4a8_model.backbone.layers[0].mixer
    assert isinstance(mixer.in_proj, W4A8Linear) and isinstance(mixer.out_proj, W4A8Linear)
    assert isinstance(mixer.dt_proj, W8A8Linear)
    with torch.no_grad():
        fp = fp_model[0](held_out_ids)
    int8 = logits_in_mode(w4a8_model, "int8", held_out_ids)
    assert top1_agreement(int8, fp) > 0.7
    assert top1_agreement(logits_in_mode(w4a8_model, "float-sim-asic-int8", held_out_ids), int8) >= 0.99
    w4a8_model.set_ssm_mode("int8")
    w4a8_model.save_pretrained(tmp_path / "w4a8")
    reloaded, _ = quamba.from_pretrained(tmp_path / "w4a8", tokenizer=False)
    assert torch.equal(logits_in_mode(reloaded, "int8", held_out_ids), int8)
    w8a8_size = sum(t.numel() * t.element_size() for t in qmodel.state_dict().values())
    w4a8_size = sum(t.numel() * t.element_size() for t in w4a8_model.state_dict().values())
    assert w4a8_size < w8a8_size


def _requantize_with_uncapped_multipliers_(layer):
    """Give a W4A8Linear the two-level scales of checkpoints written before the cap of 18:
    channel scale = max group scale / 127, multipliers in [1, 127]."""
    from quamba.ops.quant4 import effective_scales, group_scales, pack_int4, quantize_int4
    weight = layer.dequantized_weight()
    scales = group_scales(weight, layer.group_size)
    channel_scale = scales.amax(dim=1) / 127
    multiplier = torch.round(scales / channel_scale[:, None]).clamp(1, 127)
    codes = quantize_int4(weight, effective_scales(channel_scale, multiplier), layer.group_size)
    layer.weight.copy_(pack_int4(codes))
    layer.group_multiplier.copy_(multiplier.to(torch.int8))
    layer.channel_scale.copy_(channel_scale)


def test_version_2_checkpoints_with_uncapped_multipliers_still_run(w4a8_model, held_out_ids,
                                                                   tmp_path):
    import copy
    old = copy.deepcopy(w4a8_model)
    for mixer in old.mixers():
        for name in ("in_proj", "x_proj", "out_proj"):
            _requantize_with_uncapped_multipliers_(getattr(mixer, name))
    assert max(m.in_proj.group_multiplier.max().item() for m in old.mixers()) > 18
    directory = corrupt(tmp_path, old, _edit_config(
        lambda c: c["quantization_config"].update(format_version=2)))
    reloaded, _ = quamba.from_pretrained(directory, tokenizer=False)
    expected = logits_in_mode(old, "int8", held_out_ids)
    assert torch.equal(logits_in_mode(reloaded, "int8", held_out_ids), expected)
    assert top1_agreement(expected, logits_in_mode(w4a8_model, "int8", held_out_ids)) > 0.9


def test_unsupported_recipes_are_rejected():
    with pytest.raises(QuambaError, match="w_bits=8 a_bits=16 is not supported; supported: "
                                          "W4A8, W4A16, W8A8"):
        quamba.QuantConfig(w_bits=8, a_bits=16)
    with pytest.raises(QuambaError, match="unknown SSM mode"):
        quamba.QuantConfig(ssm_mode="int4")


def test_recipe_equality_ignores_runtime_fields():
    assert quant_config().same_recipe(quant_config(ssm_mode="fp32-conv", backend="torch"))
    assert not quant_config().same_recipe(quant_config(percentile_alpha=0.999))


def test_naive_recipe_uses_absmax_everywhere():
    specs = quant_config(percentile_alpha=None, hadamard=False).observer_specs()
    assert {spec.kind for spec in specs.values()} == {"absmax"}
    specs = quant_config().observer_specs()
    assert specs["x_proj.input"].kind == "percentile" and specs["in_proj.input"].kind == "absmax"


def test_backend_environment_takes_precedence(monkeypatch):
    x = torch.ones(2, 16, dtype=torch.int8)
    w = torch.ones(4, 16, dtype=torch.int8)
    monkeypatch.setenv("QUAMBA_BACKEND", "cuda")
    with pytest.raises(BackendError, match="backend 'cuda' requested for w8a8_linear"):
        w8a8_linear(x, 1.0, w, 1.0, backend_name="torch")
    monkeypatch.setenv("QUAMBA_BACKEND", "torch")
    assert w8a8_linear(x, 1.0, w, 1.0, out_dtype=torch.float32, backend_name="cuda")[0, 0] == 16
    monkeypatch.setenv("QUAMBA_BACKEND", "tpu")
    with pytest.raises(BackendError, match="QUAMBA_BACKEND must be one of"):
        w8a8_linear(x, 1.0, w, 1.0)
    monkeypatch.delenv("QUAMBA_BACKEND")
    with pytest.raises(BackendError):
        w8a8_linear(x, 1.0, w, 1.0, backend_name="cuda")


def test_quantize_refuses_a_quantized_model(qmodel, fp_model):
    with pytest.raises(QuambaError, match="needs an FP MambaLMHeadModel"):
        quamba.quantize(qmodel, fp_model[1], quant_config())


def test_without_rotation(fp_model, calib_set, held_out_ids):
    model, tokenizer = fp_model
    naive = quamba.quantize(model, tokenizer, quant_config(hadamard=False), calib_data=calib_set,
                            progress=False)
    assert naive.backbone.layers[0].norm.weight is not None
    with torch.no_grad():
        assert top1_agreement(naive(held_out_ids), model(held_out_ids)) > 0.8


def test_w4a8_gptq_lowers_the_layer_error_on_held_out_text(fp_model, calib_set, w4a8_model,
                                                           held_out_ids):
    import copy

    from quamba.quantization.gptq import collect_hessians
    from quamba.quantization.rotation import rotate_model_
    model, tokenizer = fp_model
    config = quant_config(w_bits=4, a_bits=8, group_size=64, apply_gptq=True,
                          gptq_source=str(SHARED_DATA / "text" / "c4_sample.jsonl"),
                          gptq_num_samples=16, gptq_seqlen=256)
    gptq = quamba.quantize(model, tokenizer, config, calib_data=calib_set, progress=False)
    rotated = rotate_model_(copy.deepcopy(model))
    held_out = collect_hessians(rotated, held_out_ids, ("in_proj", "out_proj"), progress=False)

    def output_error(qmodel, layer, name):
        fp_weight = getattr(rotated.backbone.layers[layer].mixer, name).weight.double()
        delta = getattr(qmodel.backbone.layers[layer].mixer, name).dequantized_weight().double() - fp_weight
        return torch.trace(delta @ held_out[(layer, name)].double() @ delta.t()).item()

    for layer, name in held_out:
        assert output_error(gptq, layer, name) < output_error(w4a8_model, layer, name), (layer, name)
    with torch.no_grad():
        assert top1_agreement(gptq(held_out_ids), model(held_out_ids)) > 0.7
    with pytest.raises(QuambaError, match="GPTQ applies to 4-bit weights"):
        quant_config(apply_gptq=True)


def test_quantized_and_reloaded_models_hold_ordinary_tensors_under_inference_mode(fp_model, calib_set,
                                                                                   held_out_ids, tmp_path):
    """The CUDA backend caches per-weight constants against version counters, which inference
    tensors lack: quantize and from_pretrained build ordinary tensors even under inference_mode."""
    model, tokenizer = fp_model
    with torch.inference_mode():
        qmodel = quamba.quantize(model, tokenizer, quant_config(w_bits=4, a_bits=8, group_size=64),
                                 calib_data=calib_set, progress=False)
        qmodel.save_pretrained(tmp_path / "q")
        reloaded, _ = quamba.from_pretrained(tmp_path / "q", tokenizer=False)
        for m in (qmodel, reloaded):
            assert not any(t.is_inference() for t in list(m.buffers()) + list(m.parameters()))
        ids = held_out_ids[:1, :32]
        assert torch.equal(qmodel(ids), reloaded(ids))
