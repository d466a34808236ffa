"""The trained hybrid test model (tests/fixtures/tiny-hybrid: Nemotron-H, Mamba2 + attention +
MLP) quantized: the issue's targets on held-out text, as for the Mamba2 test model
(tests/quantization/test_quantize_mamba2.py), with Nemotron-H's default recipes (Hadamard
rotation of the residual stream, no GPTQ).

Measured (2 held-out windows of 1024 tokens; in brackets 8 windows, FP 233.36), rotated: FP
220.36, W8A8 220.93 (+0.26%; +0.12%), W4A8 221.79 (+0.65%; +0.63%); without rotation: W8A8
220.45 (+0.04%; −0.02%), W4A8 225.57 (+2.36%; +2.09%); W4A16 (unrotated, not asserted) 224.61
(+1.93%). Calibration seeds 1 and 2 give the same picture (W8A8 rotated +0.17 to +0.27%,
unrotated +0.07 to +0.17%; W4A8 rotated +0.54 to +0.65%, unrotated +2.35 to +2.61%): rotation
cuts W4A8's loss 3–4× and costs W8A8 at most 0.22 points, so it is the hybrids' default."""
import pytest

import quamba
from tests.models.test_fixture_hybrid import TINY_HYBRID_DIR
from tests.quantization.test_quantize_mamba2 import perplexity


@pytest.fixture(scope="module")
def tiny_hybrid():
    return quamba.load_model(TINY_HYBRID_DIR)


@pytest.fixture(scope="module")
def tiny_recipes(tiny_hybrid, shared_data_dir):
    """FP, W8A8 and W4A8 (the default: rotated) of the test model, each calibrated on the same
    16 × 256 tokens of c4_sample (4-bit groups of 64: d_model 128)."""
    model, tokenizer = tiny_hybrid
    common = dict(calib_source=str(shared_data_dir / "text" / "c4_sample.jsonl"),
                  calib_num_samples=16, calib_seqlen=256)
    configs = {"W8A8": quamba.QuantConfig(**common),
               "W4A8": quamba.QuantConfig(**common, w_bits=4, group_size=64)}
    models = {"FP": model}
    models.update({name: quamba.quantize(model, tokenizer, config, progress=False)
                   for name, config in configs.items()})
    return models


def test_quantized_hybrid_holds_the_test_models_perplexity(tiny_hybrid, tiny_recipes,
                                                           heldout_windows):
    """On held-out text W8A8 within 1% of FP, W4A8 within 1.5% (the issue's target: 3%), which
    only the rotation holds (unrotated: +2.36%)."""
    _, tokenizer = tiny_hybrid
    assert all(tiny_recipes[name].quant_config.hadamard for name in ("W8A8", "W4A8"))
    windows = heldout_windows(tokenizer, 2)
    ppl = {name: perplexity(model, windows) for name, model in tiny_recipes.items()}
    assert ppl["W8A8"] <= 1.01 * ppl["FP"], ppl
    assert ppl["W4A8"] <= 1.015 * ppl["FP"], ppl
