"""The trained hybrid test model (tests/fixtures/tiny-hybrid: Nemotron-H, Mamba2 + attention +
MLP) quantized: the issue's targets on held-out text, as for the Mamba2 test model
(tests/quantization/test_quantize_mamba2.py), with Nemotron-H's default recipes (Hadamard
rotation of the residual stream), and unrotated: GPTQ of every 4-bit linear (Mamba2, attention,
MLP) and mixed precision over blocks of every kind.

Measured (2 held-out windows of 1024 tokens; in brackets 8 windows, FP 233.36), rotated: FP
220.36, W8A8 220.93 (+0.26%; +0.12%), W4A8 221.79 (+0.65%; +0.63%); without rotation: W8A8
220.45 (+0.04%; −0.02%), W4A8 225.57 (+2.36%; +2.09%), W4A16 224.61 (+1.93%). Calibration seeds
1 and 2 give the same picture (W4A8 rotated +0.54 to +0.65%, unrotated +2.35 to +2.61%): rotation
cuts W4A8's loss 3–4× and costs W8A8 at most 0.22 points, so it is the hybrids' default.
Unrotated, GPTQ on 8 × 256 tokens of c4_sample: W4A8 221.88 (+0.69%), W4A16 222.55 (+0.99%),
mixed W4A8 / W4A16 (the 2 most sensitive of 6 blocks, both Mamba2) 221.10 (+0.34%); GPTQ's
held-out output error of each attention and MLP linear is 0.37-0.81× round-to-nearest's."""
import pytest
import torch

import quamba
from quamba.layers.qtransformer import TRANSFORMER_LAYERS, quantized_linears
from quamba.models.quantized_hybrid import QuantizedNemotronHLM
from tests.models.test_fixture_hybrid import TINY_HYBRID_DIR
from tests.quantization.hybrid_checks import assert_reload_is_bit_identical
from tests.quantization.test_quantize_mamba2 import perplexity


@pytest.fixture(scope="module")
def tiny_hybrid():
    return quamba.load_model(TINY_HYBRID_DIR)


@pytest.fixture(scope="module")
def tiny_recipes(tiny_hybrid, shared_data_dir):
    """FP; W8A8 and W4A8 as by default (rotated); unrotated, W4A8 and W4A16 (round-to-nearest
    and GPTQ) and the mixed W4A8 / W4A16 model (GPTQ), each calibrated on the same 16 × 256
    tokens of c4_sample, GPTQ on its first 8 × 256 (4-bit groups of 64: d_model 128)."""
    model, tokenizer = tiny_hybrid
    text = str(shared_data_dir / "text" / "c4_sample.jsonl")
    common = dict(calib_source=text, calib_num_samples=16, calib_seqlen=256)
    w4 = dict(common, w_bits=4, group_size=64, hadamard=False)
    gptq = dict(w4, apply_gptq=True, gptq_source=text, gptq_num_samples=8, gptq_seqlen=256)
    configs = {"W8A8": quamba.QuantConfig(**common),
               "W4A8": quamba.QuantConfig(**common, w_bits=4, group_size=64),
               "W4A8 unrotated": quamba.QuantConfig(**w4),
               "W4A8 GPTQ": quamba.QuantConfig(**gptq),
               "W4A16": quamba.QuantConfig(**w4, a_bits=16),
               "W4A16 GPTQ": quamba.QuantConfig(**gptq, a_bits=16),
               "W4AX GPTQ": quamba.QuantConfig(**gptq, mixed_precision=0.34)}
    models = {"FP": model}
    models.update({name: quamba.quantize(model, tokenizer, config, progress=False)
                   for name, config in configs.items()})
    return models


# GPTQ's round-to-nearest counterparts: unrotated, as the GPTQ recipes here
ROUND_TO_NEAREST = {"W4A8": "W4A8 unrotated", "W4A16": "W4A16"}


@pytest.fixture(scope="module")
def perplexities(tiny_hybrid, tiny_recipes, heldout_windows):
    windows = heldout_windows(tiny_hybrid[1], 2)
    return {name: perplexity(model, windows) for name, model in tiny_recipes.items()}


