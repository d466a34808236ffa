"""Falcon-H1 quantized: W8A8, W4A8 and W4A16 on the random model of tests/models/test_falcon_h1.py
without its biases (3 layers of parallel Mamba2 and attention, then a GatedMLP; every µP
multiplier ≠ 1): error against FP in every SSM mode, the one int8 input of both branches,
per-token inputs, decode against prefill, save and reload, what is refused.

Measured (2 × 37 tokens, calibration 8 × 64 random tokens): relative error of the logits
(‖q - fp‖ / ‖fp‖) and top-1 agreement with FP: W8A8 0.052 / 0.932, W4A8 0.367 / 0.676, W4A16
0.362 / 0.676 (4-bit weights in one group of 36, the hidden size, are coarse); with the gated
RMSNorm, tied embeddings and Δ's floor W8A8 0.075 / 0.865 (cast to bf16 this FP model is
0.017 off).
"""
import copy

import pytest
import torch

import quamba
from quamba.calibrate import calibrate
from quamba.layers.qmixer2 import QMamba2Mixer
from quamba.layers.qnorm import QRMSNorm
from quamba.layers.qtransformer import QAttention
from quamba.models.bamba import ScaledEmbedding
from quamba.models.falcon_h1 import FalconH1Config, ParallelMixer, SiluGate
from quamba.models.mamba2 import GatedRMSNorm
from quamba.models.quantized_hybrid import QuantizedFalconH1LM
from quamba.ops.quant import quantize
from quamba.ops.quant4 import pack_int4
from quamba.quantization.gptq import block_stages, gptq_quantize, gptq_sequential_
from tests.models import hybrid_checks as fp_checks
from tests.models.test_falcon_h1 import ids, random_reference
from tests.quantization.hybrid_checks import (INT8_MODES, assert_close_to_fp,
                                              assert_decode_continues_the_prefill,
                                              assert_older_quamba_refuses,
                                              assert_quantize_refuses,
                                              assert_reload_is_bit_identical, logits, quantize_on,
                                              quantize_recipes, reloaded_in, rel)

NO_BIAS = dict(attention_bias=False, mlp_bias=False, mamba_proj_bias=False, projectors_bias=False)
# recipe → (w_bits, a_bits, bound on the relative error, bound on top-1 agreement)
RECIPES = {"w8a8": (8, 8, 0.07, 0.9), "w4a8": (4, 8, 0.45, 0.6), "w4a16": (4, 16, 0.45, 0.6)}


def load(directory, **changes):
    return fp_checks.load(fp_checks.saved(random_reference(**{**NO_BIAS, **changes}), directory))


def quantized_model(fp_model, w_bits=8, a_bits=8, **changes):
    return quantize_on(fp_model, ids(8, 64, seed=5), w_bits, a_bits, **changes)


@pytest.fixture(scope="module")
def fp_model(tmp_path_factory):
    return load(tmp_path_factory.mktemp("falcon_h1"))


@pytest.fixture(scope="module")
def quantized(fp_model):
    return quantize_recipes(fp_model, ids(8, 64, seed=5), RECIPES)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_close_to_the_fp_model(quantized, fp_model, recipe):
    _, a_bits, bound, top1 = RECIPES[recipe]
    assert_close_to_fp(quantized[recipe], fp_model, ids(2, 37, seed=1), a_bits, bound, top1)


def test_both_branches_read_one_int8_input(quantized):
    """The QRMSNorm's codes go to in_proj and to q, k, v, all at its scale; o_proj's and
    down_proj's inputs are quantized per token, gate's and up's statically."""
    qmodel = quantized["w8a8"]
    assert isinstance(qmodel, QuantizedFalconH1LM) and not qmodel.quant_config.hadamard
    assert isinstance(qmodel.backbone.embedding, ScaledEmbedding)
    block = qmodel.backbone.layers[2]
    assert isinstance(block.norm, QRMSNorm) and isinstance(block.mixer, ParallelMixer)
    mamba, attention = block.mixer.mamba, block.mixer.self_attn
    assert isinstance(mamba, QMamba2Mixer) and isinstance(mamba.norm, SiluGate)
    assert isinstance(attention, QAttention)
    h_scale = block.norm.scales["out_scale"]
    assert mamba.in_proj.scales["in_scale"] == h_scale
    for name in "qkv":
        linear = getattr(attention, f"{name}_proj")
        assert not linear.dynamic and linear.linear.scales["in_scale"] == h_scale
    mlp = qmodel.backbone.layers[3].mixer
    assert attention.o_proj.dynamic and mlp.down_proj.dynamic
    assert not (mlp.gate_proj.dynamic or mlp.up_proj.dynamic)


