"""quamba.export of the quantized hybrids (Nemotron-H): small random models quantized W8A8 and
W4A16, exported, checked against what vLLM's model class loads (its names and quantized modules,
read from its source; vLLM is not run) and loaded by transformers + compressed-tensors, whose
logits are compared with quamba's model in the export's configuration (reference_model).

Measured (2 × 37 tokens; logits up to about 5): W4A16, dense and MoE patterns, at most 2.7e-6
off (float rounding of the two scans; bound 1e-4). W8A8, dense pattern: 4 elements of the static
inputs' codes differ from quamba's, by one step (the stated bound: saturation below -127.5 and
rounding ties); the per-token inputs differ by rule (compressed-tensors scales by absmax / 127.5,
quamba and vLLM by absmax / 127): 0.014 relative (0.126 at most) against quamba's rule, 0.0011
relative (0.020 at most) against the reference with compressed-tensors' rule (bounds 0.03 and
0.003)."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file

import quamba
from quamba.export import EXPORT_RECORD, export, reference_model
from quamba.export import reference as export_reference
from tests.models.hybrid_checks import randomize_, rel, token_ids

pytest.importorskip("compressed_tensors")
from transformers import (AutoModelForCausalLM, CompressedTensorsConfig,  # noqa: E402
                          NemotronHConfig, NemotronHForCausalLM)

# Sizes 4-bit packing takes (input widths multiples of 8): 6 Mamba heads of 8 in 2 groups,
# d_state 5, chunk 8 (37 tokens end in a partial chunk); 3 attention heads of 8 over 1 KV head;
# 6 experts in 2 groups; the shared expert a different size
NEMOTRON_H = dict(vocab_size=97, hidden_size=32, mamba_num_heads=6, mamba_head_dim=8, n_groups=2,
                  ssm_state_size=5, chunk_size=8, num_attention_heads=3, num_key_value_heads=1,
                  head_dim=8, intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2,
                  n_group=2, topk_group=1, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=24, routed_scaling_factor=1.5,
                  time_step_min=0.01, tie_word_embeddings=False)
PATTERNS = {"dense": "M*M-*-M", "moe": "M*E-EM"}
RECIPES = {"w8a8": (8, 8), "w4a16": (4, 16)}
CASES = [("dense", "w8a8"), ("dense", "w4a16"), ("moe", "w4a16")]

# What vLLM's NemotronHForCausalLM (vllm/model_executor/models/nemotron_h.py) loads: tensor
# names backbone.* → model.*, embeddings → embed_tokens, A_log → A, q/k/v stacked into qkv_proj
# (one scheme and input scale for the three); the modules built with its quant_config (Mamba
# in_proj / out_proj, qkv_proj, o_proj, the MLP's and the shared expert's up_proj / down_proj,
# the routed experts' up_proj / down_proj through FusedMoE), and those built without (conv1d,
# the router GateLinear); it reads hybrid_override_pattern
VLLM_QUANTIZED = {"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                  "down_proj"}
VLLM_STACKED = ("q_proj", "k_proj", "v_proj")
VLLM_SCHEME_TENSORS = {"int-quantized": {"weight", "weight_scale", "input_scale"},
                       "pack-quantized": {"weight_packed", "weight_scale", "weight_shape"}}


@pytest.fixture(scope="module")
def fp_dirs(tmp_path_factory):
    """{pattern name: directory of a random transformers Nemotron-H}."""
    dirs = {}
    for name, pattern in PATTERNS.items():
        torch.manual_seed(0)
        config = NemotronHConfig(**NEMOTRON_H, hybrid_override_pattern=pattern,
                                 experts_implementation="eager")
        dirs[name] = tmp_path_factory.mktemp(f"nemotron-h-{name}")
        randomize_(NemotronHForCausalLM(config).eval()).save_pretrained(dirs[name])
    return dirs


def _quantized(fp_dir, recipe):
    fp = quamba.load_model(fp_dir, tokenizer=False)[0]
    w_bits, a_bits = RECIPES[recipe]
    config = quamba.QuantConfig(w_bits=w_bits, a_bits=a_bits, group_size=8)
    return quamba.quantize(fp, None, config, calib_data=token_ids(97, 8, 64, seed=5),
                           progress=False)


@pytest.fixture(scope="module")
def exports(fp_dirs, tmp_path_factory):
    """{(pattern, recipe): (quantized model, export directory)}."""
    out = {}
    for pattern, recipe in CASES:
        qmodel = _quantized(fp_dirs[pattern], recipe)
        target = tmp_path_factory.mktemp("export") / f"{pattern}-{recipe}"
        export(qmodel, target)
        out[pattern, recipe] = qmodel, target
    return out


@pytest.mark.parametrize("pattern,recipe", CASES)
def test_what_vllm_reads(exports, fp_dirs, pattern, recipe):
    _, target = exports[pattern, recipe]
    config = json.loads((target / "config.json").read_text())
    tensors = load_file(target / "model.safetensors")
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert config["hybrid_override_pattern"] == PATTERNS[pattern]
    quant = config["quantization_config"]
    fmt = quant["format"]
    assert fmt == {"w8a8": "int-quantized", "w4a16": "pack-quantized"}[recipe]
    groups = quant["config_groups"].values()
    targets = {t for g in groups for t in g["targets"]}
    assert {t.rsplit("\\.", 1)[-1].rstrip("$") for t in targets} <= VLLM_QUANTIZED
    assert set(quant["ignore"]) == {"lm_head", r"re:.*mixer\.conv1d$", r"re:.*mixer\.gate$"}
    fp_names = set(load_file(fp_dirs[pattern] / "model.safetensors"))
    quantized = {name[:-len(".weight")] for name in fp_names
                 if name.split(".")[-2] in VLLM_QUANTIZED and name.endswith(".weight")}
    expected = fp_names - {f"{m}.weight" for m in quantized}
    for module in quantized:
        expected |= {f"{module}.{t}" for t in _scheme_tensors(_group_of(groups, module), fmt)}
    assert quantized and set(tensors) == expected
    _check_stacked_share_input_scales(tensors, len(PATTERNS[pattern]))


def _group_of(groups, module: str) -> dict:
    """The one config group whose targets match ``module`` (vLLM refuses a quantizable layer
    that matches none)."""
    matching = [g for g in groups if any(re.match(t[3:], module) for t in g["targets"])]
    assert len(matching) == 1, module
    return matching[0]


def _scheme_tensors(group: dict, fmt: str) -> set:
    """The tensors vLLM's scheme of ``group`` loads: no input_scale for a per-token input."""
    inputs = group["input_activations"]
    return VLLM_SCHEME_TENSORS[fmt] - ({"input_scale"} if inputs and inputs["dynamic"] else set())


