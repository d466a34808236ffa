"""quamba.export of the quantized hybrids (Nemotron-H, Bamba, dense Granite-4.0-H, Jamba): small
random models quantized W8A8 and W4A16, exported, checked against what vLLM's model classes load
(names, quantized modules, stacked linears, read from its source; vLLM is not run) and loaded by
transformers + compressed-tensors, whose logits are compared with quamba's model in the export's
configuration (reference_model).

Measured (2 × 37 tokens; logits up to about 5): W4A16 (Nemotron-H dense and MoE, Bamba, Granite,
Jamba dense and MoE) at most 6.2e-6 off (float rounding of the two scans; bound 1e-4). W8A8
(Nemotron-H dense, Bamba, Granite, Jamba): with compressed-tensors' int8 rules in the reference,
the logits are equal (0.0; Granite 4.8e-7, its residual_multiplier divided out of the output
linears' scales again), so the export is what compressed-tensors computes. Against quamba's rules
they differ by rule alone, by at most one step per input element: static codes round(x / s)
clamped to [-128, 127] against quamba's [-127, 127] (4, 1, 5 and 0 elements differed),
per-token scales absmax / 127.5 against quamba's (and vLLM's) absmax / 127, whose extreme
negative element becomes -128: 0.014, 0.027, 0.022 and 0.064 relative (Jamba's o_proj is per
token too; bound 0.1).
"""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quamba
from quamba.export import EXPORT_RECORD, export, reference_model
from quamba.export import reference as export_reference
from tests.models.hybrid_checks import randomize_, rel, token_ids

pytest.importorskip("compressed_tensors")
from transformers import (AutoModelForCausalLM, BambaConfig, BambaForCausalLM,  # noqa: E402
                          CompressedTensorsConfig, FalconH1Config, FalconH1ForCausalLM,
                          GraniteMoeHybridConfig,
                          GraniteMoeHybridForCausalLM, JambaConfig, JambaForCausalLM,
                          NemotronHConfig, NemotronHForCausalLM, Zamba2Config,
                          Zamba2ForCausalLM)

# Sizes 4-bit packing takes (input widths multiples of 8). Nemotron-H: 6 Mamba heads of 8 in 2
# groups, d_state 5, chunk 8 (37 tokens end in a partial chunk); 3 attention heads of 8 over 1
# KV head; 6 experts in 2 groups, the shared expert a different size. Bamba: 8 Mamba heads of 8
# in 2 groups, 4 attention heads of 8 over 1 KV head with RoPE on half of each. Dense
# Granite-4.0-H: Bamba's sizes, RoPE on all of each head, its µP multipliers, tied embeddings
NEMOTRON_H = dict(vocab_size=97, hidden_size=32, mamba_num_heads=6, mamba_head_dim=8, n_groups=2,
                  ssm_state_size=5, chunk_size=8, num_attention_heads=3, num_key_value_heads=1,
                  head_dim=8, intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2,
                  n_group=2, topk_group=1, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=24, routed_scaling_factor=1.5,
                  time_step_min=0.01, tie_word_embeddings=False, experts_implementation="eager")
BAMBA = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, attn_layer_indices=[1],
             mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=5, mamba_chunk_size=8,
             num_attention_heads=4, num_key_value_heads=1, intermediate_size=24,
             time_step_limit=(0.01, float("inf")), tie_word_embeddings=False)
GRANITE = dict(BAMBA, layer_types=["mamba", "attention", "mamba", "mamba"],
               shared_intermediate_size=24, num_local_experts=0, position_embedding_type="rope",
               embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2,
               logits_scaling=2.5, tie_word_embeddings=True)
del GRANITE["attn_layer_indices"], GRANITE["intermediate_size"]
# Jamba: Mamba1 mixers (d_inner 64, dt_rank 8, d_state 5) and attention (4 heads of 8 over 1 KV
# head) alternating; the MoE variant's experts on every other layer
JAMBA = dict(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=1, attn_layer_period=2,
             attn_layer_offset=1, num_experts=1, num_experts_per_tok=1, mamba_d_state=5,
             mamba_expand=2, mamba_dt_rank=8, tie_word_embeddings=False,
             use_mamba_kernels=False, experts_implementation="eager")