def test_calibration_observes_both_branches(fp_model):
    """The parallel block: the Mamba2 mixer's kinds (its in_proj.input the normed input of both
    branches) and the attention linears' inputs; the feed-forward block: the GatedMLP's."""
    ranges = calibrate(fp_model, ids(2, 16, seed=0), progress=False)
    kinds = {"in_proj.input", "z", "x", "ssm_state", "out_proj.input", "o_proj.input"}
    assert kinds <= set(ranges[0])
    assert {"in_proj.input", "down_proj.input"} <= set(ranges[1]) and "ssm_state" not in ranges[1]


def test_int8_codes_into_a_static_linear_equal_its_float_input(quantized):
    """What q, k and v compute from the shared codes is what they would from the float input."""
    q_proj = quantized["w8a8"].backbone.layers[0].mixer.self_attn.q_proj
    x = torch.randn(2, 9, 36) * 3
    codes = quantize(x, q_proj.linear.scales["in_scale"])
    assert torch.equal(q_proj(codes), q_proj(x))


def test_per_token_o_proj_holds_where_static_does_not(fp_model, monkeypatch):
    """o_proj alone quantized (W8A8): its input per tensor static costs 1.7× the error of per
    token (measured 0.0254 against 0.0149; the whole W8A8 model 0.059 against 0.052)."""
    tokens = ids(2, 37, seed=1)
    reference = logits(fp_model, tokens)
    errors = {}
    for dynamic in (("o_proj",), ()):
        monkeypatch.setattr(FalconH1Config, "dynamic_inputs", ("down_proj", *dynamic))
        qmodel = copy.deepcopy(fp_model)
        for block, qblock in zip(qmodel.backbone.layers, quantized_model(fp_model).backbone.layers):
            if isinstance(block.mixer, ParallelMixer):
                block.mixer.self_attn.o_proj = qblock.mixer.self_attn.o_proj
        errors[dynamic] = rel(logits(qmodel, tokens), reference)
    assert errors[("o_proj",)] < 0.02 < errors[()]


def test_gated_norm_tied_embeddings_and_dt_floor(tmp_path):
    """mamba_rms_norm: the gated RMSNorm, its weight folded into out_proj; Δ's floor kept."""
    fp = load(tmp_path / "fp", mamba_rms_norm=True, mamba_norm_before_gate=False,
              tie_word_embeddings=True, head_dim=10, time_step_limit=(0.05, float("inf")))
    qmodel, tokens = quantized_model(fp), ids(2, 37, seed=1)
    mamba = qmodel.backbone.layers[0].mixer.mamba
    assert isinstance(mamba.norm, GatedRMSNorm) and mamba.dt_floor is not None
    assert qmodel.lm_head.weight is qmodel.backbone.embedding.weight
    assert_close_to_fp(qmodel, fp, tokens, 8, 0.1, 0.8)
    assert_reload_is_bit_identical(qmodel, tmp_path / "q", tokens, QuantizedFalconH1LM, 10, 8)


def test_a_bf16_model_keeps_bf16_in_every_mode(fp_model, tmp_path):
    """The attention branch reads the norm's codes (fake-quantized fp32 in float-sim mode) and
    still answers in bf16. Measured 0.051 to 0.052 from the fp32 FP model."""
    random_reference(**NO_BIAS).save_pretrained(tmp_path)
    half = quamba.load_model(tmp_path, dtype="bf16", tokenizer=False)[0]
    qmodel, tokens = quantized_model(half), ids(2, 37, seed=1)
    reference = logits(fp_model, tokens)
    for mode in INT8_MODES:
        qmodel.set_ssm_mode(mode)
        with torch.no_grad():
            out = qmodel(tokens)
        assert out.dtype == torch.bfloat16 and rel(out, reference) < 0.07, mode


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_decode_continues_the_prefill(quantized, recipe):
    """With an fp32 decode state the steps equal the prefill (to float rounding), RoPE's
    positions and both branches' states included; with the int8 state W8A8 within 0.02."""
    bounds = {"fp32": 1e-4, "int8": 0.02} if recipe == "w8a8" else {"fp32": 1e-4}
    assert_decode_continues_the_prefill(quantized[recipe], ids(3, 29, seed=2), bounds)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_reload_is_bit_identical(quantized, recipe, tmp_path):
    qmodel = quantized[recipe]
    reloaded = assert_reload_is_bit_identical(qmodel, tmp_path / recipe, ids(2, 37, seed=1),
                                              QuantizedFalconH1LM, 10, RECIPES[recipe][1])
    assert reloaded.config == qmodel.config


