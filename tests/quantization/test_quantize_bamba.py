"""Bamba quantized: W8A8, W4A8 and W4A16 on the random model of tests/models/test_bamba.py
(layers mamba, attention, mamba, attention, mamba, each with a GatedMLP): error against FP, every
SSM mode, Δ's floor, decode against prefill, save and reload, what is refused.

Measured (2 × 37 tokens, calibration 8 × 64 random tokens): relative error of the logits
(‖q - fp‖ / ‖fp‖) and top-1 agreement with FP: W8A8 0.082 / 0.865, W4A8 0.495 / 0.365, W4A16
0.491 / 0.378 (4-bit weights in one group of 36, the hidden size, are coarse).
"""
import pytest

from quamba.layers.qmixer2 import QMamba2Mixer
from quamba.layers.qtransformer import QAttention, QGatedMLP, QInputLinear
from quamba.models.quantized_hybrid import QuantizedBambaLM
from quamba.models.transformer_layers import GatedMLP
from tests.models import hybrid_checks as fp_checks
from tests.models.test_bamba import ids, random_reference
from tests.quantization.hybrid_checks import (assert_close_to_fp,
                                              assert_the_activation_runs_in_the_quantizer,
                                              assert_decode_continues_the_prefill,
                                              assert_quantize_refuses,
                                              assert_reload_is_bit_identical,
                                              assert_the_dt_floor_is_used,
                                              error_with_float_blocks, quantize_recipes)

# recipe → (w_bits, a_bits, bound on the relative error, bound on top-1 agreement)
RECIPES = {"w8a8": (8, 8, 0.1, 0.8), "w4a8": (4, 8, 0.55, 0.3), "w4a16": (4, 16, 0.55, 0.3)}


@pytest.fixture(scope="module")
def fp_model(tmp_path_factory):
    return fp_checks.load(fp_checks.saved(random_reference(), tmp_path_factory.mktemp("bamba")))


@pytest.fixture(scope="module")
def quantized(fp_model):
    return quantize_recipes(fp_model, ids(8, 64, seed=5), RECIPES)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_close_to_the_fp_model(quantized, fp_model, recipe):
    _, a_bits, bound, top1 = RECIPES[recipe]
    assert_close_to_fp(quantized[recipe], fp_model, ids(2, 37, seed=1), a_bits, bound, top1)


def test_every_block_kind_is_quantized(quantized):
    qmodel = quantized["w8a8"]
    assert isinstance(qmodel, QuantizedBambaLM) and not qmodel.quant_config.hadamard
    layers = qmodel.backbone.layers
    assert isinstance(layers[0].mixer, QMamba2Mixer) and isinstance(layers[2].mixer, QAttention)
    assert layers[2].mixer.rotary.rotary_dim == 6  # RoPE in float after q_proj and k_proj
    mlp = layers[1].mixer
    for linear in (layers[2].mixer.q_proj, layers[2].mixer.o_proj, mlp.gate_proj, mlp.up_proj,
                   mlp.down_proj):
        assert isinstance(linear, QInputLinear)
    assert not mlp.gate_proj.dynamic and mlp.down_proj.dynamic


def test_dynamic_down_proj_input_holds_where_static_does_not(fp_model, monkeypatch):
    """The GatedMLPs alone quantized (W8A8): down_proj's input (SwiGLU) per tensor static costs
    1.9× the error of per token dynamic (measured 0.045 against 0.024)."""
    calib, tokens = ids(8, 64, seed=5), ids(2, 37, seed=1)
    errors = {}
    for dynamic in (("down_proj",), ()):
        monkeypatch.setattr("quamba.layers.qtransformer.DYNAMIC_INPUTS", dynamic)
        errors[dynamic] = error_with_float_blocks(
            fp_model, calib, tokens, lambda _, block: not isinstance(block.mixer, GatedMLP))
    assert errors[("down_proj",)] < 0.03 < 0.04 < errors[()]


@pytest.mark.parametrize("recipe", ["w8a8", "w4a8"])
def test_the_mlps_quantizer_applies_swiglu_with_the_same_logits(quantized, recipe, monkeypatch):
    """Each GatedMLP is a QGatedMLP whose silu(gate) · up runs inside down_proj's per-token
    quantizer, with the logits of the product quantized."""
    qmodel = quantized[recipe]
    assert isinstance(qmodel.backbone.layers[1].mixer, QGatedMLP)
    assert_the_activation_runs_in_the_quantizer(qmodel, ids(2, 9, seed=3), QGatedMLP, monkeypatch)


def test_the_quantized_mixer_keeps_the_dt_floor(quantized):
    qmodel, tokens = quantized["w8a8"], ids(2, 37, seed=1)
    assert_the_dt_floor_is_used(qmodel, tokens, 0.01, QMamba2Mixer)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_decode_continues_the_prefill(quantized, recipe):
    """With an fp32 decode state the steps equal the prefill (to float rounding), RoPE's
    positions included."""
    assert_decode_continues_the_prefill(quantized[recipe], ids(3, 29, seed=2), {"fp32": 1e-4})


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_reload_is_bit_identical(quantized, recipe, tmp_path):
    qmodel = quantized[recipe]
    reloaded = assert_reload_is_bit_identical(qmodel, tmp_path / recipe, ids(2, 37, seed=1),
                                              QuantizedBambaLM, 8, RECIPES[recipe][1])
    assert reloaded.config == qmodel.config


@pytest.mark.parametrize("changes, message", [
    (dict(learn_scales=True), "learn_scales is not supported for bamba yet"),
])
def test_unsupported_recipes_are_refused_in_one_line(fp_model, changes, message):
    assert_quantize_refuses(fp_model, ids(2, 16, 0), f"^{message}$", **changes)


def test_biased_linears_are_refused_in_one_line(tmp_path):
    model = fp_checks.load(fp_checks.saved(random_reference(attention_bias=True), tmp_path))
    assert_quantize_refuses(model, ids(2, 16, 0), "^bamba with attention_bias is not supported")