# Falcon-H1: 6 Mamba heads of 8 in 2 groups beside 4 attention heads of 8 over 1 KV head, every
# µP multiplier away from 1 (ssm_multipliers a different one for each part of in_proj's rows)
FALCON_H1 = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, intermediate_size=24,
                 mamba_d_ssm=48, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=5,
                 mamba_chunk_size=8, num_attention_heads=4, num_key_value_heads=1,
                 tie_word_embeddings=False, embedding_multiplier=1.7, lm_head_multiplier=0.6,
                 key_multiplier=1.3, attention_in_multiplier=0.8, attention_out_multiplier=1.2,
                 ssm_in_multiplier=0.9, ssm_out_multiplier=1.4,
                 ssm_multipliers=[0.7, 1.3, 0.8, 1.2, 0.5], mlp_multipliers=[1.1, 0.75])
# Zamba2: Mamba2 layers (8 heads of 8 in 2 groups) and hybrid ones running 2 shared blocks in
# turn (attention over [h, embedding]: 4 heads of 16, RoPE; LoRA adapters of rank 4 per use)
ZAMBA2 = dict(vocab_size=97, hidden_size=32, num_hidden_layers=6,
              layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
              mamba_d_state=5, n_mamba_heads=8, mamba_ngroups=2, chunk_size=8,
              num_attention_heads=4, num_key_value_heads=4, intermediate_size=24,
              num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4,
              use_mem_rope=True, time_step_min=0.01)
# model name → (transformers config class, model class, its config)
MODELS = {
    "nemotron-h": (NemotronHConfig, NemotronHForCausalLM,
                   dict(NEMOTRON_H, hybrid_override_pattern="M*M-*-M")),
    "nemotron-h-moe": (NemotronHConfig, NemotronHForCausalLM,
                       dict(NEMOTRON_H, hybrid_override_pattern="M*E-EM")),
    "bamba": (BambaConfig, BambaForCausalLM, BAMBA),
    "granite-dense": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, GRANITE),
    "jamba": (JambaConfig, JambaForCausalLM, JAMBA),
    "jamba-moe": (JambaConfig, JambaForCausalLM,
                  dict(JAMBA, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                       expert_layer_offset=1, intermediate_size=16)),
    "falcon-h1": (FalconH1Config, FalconH1ForCausalLM, FALCON_H1),
    "zamba2": (Zamba2Config, Zamba2ForCausalLM, ZAMBA2),
}
RECIPES = {"w8a8": (8, 8), "w4a16": (4, 16)}
TOKENIZER_DIR = Path(__file__).parents[1] / "fixtures" / "tiny-hybrid"
CASES = [("nemotron-h", "w8a8"), ("nemotron-h", "w4a16"), ("nemotron-h-moe", "w4a16"),
         ("bamba", "w8a8"), ("bamba", "w4a16"), ("granite-dense", "w8a8"),
         ("granite-dense", "w4a16"), ("jamba", "w8a8"), ("jamba", "w4a16"),
         ("jamba-moe", "w4a16"), ("falcon-h1", "w8a8"), ("falcon-h1", "w4a16"),
         ("zamba2", "w4a16")]