def _check_stacked_share_input_scales(tensors, n_layers: int) -> None:
    """vLLM runs q, k and v as one qkv_proj GEMM behind one input quantizer."""
    for i in range(n_layers):
        scales = [tensors.get(f"backbone.layers.{i}.mixer.{p}.input_scale") for p in VLLM_STACKED]
        if scales[0] is not None:
            assert all(torch.equal(s, scales[0]) for s in scales)


def test_the_per_token_inputs_are_a_dynamic_group(exports):
    qmodel, target = exports["dense", "w8a8"]
    groups = json.loads((target / "config.json").read_text())["quantization_config"][
        "config_groups"].values()
    dynamic = [g for g in groups if g["input_activations"]["dynamic"]]
    assert len(dynamic) == 1 and dynamic[0]["targets"] == [r"re:.*\.down_proj$"]
    assert dynamic[0]["input_activations"]["strategy"] == "token"
    tensors = load_file(target / "model.safetensors")
    assert "backbone.layers.3.mixer.down_proj.input_scale" not in tensors
    record = json.loads((target / EXPORT_RECORD).read_text())
    assert {"routers", "scan", "conv1d"} <= set(record["kept_fp"])
    assert "dt_proj" not in record["kept_fp"]


def _transformers_model(target, recipe):
    # W4A16 is dequantized at load (the fused experts hold no Linear modules); W8A8 runs
    # compressed: int8 weights, inputs fake-quantized by compressed-tensors
    extra = ({"quantization_config": CompressedTensorsConfig(dequantize=True)}
             if recipe == "w4a16" else {})
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32,
                                                experts_implementation="eager", **extra).eval()


@pytest.mark.parametrize("pattern", list(PATTERNS))
@torch.no_grad()
def test_w4a16_transformers_logits_equal_quambas(exports, pattern):
    qmodel, target = exports[pattern, "w4a16"]
    ids = token_ids(97, 2, 37, seed=1)
    expected = reference_model(qmodel)(ids)
    assert (_transformers_model(target, "w4a16")(ids).logits - expected).abs().max() <= 1e-4


@torch.no_grad()
def test_w8a8_transformers_logits_within_the_stated_bound(exports, monkeypatch):
    """Static inputs: every code within one step of quamba's (4 elements differed here). Per-token
    inputs: compressed-tensors' absmax / 127.5 against quamba's / 127 (vLLM's rule too), 0.014
    relative on these logits; with compressed-tensors' rule in the reference, 0.0011."""
    qmodel, target = exports["dense", "w8a8"]
    hf = _transformers_model(target, "w8a8")
    steps = _watch_static_codes(hf)
    ids = token_ids(97, 2, 37, seed=1)
    got = hf(ids).logits
    assert max(steps) <= 1
    assert rel(got, reference_model(qmodel)(ids)) < 0.03
    monkeypatch.setattr(export_reference, "per_token_scales",
                        lambda x: x.abs().amax(-1, keepdim=True).float() / 127.5)
    assert rel(got, reference_model(qmodel)(ids)) < 0.003


def _watch_static_codes(model) -> list[float]:
    """Per call of a statically quantized linear: how far compressed-tensors' codes of its
    input (x / s, clamp [-128, 127]) are from quamba's (quamba.ops.quant.quantize)."""
    from quamba.ops.quant import quantize
    steps = []

    def hook(module, args):
        x, scale = args[0].float(), module.input_scale.float()
        engine = torch.round(x / scale).clamp(-128, 127)
        steps.append((engine - quantize(x, scale).float()).abs().max().item())

    for module in model.modules():
        if hasattr(module, "input_scale"):
            module.register_forward_pre_hook(hook)
    return steps


def test_w8a8_moe_is_refused_in_one_line(fp_dirs, tmp_path):
    qmodel = _quantized(fp_dirs["moe"], "w8a8")
    with pytest.raises(quamba.QuambaError, match="^W8A8 MoE layers cannot be exported: "):
        export(qmodel, tmp_path / "out")
    assert not (tmp_path / "out").exists()
