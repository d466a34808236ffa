"""quamba.export: the compressed-tensors export of the test models, checked against what vLLM reads
(its config fields, schemes and tensor names, from its source; vLLM itself is not run) and, with
compressed-tensors installed (pip install -e ".[export]"), loaded by transformers and compared
with quamba's model in the export's configuration (quamba.export.reference_model)."""
import json

import pytest
import torch
from safetensors.torch import load_file

import quamba
from quamba.export import EXPORT_RECORD, export, reference_model
from quamba.export.__main__ import main as export_main
from quamba.export.compressed import pack_int32
from quamba.ops.quant import quantize as quamba_quantize

RECIPES = {"w8a8": (8, 8), "w4a16": (4, 16)}
FIXTURES = ("tiny-mamba", "tiny-mamba2")
CASES = [(f, r) for f in FIXTURES for r in RECIPES]

# What vLLM reads (vllm/model_executor/models/mamba.py, mamba2.py and layers/mamba/*, and
# layers/quantization/compressed_tensors: _is_static_tensor_w8a8, _is_wNa16_group_channel, the
# CompressedTensorsW8A8Int8 and CompressedTensorsWNA16 parameters); see docs/export.md.
VLLM_CONFIG_FIELDS = {
    "mamba": ("hidden_size", "state_size", "conv_kernel", "intermediate_size", "time_step_rank",
              "use_conv_bias", "use_bias", "layer_norm_epsilon", "hidden_act",
              "num_hidden_layers", "vocab_size", "tie_word_embeddings"),
    "mamba2": ("hidden_size", "state_size", "conv_kernel", "expand", "use_conv_bias", "use_bias",
               "n_groups", "num_heads", "head_dim", "layer_norm_epsilon", "hidden_act",
               "num_hidden_layers", "vocab_size", "tie_word_embeddings"),
}
VLLM_FP_MIXER_TENSORS = {
    "mamba": ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "A_log", "D"),
    "mamba2": ("conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"),
}
VLLM_QUANTIZED_LINEARS = {"mamba": ("in_proj", "x_proj", "out_proj"),
                          "mamba2": ("in_proj", "out_proj")}
VLLM_SCHEME_TENSORS = {"int-quantized": ("weight", "weight_scale", "input_scale"),
                       "pack-quantized": ("weight_packed", "weight_scale", "weight_shape")}


def _quantized(fixture_dir, recipe, **overrides):
    fp, tok = quamba.load_model(fixture_dir, dtype="fp32")
    w_bits, a_bits = RECIPES[recipe]
    calib = torch.randint(0, 4000, (8, 128), generator=torch.Generator().manual_seed(1))
    config = quamba.QuantConfig(**{"w_bits": w_bits, "a_bits": a_bits, "hadamard": False,
                                   "group_size": 64, **overrides})
    return quamba.quantize(fp, tok, config, calib_data=calib, progress=False), tok


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_model_dir, tiny_mamba2_dir):
    """{(fixture, recipe): (quantized model, export directory)}."""
    dirs = {"tiny-mamba": tiny_model_dir, "tiny-mamba2": tiny_mamba2_dir}
    out = {}
    for fixture, recipe in CASES:
        qmodel, _ = _quantized(dirs[fixture], recipe)
        target = tmp_path_factory.mktemp("export") / f"{fixture}-{recipe}"
        export(qmodel, target)
        out[fixture, recipe] = qmodel, target
    return out


def _read(target):
    return json.loads((target / "config.json").read_text()), load_file(target / "model.safetensors")


@pytest.mark.parametrize("fixture,recipe", CASES)
def test_what_vllm_reads(exports, fixture, recipe):
    _, target = exports[fixture, recipe]
    config, tensors = _read(target)
    family = config["model_type"]
    assert family == {"tiny-mamba": "mamba", "tiny-mamba2": "mamba2"}[fixture]
    assert all(field in config for field in VLLM_CONFIG_FIELDS[family])
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors"
    assert quant["format"] == {"w8a8": "int-quantized", "w4a16": "pack-quantized"}[recipe]
    for group in quant["config_groups"].values():
        _check_vllm_scheme(group["weights"], group["input_activations"], quant["format"])
    targets = [t for g in quant["config_groups"].values() for t in g["targets"]]
    linears = VLLM_QUANTIZED_LINEARS[family]
    assert sorted(targets) == sorted(rf"re:.*mixer\.{name}$" for name in linears)
    assert "lm_head" in quant["ignore"] and r"re:.*mixer\.conv1d$" in quant["ignore"]
    assert set(tensors) == _expected_names(config, linears, VLLM_SCHEME_TENSORS[quant["format"]])


def _check_vllm_scheme(weights, inputs, fmt):
    """The conditions under which vLLM picks CompressedTensorsW8A8Int8 (static) or
    CompressedTensorsWNA16."""
    assert weights["type"] == "int" and weights["symmetric"] and not weights["dynamic"]
    if fmt == "int-quantized":
        assert weights["num_bits"] == inputs["num_bits"] == 8
        assert weights["strategy"] in ("tensor", "channel") and inputs["strategy"] == "tensor"
        assert not inputs["dynamic"] and inputs["symmetric"]
    else:
        assert inputs is None and weights["num_bits"] in (4, 8)
        assert weights["strategy"] in ("group", "channel")