def test_a_quamba_that_knows_format_9_refuses_it(quantized, tmp_path, monkeypatch):
    assert_older_quamba_refuses(quantized["w8a8"], tmp_path / "q", monkeypatch, 10)


def test_reloaded_in_another_dtype(quantized, tmp_path):
    """from_pretrained's dtype casts the float parts, those of the parallel blocks too."""
    qmodel, tokens = quantized["w8a8"], ids(2, 37, seed=1)
    reloaded = reloaded_in(qmodel, tmp_path / "q", "bfloat16")
    out = logits(reloaded, tokens)
    assert reloaded.backbone.layers[0].mixer.mamba.out_dtype == torch.bfloat16
    assert rel(out, logits(qmodel, tokens)) < 0.05


@pytest.mark.parametrize("head, bound", [("int8", 0.07), ("int4", 0.15)])
def test_a_quantized_lm_head_takes_the_logits_multiplier_after_it(fp_model, head, bound, tmp_path):
    """Measured W8A8 with an int8 head 0.053, an int4 head 0.114."""
    qmodel, tokens = quantized_model(fp_model, lm_head=head), ids(2, 37, seed=1)
    assert rel(logits(qmodel, tokens), logits(fp_model, tokens)) < bound
    assert_reload_is_bit_identical(qmodel, tmp_path, tokens, QuantizedFalconH1LM, 10, 8)


def test_exports_in_the_falcon_h1_layout(quantized, tmp_path):
    """tests/export/test_export_hybrids.py checks the export against transformers and vLLM."""
    record = quamba.export(quantized["w8a8"], tmp_path / "out")
    assert record["architecture"] == "FalconH1ForCausalLM"


def test_gptq_takes_both_branches_of_a_parallel_block_together(fp_model, tmp_path):
    """W4A8 with the most sensitive third of the blocks W4A16, then GPTQ: a parallel block's
    in_proj, q, k and v from one forward, out_proj and o_proj from a second; q_proj's Hessian is
    that of the norm's int8 codes it reads, dequantized. Reloads bit-identically."""
    qmodel = quantized_model(fp_model, 4, 8, mixed_precision=0.34)
    layer = next(i for i, bits in enumerate(qmodel.quant_config.layer_bits)
                 if bits == (4, 8) and not i % 2)
    mixer, fp_mixer = qmodel.backbone.layers[layer].mixer, fp_model.backbone.layers[layer].mixer
    stages = block_stages(mixer, fp_mixer, ("in_proj", "out_proj"))
    assert [[fp_linear for _, fp_linear in stage] for stage in stages] == [
        [fp_mixer.mamba.in_proj, *(getattr(fp_mixer.self_attn, f"{n}_proj") for n in "qkv")],
        [fp_mixer.mamba.out_proj, fp_mixer.self_attn.o_proj]]
    tokens = ids(3, 16, seed=4)
    gptq_sequential_(qmodel, fp_model, tokens, batch_size=3, progress=False)
    q_proj = mixer.self_attn.q_proj
    in_scale = q_proj.linear.scales["in_scale"]
    inputs = []
    handle = q_proj.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    with torch.no_grad():
        qmodel(tokens)
    handle.remove()
    assert inputs[0].dtype == torch.int8
    rows = inputs[0].reshape(-1, inputs[0].shape[-1]).float() * in_scale
    codes = gptq_quantize(fp_mixer.self_attn.q_proj.weight.float(),
                          rows.T @ rows * (2.0 / len(rows)), q_proj.linear.group_scales(),
                          q_proj.linear.group_size)
    assert torch.equal(q_proj.linear.weight, pack_int4(codes))
    assert_reload_is_bit_identical(qmodel, tmp_path, ids(2, 37, seed=1), QuantizedFalconH1LM, 10,
                                   8)


@pytest.mark.parametrize("changes, message", [
    (dict(learn_scales=True), "learn_scales is not supported for falcon_h1 yet"),
    (dict(quantize_embedding=True), "quantize_embedding is not supported for falcon_h1 with an "
                                    "embedding_multiplier"),
])
def test_unsupported_recipes_are_refused_in_one_line(fp_model, changes, message):
    assert_quantize_refuses(fp_model, ids(2, 16, 0), f"^{message}$", **changes)


@pytest.mark.parametrize("changes, message", [
    (dict(attention_bias=True), "falcon_h1 with attention_bias is not supported by the quantized "
                                "linears"),
    (dict(mamba_proj_bias=True, projectors_bias=True),
     "models with biases in in_proj and out_proj are not supported by the quantized layers"),
])
def test_biased_models_are_refused_in_one_line(tmp_path, changes, message):
    assert_quantize_refuses(load(tmp_path, **changes), ids(2, 16, 0), f"^{message}$")
