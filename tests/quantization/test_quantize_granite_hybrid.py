"""Granite-4.0-H quantized: W8A8, W4A8 and W4A16 on the random MoE model of
tests/models/test_granite_hybrid.py (every µP multiplier not 1): error against FP, every SSM mode,
the router left float, down_proj per token, decode against prefill, save and reload, what is
refused.

Measured (2 × 37 tokens, calibration 8 × 64 random tokens): relative error of the logits
(‖q - fp‖ / ‖fp‖) and top-1 agreement with FP: W8A8 0.086 / 0.838, W4A8 0.450 / 0.486, W4A16
0.445 / 0.459; the dense model (no experts, no RoPE, tied) W8A8 0.062.
"""
import copy

import pytest
import torch
import torch.nn as nn

import quamba
from quamba.calibrate import calibrate
from quamba.layers.qlinear import W4A8Linear, W4A16Linear
from quamba.layers.qtransformer import QAttention, QInputLinear
from quamba.models.bamba import ScaledEmbedding
from quamba.models.quantized_hybrid import QuantizedBambaLM
from quamba.models.transformer_layers import GraniteMoE
from quamba.ops.quant4 import pack_int4
from quamba.quantization.gptq import gptq_quantize, gptq_sequential_
from tests.models import hybrid_checks as fp_checks
from tests.models.test_bamba import ids
from tests.models.test_granite_hybrid import DENSE, random_reference
from tests.quantization.hybrid_checks import (assert_close_to_fp,
                                              assert_decode_continues_the_prefill,
                                              assert_reload_is_bit_identical,
                                              error_with_float_blocks, logits, quantize_on,
                                              quantize_recipes, rel)

# recipe → (w_bits, a_bits, bound on the relative error, bound on top-1 agreement)
RECIPES = {"w8a8": (8, 8, 0.1, 0.8), "w4a8": (4, 8, 0.5, 0.4), "w4a16": (4, 16, 0.5, 0.4)}


def load(directory, **changes):
    return fp_checks.load(fp_checks.saved(random_reference(**changes), directory))


def quantized_model(fp_model, w_bits=8, a_bits=8, **changes):
    return quantize_on(fp_model, ids(8, 64, seed=5), w_bits, a_bits, **changes)


@pytest.fixture(scope="module")
def fp_model(tmp_path_factory):
    return load(tmp_path_factory.mktemp("granite"))


@pytest.fixture(scope="module")
def quantized(fp_model):
    return quantize_recipes(fp_model, ids(8, 64, seed=5), RECIPES)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_close_to_the_fp_model(quantized, fp_model, recipe):
    _, a_bits, bound, top1 = RECIPES[recipe]
    assert_close_to_fp(quantized[recipe], fp_model, ids(2, 37, seed=1), a_bits, bound, top1)


def test_experts_and_shared_mlp_are_quantized_the_router_is_not(quantized, fp_model):
    ranges = calibrate(fp_model, ids(2, 16, seed=0), progress=False)
    assert "experts.0.up_proj.input" in ranges[1] and "router.input" not in ranges[1]
    qmodel = quantized["w8a8"]
    assert isinstance(qmodel, QuantizedBambaLM)
    assert isinstance(qmodel.backbone.embedding, ScaledEmbedding)
    assert isinstance(qmodel.backbone.layers[2].mixer, QAttention)
    moe = qmodel.backbone.layers[1].mixer
    assert isinstance(moe, GraniteMoE) and type(moe.router) is nn.Linear
    for mlp in (moe.experts[0], moe.experts[4], moe.shared_mlp):
        assert all(isinstance(getattr(mlp, name), QInputLinear)
                   for name in ("gate_proj", "up_proj", "down_proj"))
        assert mlp.down_proj.dynamic and not mlp.up_proj.dynamic


def test_dynamic_down_proj_input_holds_where_static_does_not(fp_model, monkeypatch):
    """The MoE layers alone quantized (W8A8): down_proj's input (SwiGLU) per tensor static costs
    1.2× the error of per token dynamic (measured 0.046 against 0.037)."""
    errors = {}
    for dynamic in (("down_proj",), ()):
        monkeypatch.setattr("quamba.layers.qtransformer.DYNAMIC_INPUTS", dynamic)
        errors[dynamic] = error_with_float_blocks(
            fp_model, ids(8, 64, seed=5), ids(2, 37, seed=1),
            lambda _, block: not isinstance(block.mixer, GraniteMoE))
    assert errors[("down_proj",)] < 0.04 < errors[()]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_decode_continues_the_prefill(quantized, recipe):
    assert_decode_continues_the_prefill(quantized[recipe], ids(3, 29, seed=2), {"fp32": 1e-4})


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_reload_is_bit_identical(quantized, recipe, tmp_path):
    qmodel = quantized[recipe]
    reloaded = assert_reload_is_bit_identical(qmodel, tmp_path / recipe, ids(2, 37, seed=1),
                                              QuantizedBambaLM, 8, RECIPES[recipe][1])
    assert reloaded.config == qmodel.config