def _expected_names(config, linears, scheme_tensors):
    family = config["model_type"]
    names = {"backbone.embeddings.weight", "backbone.norm_f.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        prefix = f"backbone.layers.{i}"
        names.add(f"{prefix}.norm.weight")
        names |= {f"{prefix}.mixer.{t}" for t in VLLM_FP_MIXER_TENSORS[family]}
        names |= {f"{prefix}.mixer.{lin}.{t}" for lin in linears for t in scheme_tensors}
    return names


def test_tensor_formats(exports):
    qmodel, target = exports["tiny-mamba", "w4a16"]
    _, tensors = _read(target)
    linear = qmodel.backbone.layers[0].mixer.in_proj
    packed = tensors["backbone.layers.0.mixer.in_proj.weight_packed"]
    assert packed.dtype == torch.int32 and packed.shape == (384 * 2, 192 // 8)
    assert torch.equal(tensors["backbone.layers.0.mixer.in_proj.weight_shape"],
                       torch.tensor([768, 192]))
    assert torch.equal(tensors["backbone.layers.0.mixer.in_proj.weight_scale"].half(),
                       linear.scales)
    qmodel, target = exports["tiny-mamba", "w8a8"]
    _, tensors = _read(target)
    linear = qmodel.backbone.layers[1].mixer.out_proj
    assert torch.equal(tensors["backbone.layers.1.mixer.out_proj.weight"], linear.weight)
    assert tensors["backbone.layers.1.mixer.out_proj.input_scale"].item() == pytest.approx(
        linear.scales["in_scale"], rel=0)


def test_pack_int32_is_compressed_tensors_packing():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    codes = torch.randint(-7, 8, (5, 64), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    assert torch.equal(pack_int32(codes), ct.pack_to_int32(codes, 4))
    assert torch.equal(ct.unpack_from_int32(pack_int32(codes), 4, codes.shape), codes)


def _transformers_model(target, recipe):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    # W4A16: dequantized at load (transformers' Mamba weight init reads out_proj.weight, which a
    # packed module lacks); W8A8 runs compressed: int8 weights, inputs fake-quantized
    extra = ({"quantization_config": CompressedTensorsConfig(dequantize=True)}
             if recipe == "w4a16" else {})
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, **extra).eval()


def _logits(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("fixture,recipe", CASES)
@torch.no_grad()
def test_transformers_logits_equal_quambas(exports, fixture, recipe):
    qmodel, target = exports[fixture, recipe]
    hf = _transformers_model(target, recipe)
    codes = _watch_input_codes(hf) if recipe == "w8a8" else None
    ids = torch.randint(0, 4000, (2, 64), generator=torch.Generator().manual_seed(0))
    expected = _logits(reference_model(qmodel), ids)
    got = _logits(hf, ids)[..., :expected.shape[-1]]
    if recipe == "w4a16":  # decompressed weights are quamba's dequantized ones, bit for bit
        assert torch.equal(hf.backbone.layers[0].mixer.out_proj.weight,
                           reference_model(qmodel).backbone.layers[0].mixer.out_proj.weight)
    if codes is not None:
        # The stated W8A8 bound: per input element the engine's code (x / s, clamp [-128, 127])
        # and quamba's (x · fp32(1/s), clamp [-127, 127]) differ by at most one step; where none
        # differs, the logits agree to float tolerance (on these inputs none did)
        assert max(codes["max_step"]) <= 1
        assert sum(codes["differing"]) == 0
    assert (got - expected).abs().max().item() <= 1e-4


def _watch_input_codes(model):
    """Hooks recording, per quantized linear call, how far the two int8 rules' codes are apart."""
    seen = {"max_step": [], "differing": []}

    def hook(module, args):
        x, scale = args[0].float(), module.input_scale.float()
        engine = torch.round(x / scale).clamp(-128, 127)
        steps = (engine - quamba_quantize(x, scale).float()).abs()
        seen["max_step"].append(steps.max().item())
        seen["differing"].append(int((steps > 0).sum()))

    for module in model.modules():
        if hasattr(module, "input_scale"):
            module.register_forward_pre_hook(hook)
    return seen


def test_refusals(tiny_model_dir, tmp_path):
    rotated, _ = _quantized(tiny_model_dir, "w8a8", hadamard=True)
    with pytest.raises(quamba.QuambaError, match="Hadamard-rotated"):
        export(rotated, tmp_path / "rotated")
    w4a8, _ = _quantized(tiny_model_dir, "w8a8", w_bits=4)
    with pytest.raises(quamba.QuambaError, match="W4A8 cannot be exported"):
        export(w4a8, tmp_path / "w4a8")
    assert not (tmp_path / "rotated").exists() and not (tmp_path / "w4a8").exists()


def test_command_line_from_a_saved_model(tiny_model_dir, tmp_path, capsys):
    from quamba.quantization.checkpoint import save_quantized
    qmodel, tok = _quantized(tiny_model_dir, "w8a8")
    save_quantized(qmodel, tmp_path / "saved" / "tiny-w8a8", tok)
    out = tmp_path / "out"
    assert export_main(["tiny-w8a8", str(out), "--pretrained_dir", str(tmp_path / "saved")]) == 0
    record = json.loads((out / EXPORT_RECORD).read_text())
    assert {"conv1d", "scan", "dt_proj", "lm_head"} <= set(record["kept_fp"])
    assert (out / "tokenizer.json").is_file()
    assert "kept in float" in capsys.readouterr().out
    assert export_main(["tiny-w8a8", str(out), "--pretrained_dir", str(tmp_path / "saved")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert export_main([str(tmp_path / "saved" / "tiny-w8a8"), str(out), "--overwrite"]) == 0