def test_quantized_hybrid_holds_the_test_models_perplexity(tiny_recipes, perplexities):
    """On held-out text W8A8 within 1% of FP, W4A8 within 1.5% (the issue's target: 3%), which
    only the rotation holds (unrotated: +2.36%)."""
    assert all(tiny_recipes[name].quant_config.hadamard for name in ("W8A8", "W4A8"))
    ppl = perplexities
    assert ppl["W8A8"] <= 1.01 * ppl["FP"], ppl
    assert ppl["W4A8"] <= 1.015 * ppl["FP"], ppl


def test_gptq_lowers_the_held_out_perplexity(perplexities):
    """GPTQ below round-to-nearest in W4A8 and W4A16 (measured 1.6% and 0.9% lower), within
    1.5% of FP (+0.69%, +0.99%); the mixed model within 1% (+0.34%)."""
    ppl = perplexities
    for recipe in ("W4A8", "W4A16"):
        assert ppl[f"{recipe} GPTQ"] < ppl[ROUND_TO_NEAREST[recipe]], ppl
        assert ppl[f"{recipe} GPTQ"] <= 1.015 * ppl["FP"], ppl
    assert ppl["W4AX GPTQ"] <= 1.01 * ppl["FP"], ppl


def _held_out_hessians(model, windows) -> dict:
    """(2 / n) Σ xᵀx of the input of every attention and MLP linear of the FP ``model`` on
    ``windows``, keyed (block, name)."""
    linears = {(i, name): linear for i, block in enumerate(model.backbone.layers)
               if isinstance(block.mixer, TRANSFORMER_LAYERS)
               for name, linear in quantized_linears(block.mixer)}
    hessians = {}

    def hook(key):
        def accumulate(_, inputs):
            rows = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            hessians[key] = rows.T @ rows * (2.0 / len(rows))
        return accumulate
    handles = [linear.register_forward_pre_hook(hook(key)) for key, linear in linears.items()]
    with torch.no_grad():
        model(windows)
    for handle in handles:
        handle.remove()
    return hessians


@pytest.mark.parametrize("recipe", ["W4A8", "W4A16"])
def test_gptq_lowers_each_attention_and_mlp_linears_error_on_held_out_text(
        tiny_hybrid, tiny_recipes, heldout_windows, recipe):
    """‖(Ŵ − W) X‖² on held-out inputs X of the FP model, for every attention and MLP linear:
    GPTQ's codes under 0.9× round-to-nearest's (measured 0.37-0.81×)."""
    model, tokenizer = tiny_hybrid
    hessians = _held_out_hessians(model, heldout_windows(tokenizer, 2))
    assert len(hessians) == 8  # q, k, v, o of the attention; up, down of both MLPs

    def output_error(qmodel, layer, name):
        linear = qmodel.backbone.layers[layer].mixer.get_submodule(name)
        fp_weight = model.backbone.layers[layer].mixer.get_submodule(name).weight.double()
        delta = getattr(linear, "linear", linear).dequantized_weight().double() - fp_weight
        return torch.trace(delta @ hessians[layer, name] @ delta.T).item()

    for layer, name in hessians:
        gptq = output_error(tiny_recipes[f"{recipe} GPTQ"], layer, name)
        rtn = output_error(tiny_recipes[ROUND_TO_NEAREST[recipe]], layer, name)
        assert gptq < 0.9 * rtn, (layer, name)


def test_mixed_precision_ranks_every_block_and_reloads_bit_identically(tiny_recipes, tmp_path):
    """The 2 of 6 blocks (Mamba2, attention, MLP) whose W4A8 form raises the NLL most run
    W4A16; saved and reloaded with its layer_bits, bit-identical."""
    qmodel = tiny_recipes["W4AX GPTQ"]
    sensitivity = qmodel.calibration["layer_sensitivity"]
    assert len(sensitivity) == 6
    most_sensitive = sorted(sorted(range(6), key=lambda i: -sensitivity[i])[:2])
    layer_bits = qmodel.quant_config.layer_bits
    assert [i for i, bits in enumerate(layer_bits) if bits == (4, 16)] == most_sensitive
    tokens = torch.randint(0, 1000, (2, 37), generator=torch.Generator().manual_seed(0))
    reloaded = assert_reload_is_bit_identical(qmodel, tmp_path, tokens, QuantizedNemotronHLM, 7, 8)
    assert reloaded.quant_config.layer_bits == layer_bits