def test_dense_tied_model_saves_and_reloads(tmp_path):
    """Granite without experts (the shared MLP a GatedMLP), without RoPE, lm_head tied."""
    fp = load(tmp_path / "fp", **DENSE)
    qmodel, tokens = quantized_model(fp), ids(2, 37, seed=1)
    assert qmodel.lm_head.weight is qmodel.backbone.embedding.weight
    assert rel(logits(qmodel, tokens), logits(fp, tokens)) < 0.08
    qmodel.save_pretrained(tmp_path / "q")
    reloaded, _ = quamba.load_model(tmp_path / "q", tokenizer=False)
    assert torch.equal(logits(reloaded, tokens), logits(qmodel, tokens))


def test_an_int8_embedding_with_a_multiplier_is_refused_in_one_line(fp_model):
    with pytest.raises(quamba.QuambaError, match="^quantize_embedding is not supported for "
                       "granitemoehybrid with an embedding_multiplier$"):
        quantized_model(fp_model, quantize_embedding=True)


def test_mixed_precision_ranks_blocks_of_every_kind_and_reloads_bit_identically(fp_model,
                                                                                tmp_path):
    """W4A8 with the most sensitive 30% of the ten blocks (Mamba2, attention, MoE) in W4A16,
    chosen by each block's measured NLL increase; saved and reloaded with its layer_bits."""
    qmodel = quantized_model(fp_model, 4, 8, mixed_precision=0.3)
    sensitivity = qmodel.calibration["layer_sensitivity"]
    layer_bits = qmodel.quant_config.layer_bits
    most_sensitive = sorted(range(10), key=lambda i: -sensitivity[i])[:3]
    assert [i for i, bits in enumerate(layer_bits) if bits == (4, 16)] == sorted(most_sensitive)
    for block, bits in zip(qmodel.backbone.layers, layer_bits):
        linears = [module for module in block.mixer.modules()
                   if isinstance(module, (W4A8Linear, W4A16Linear))]
        assert linears and all(isinstance(linear, W4A16Linear) == (bits == (4, 16))
                               for linear in linears)
    reloaded = assert_reload_is_bit_identical(qmodel, tmp_path, ids(2, 37, seed=1),
                                              QuantizedBambaLM, 8, 8)
    assert reloaded.quant_config.layer_bits == layer_bits


def _input_hessian(model, module, tokens):
    """((2 / n) Σ xᵀx of ``module``'s float input over one forward of ``model``, n); None for
    no input."""
    inputs = []
    handle = module.register_forward_pre_hook(
        lambda _, args: inputs.append(args[0].reshape(-1, args[0].shape[-1]).float()))
    with torch.no_grad():
        model(tokens)
    handle.remove()
    if not inputs:
        return None, 0
    rows = torch.cat(inputs)
    return (rows.T @ rows) * (2.0 / len(rows)), len(rows)


@pytest.mark.parametrize("a_bits", [8, 16])
def test_gptq_quantizes_each_expert_on_the_tokens_routed_to_it(fp_model, a_bits):
    """Every expert's linears get GPTQ codes from the Hessian of their inputs in the quantized
    model, over the tokens routed to them (two tokens, two experts each of five); an expert no
    token reached keeps its round-to-nearest codes (an identity Hessian), the router its float
    weight."""
    qmodel = quantized_model(fp_model, 4, a_bits)
    rtn = copy.deepcopy(qmodel)
    tokens = ids(1, 2, seed=3)
    gptq_sequential_(qmodel, fp_model, tokens, progress=False)
    moe, fp_moe, rtn_moe = (model.backbone.layers[1].mixer for model in (qmodel, fp_model, rtn))
    assert torch.equal(moe.router.weight, fp_moe.router.weight)
    unreached = 0
    for expert, fp_expert, rtn_expert in zip(moe.experts, fp_moe.experts, rtn_moe.experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(expert, name)
            inner, rtn_inner = (getattr(m, "linear", m) for m in (layer, getattr(rtn_expert, name)))
            hessian, count = _input_hessian(qmodel, layer, tokens)
            if count == 0:
                unreached += 1
                assert torch.equal(inner.weight, rtn_inner.weight), name
                continue
            codes = gptq_quantize(getattr(fp_expert, name).weight.float(), hessian,
                                  inner.group_scales(), inner.group_size)
            assert torch.equal(inner.weight, pack_int4(codes)), name
            assert not torch.equal(inner.weight, rtn_inner.weight), name
    assert 0 < unreached <= 3 * 3