# What vLLM's model classes load (vllm/model_executor/models/nemotron_h.py, bamba.py,
# granitemoehybrid.py, jamba.py, falcon_h1.py, zamba2.py), by
# model_type: the checkpoint's tensor names (renamed inside vLLM: backbone. / model. prefixes,
# embeddings → embed_tokens, A_log → A, Bamba's .self_attn. dropped); the linears built with its
# quant_config (NemotronH: Mamba in_proj / out_proj, qkv_proj, o_proj, the MLP's and the shared
# expert's up_proj / down_proj, the routed experts' through FusedMoE; Bamba: Mamba in_proj /
# out_proj, qkv_proj, o_proj, gate_up_proj, down_proj; Granite: Mamba in_proj / out_proj,
# qkv_proj, o_proj, the shared MLP's input_linear / output_linear; Jamba: qkv_proj, o_proj,
# gate_up_proj, down_proj, the experts through FusedMoE; Falcon-H1: Mamba in_proj / out_proj,
# qkv_proj, o_proj; Zamba2: Mamba in_proj / out_proj, the shared blocks' qkv_proj, o_proj,
# gate_up_proj, down_proj once, each hybrid layer's linear, and its LoRA adapters, which the
# export keeps float by `ignore`), those built without (conv1d, the
# NemotronH router GateLinear, lm_head only by `ignore`), and the linears it stacks into one GEMM
# behind one input quantizer (so one input scale: q/k/v into qkv_proj, Bamba's gate/up into
# gate_up_proj). Jamba's Mamba1 mixer takes no quant_config in the versions read (as vLLM's
# Mamba1, docs/export.md): the in_proj, x_proj and out_proj it exports are float_in_vllm;
# Falcon-H1's MLP (FalconH1MLP(config)) takes none either
VLLM = {
    "nemotron_h": dict(quantized={"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                                  "up_proj", "down_proj"},
                       ignore={"lm_head", r"re:.*\.conv1d$", r"re:.*mixer\.gate$"},
                       stacked=[("q_proj", "k_proj", "v_proj")],
                       fields=("hybrid_override_pattern",)),
    "bamba": dict(quantized={"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                             "gate_proj", "up_proj", "down_proj"},
                  ignore={"lm_head", r"re:.*\.conv1d$"},
                  stacked=[("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")],
                  fields=("attn_layer_indices", "mamba_d_head", "mamba_expand")),
    "granitemoehybrid": dict(quantized={"in_proj", "out_proj", "q_proj", "k_proj", "v_proj",
                                        "o_proj", "input_linear", "output_linear"},
                             ignore={"lm_head", r"re:.*\.conv1d$"},
                             stacked=[("q_proj", "k_proj", "v_proj")],
                             fields=("layer_types", "mamba_d_head", "mamba_expand",
                                     "residual_multiplier", "embedding_multiplier",
                                     "attention_multiplier", "logits_scaling")),
    "jamba": dict(quantized={"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"},
                  float_in_vllm={"in_proj", "x_proj", "out_proj"},
                  ignore={"lm_head", r"re:.*\.conv1d$", r"re:.*\.router$", r"re:.*\.dt_proj$"},
                  stacked=[("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")],
                  fields=("attn_layer_period", "attn_layer_offset", "expert_layer_period",
                          "expert_layer_offset", "mamba_dt_rank", "mamba_expand")),
    "falcon_h1": dict(quantized={"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"},
                      float_in_vllm={"gate_proj", "up_proj", "down_proj"},
                      ignore={"lm_head", r"re:.*\.conv1d$"},
                      stacked=[("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")],
                      fields=("mamba_d_ssm", "ssm_multipliers", "ssm_in_multiplier",
                              "ssm_out_multiplier", "attention_in_multiplier",
                              "attention_out_multiplier", "key_multiplier", "mlp_multipliers",
                              "lm_head_multiplier", "embedding_multiplier")),
    "zamba2": dict(quantized={"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                              "gate_up_proj", "down_proj", "linear"},
                   ignore={"lm_head", r"re:.*\.conv1d$", r"re:.*_adapter_list\..*"},
                   stacked=[("q_proj", "k_proj", "v_proj")],
                   fields=("layers_block_type", "num_mem_blocks", "hybrid_layer_ids",
                           "adapter_rank", "use_shared_attention_adapter", "use_mem_rope")),
}
# Falcon-H1's multipliers divided out of its linears' scales again: each linear fed the engine's
# input gives quamba's output to 1.8e-6, and those float differences flip a rare code at a
# rounding tie downstream (measured 0.0069 relative)
CT_RULES_REL = {"falcon-h1": 0.02}
VLLM_SCHEME_TENSORS = {"int-quantized": {"weight", "weight_scale", "input_scale"},
                       "pack-quantized": {"weight_packed", "weight_scale", "weight_shape"}}


@pytest.fixture(scope="module")
def fp_dirs(tmp_path_factory):
    """{model name: directory of a random transformers model}."""
    dirs = {}
    for name, (config_class, model_class, config) in MODELS.items():
        torch.manual_seed(0)
        dirs[name] = tmp_path_factory.mktemp(name)
        randomize_(model_class(config_class(**config)).eval()).save_pretrained(dirs[name])
    return dirs


def _quantized(fp_dir, recipe, **overrides):
    """Quantized as the export needs: without the Hadamard rotation (hybrids are rotated by
    default where their widths allow)."""
    fp = quamba.load_model(fp_dir, tokenizer=False)[0]
    w_bits, a_bits = RECIPES[recipe]
    config = quamba.QuantConfig(**{"w_bits": w_bits, "a_bits": a_bits, "group_size": 8,
                                   "hadamard": False, **overrides})
    return quamba.quantize(fp, None, config, calib_data=token_ids(97, 8, 64, seed=5),
                           progress=False)


@pytest.fixture(scope="module")
def exports(fp_dirs, tmp_path_factory):
    """{(model name, recipe): (quantized model, export directory)}."""
    out = {}
    for name, recipe in CASES:
        qmodel = _quantized(fp_dirs[name], recipe)
        target = tmp_path_factory.mktemp("export") / f"{name}-{recipe}"
        export(qmodel, target)
        out[name, recipe] = qmodel, target
    return out


@pytest.mark.parametrize("name,recipe", CASES)
def test_what_vllm_reads(exports, fp_dirs, name, recipe):
    _, target = exports[name, recipe]
    config = json.loads((target / "config.json").read_text())
    tensors = load_file(target / "model.safetensors")
    vllm = VLLM[config["model_type"]]
    assert config["architectures"] == [MODELS[name][1].__name__]
    assert all(field in config for field in vllm["fields"])
    quant = config["quantization_config"]
    fmt = quant["format"]
    assert fmt == {"w8a8": "int-quantized", "w4a16": "pack-quantized"}[recipe]
    groups = quant["config_groups"].values()
    targets = {t for g in groups for t in g["targets"]}
    exported = vllm["quantized"] | vllm.get("float_in_vllm", set())
    assert {t.rsplit("\\.", 1)[-1].rstrip("$") for t in targets} <= exported
    assert set(quant["ignore"]) == vllm["ignore"]
    fp_names = set(load_file(fp_dirs[name] / "model.safetensors"))
    quantized = {n[:-len(".weight")] for n in fp_names
                 if n.split(".")[-2] in exported and n.endswith(".weight")}
    expected = fp_names - {f"{m}.weight" for m in quantized}
    for module in quantized:
        expected |= {f"{module}.{t}" for t in _scheme_tensors(_group_of(groups, module), fmt)}
    assert quantized and set(tensors) == expected
    _check_stacked_share_input_scales(tensors, vllm["stacked"])


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


def _check_stacked_share_input_scales(tensors, stacked) -> None:
    """vLLM runs each of ``stacked`` as one GEMM behind one input quantizer."""
    for name, scale in tensors.items():
        for first, *others in stacked:
            if name.endswith(f".{first}.input_scale"):
                assert all(torch.equal(tensors[name.replace(first, other)], scale)
                           for other in others)


def test_the_per_token_inputs_are_a_dynamic_group(exports):
    _, target = exports["nemotron-h", "w8a8"]
    groups = json.loads((target / "config.json").read_text())["quantization_config"][
        "config_groups"].values()
    dynamic = [g for g in groups if g["input_activations"]["dynamic"]]
    assert len(dynamic) == 1 and dynamic[0]["targets"] == [r"re:.*\.down_proj$"]
    assert dynamic[0]["input_activations"]["strategy"] == "token"
    tensors = load_file(target / "model.safetensors")
    assert "backbone.layers.3.mixer.down_proj.input_scale" not in tensors
    record = json.loads((target / EXPORT_RECORD).read_text())
    assert {"scan", "conv1d", "attention"} <= set(record["kept_fp"])
    assert not {"dt_proj", "routers"} & set(record["kept_fp"])  # no Mamba1 mixer, no MoE
    jamba_moe = json.loads((exports["jamba-moe", "w4a16"][1] / EXPORT_RECORD).read_text())
    assert {"dt_proj", "mixer_norms", "routers"} <= set(jamba_moe["kept_fp"])


def _transformers_model(target, recipe):
    # W4A16 is dequantized at load (the fused experts hold no Linear modules); W8A8 runs
    # compressed: int8 weights, inputs fake-quantized by compressed-tensors
    extra = ({"quantization_config": CompressedTensorsConfig(dequantize=True)}
             if recipe == "w4a16" else {})
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, **extra).eval()


@pytest.mark.parametrize("name", [name for name, recipe in CASES if recipe == "w4a16"])
@torch.no_grad()
def test_w4a16_transformers_logits_equal_quambas(exports, name):
    qmodel, target = exports[name, "w4a16"]
    ids = token_ids(97, 2, 37, seed=1)
    expected = reference_model(qmodel)(ids)
    assert (_transformers_model(target, "w4a16")(ids).logits - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("name", [name for name, recipe in CASES if recipe == "w8a8"])
@torch.no_grad()
def test_w8a8_transformers_logits_within_the_stated_bound(exports, monkeypatch, name):
    """Against quamba's int8 rules: every static code within one step of quamba's, the logits
    within the bound. With compressed-tensors' rules in the reference (static and per token):
    equal to float rounding, except Falcon-H1 (CT_RULES_REL)."""
    qmodel, target = exports[name, "w8a8"]
    hf = _transformers_model(target, "w8a8")
    steps = _watch_static_codes(hf)
    ids = token_ids(97, 2, 37, seed=1)
    got = hf(ids).logits
    assert max(steps) <= 1
    assert rel(got, reference_model(qmodel)(ids)) < 0.1
    monkeypatch.setattr(export_reference, "fake_quantize",
                        lambda x, s: torch.round(x.float() / s).clamp(-128, 127) * s)
    monkeypatch.setattr(export_reference, "per_token_scales",
                        lambda x: x.abs().amax(-1, keepdim=True).float() / 127.5)
    expected = reference_model(qmodel)(ids)
    if name in CT_RULES_REL:
        assert rel(got, expected) < CT_RULES_REL[name]
    else:
        assert (got - expected).abs().max() <= 1e-5


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


def test_granite_moe_is_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(**dict(GRANITE, num_local_experts=4, intermediate_size=16),
                                    experts_implementation="eager")
    randomize_(GraniteMoeHybridForCausalLM(config).eval()).save_pretrained(tmp_path / "fp")
    with pytest.raises(quamba.QuambaError, match="^exporting Granite-4.0-H MoE layers is not "
                       r"supported yet \(their experts"):
        export(_quantized(tmp_path / "fp", "w4a16"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_w4a8_is_refused_in_one_line(fp_dirs, tmp_path):
    qmodel = _quantized(fp_dirs["bamba"], "w8a8", w_bits=4)
    with pytest.raises(quamba.QuambaError, match="^W4A8 cannot be exported: "):
        export(qmodel, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_w8a8_zamba2_is_refused_in_one_line(fp_dirs, tmp_path):
    with pytest.raises(quamba.QuambaError, match="^W8A8 Zamba2 cannot be exported: its shared "):
        export(_quantized(fp_dirs["zamba2"], "w8a8"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_w8a8_moe_is_refused_in_one_line(fp_dirs, tmp_path):
    qmodel = _quantized(fp_dirs["nemotron-h-moe"], "w8a8")
    with pytest.raises(quamba.QuambaError, match="^W8A8 MoE layers cannot be exported: "):
        export(qmodel, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_command_line_exports_a_saved_hybrid(exports, tmp_path):
    """python -m quamba.export on a saved model: the FP parts from its recorded base_model."""
    from quamba.export.__main__ import main as export_main
    qmodel, target = exports["bamba", "w8a8"]
    qmodel.save_pretrained(tmp_path / "saved")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer saved beside it
        shutil.copy(TOKENIZER_DIR / name, tmp_path / "saved" / name)
    assert export_main([str(tmp_path / "saved"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").read_text() == (target / "config.json").read_text()
    got, expected = (load_file(d / "model.safetensors") for d in (tmp_path / "out", target))
    assert set(got) == set(expected)
    # the int8 codes and scales as exported from memory; float parts from the base model in fp16
    assert all(torch.equal(got[k], expected[k]) for k in got if "_scale" in k or
               not got[k].is_floating_point())
    assert (tmp_path / "out" / "tokenizer.json").is_file()
