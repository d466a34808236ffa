"""Quamba2 on Mamba2 models (random weights, odd sizes): every recipe and SSM mode, decode against
prefill, checkpoints, determinism and per-layer mixed precision."""
import pytest
import torch

import quamba
from quamba.errors import QuambaError
from quamba.layers.qmixer2 import QMamba2Mixer
from quamba.models.config import MambaConfig
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.models.mamba2 import Mamba2Mixer

INT8_MODES = ("int8", "fp32-ssm-input", "float-sim-asic-int8", "fp32-conv")
RECIPES = {"w8a8": dict(), "w4a8": dict(w_bits=4, group_size=32), "w4a16": dict(w_bits=4, a_bits=16, group_size=32)}


@pytest.fixture(scope="module")
def fp_model():
    torch.manual_seed(0)
    config = MambaConfig(d_model=96, n_layer=3, vocab_size=101, layer="Mamba2", headdim=12,
                         ngroups=2, d_state=16, chunk_size=16)  # 16 heads of 12, 2 groups
    model = MambaLMHeadModel(config)
    randomize_(model)
    return model.eval()


@pytest.fixture(scope="module")
def calib_tokens():
    return torch.randint(0, 101, (8, 45), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 101, (3, 37), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def quantized(fp_model, calib_tokens):
    return {name: quamba.quantize(fp_model, config=quamba.QuantConfig(**kwargs),
                                  calib_data=calib_tokens, progress=False)
            for name, kwargs in RECIPES.items()}


def logits(model, ids, mode):
    model.set_ssm_mode(mode)
    with torch.no_grad():
        return model(ids).float()


def relative_error(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("recipe,bound", [("w8a8", 0.15), ("w4a8", 0.5), ("w4a16", 0.5)])
def test_close_to_the_fp_model(quantized, fp_model, ids, recipe, bound):
    qmodel = quantized[recipe]
    with torch.no_grad():
        reference = fp_model(ids).float()
    modes = ("fp16",) if recipe == "w4a16" else INT8_MODES
    for mode in modes:
        assert relative_error(logits(qmodel, ids, mode), reference) < bound, mode


@pytest.mark.parametrize("recipe", ["w8a8", "w4a8"])
def test_modes_agree_where_the_method_says(quantized, ids, recipe):
    qmodel = quantized[recipe]
    assert all(isinstance(block.mixer, QMamba2Mixer) for block in qmodel.backbone.layers)
    int8 = logits(qmodel, ids, "int8")
    assert torch.equal(logits(qmodel, ids, "fp32-ssm-input"), int8)  # same codes, same fp32 SSD
    # float simulation: float GEMMs and conv round a few values to the neighbouring code
    assert relative_error(logits(qmodel, ids, "float-sim-asic-int8"), int8) < 0.05
    first = qmodel.backbone.layers[0].mixer
    xbc = {mode: first_layer_tap(qmodel, ids, mode, "xbc") for mode in ("int8", "float-sim-asic-int8")}
    steps = (xbc["int8"] - xbc["float-sim-asic-int8"]).abs() / first.xbc_scale
    assert steps.max() <= 1.0 + 1e-4 and (steps > 0.5).float().mean() < 0.01
    assert not torch.equal(logits(qmodel, ids, "fp32-conv"), int8)  # xBC no longer requantized


def first_layer_tap(qmodel, ids, mode, name):
    mixer = qmodel.backbone.layers[0].mixer
    mixer.taps = {}
    try:
        logits(qmodel, ids, mode)
        return mixer.taps[name]
    finally:
        mixer.taps = None


@pytest.mark.parametrize("mode", INT8_MODES)
def test_decode_continues_the_prefill(quantized, ids, mode):
    qmodel = quantized["w8a8"]
    full = logits(qmodel, ids, mode)
    cache = qmodel.allocate_cache(ids.shape[0])
    with torch.no_grad():
        prefill = qmodel(ids[:, :20], cache=cache).float()
        steps = qmodel(ids[:, 20:], cache=cache).float()
    assert torch.equal(prefill, full[:, :20])
    # the decode state is int8 (requantized each step) where the prefill's was fp32 throughout
    assert relative_error(steps, full[:, 20:]) < 0.05


def test_scales_follow_quamba2(quantized, fp_model):
    mixer = quantized["w8a8"].backbone.layers[0].mixer
    fp_mixer = fp_model.backbone.layers[0].mixer
    x_scale, B_scale, C_scale = torch.split(mixer.xbc_scale, [fp_mixer.d_inner, 32, 32])
    for group in x_scale.view(fp_mixer.ngroups, -1):  # sort-and-cluster: ≤ 4 × 4 per SSD group
        assert 1 < len(torch.unique(group)) <= 16
    for scale in (B_scale, C_scale):  # one per state group
        assert len(torch.unique(scale)) == fp_mixer.ngroups
        assert torch.equal(scale, scale.view(2, 16)[:, :1].expand(2, 16).flatten())
    in_proj_scale = mixer.in_proj.out_scale  # z | x | B | C | dt each their own
    assert len(torch.unique(in_proj_scale)) == 5


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_reload_is_bit_identical(quantized, ids, recipe, tmp_path):
    qmodel = quantized[recipe]
    qmodel.save_pretrained(tmp_path / recipe)
    reloaded, _ = quamba.load_model(tmp_path / recipe, tokenizer=False)
    modes = ("fp16",) if recipe == "w4a16" else INT8_MODES
    for mode in modes:
        if mode == "fp16":
            assert torch.equal(logits(reloaded, ids, "fp16"), logits(qmodel, ids, "fp16"))
        else:
            assert torch.equal(logits(reloaded, ids, mode), logits(qmodel, ids, mode)), mode


def test_quantization_is_deterministic(fp_model, calib_tokens, quantized):
    again = quamba.quantize(fp_model, config=quamba.QuantConfig(), calib_data=calib_tokens,
                            progress=False)
    first = quantized["w8a8"].state_dict()
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, first[name]), name


def test_mixed_precision_puts_the_most_sensitive_layers_in_w4a16(fp_model, calib_tokens, ids, tmp_path):
    config = quamba.QuantConfig(w_bits=4, group_size=32, mixed_precision=0.34)
    qmodel = quamba.quantize(fp_model, config=config, calib_data=calib_tokens, progress=False)
    sensitivity = qmodel.calibration["layer_sensitivity"]
    layer_bits = qmodel.quant_config.layer_bits
    assert sum(bits == (4, 16) for bits in layer_bits) == 1
    assert layer_bits[max(range(3), key=lambda i: sensitivity[i])] == (4, 16)
    kinds = [type(block.mixer) for block in qmodel.backbone.layers]
    assert kinds == [Mamba2Mixer if bits == (4, 16) else QMamba2Mixer for bits in layer_bits]
    qmodel.save_pretrained(tmp_path / "mixed")
    reloaded, _ = quamba.load_model(tmp_path / "mixed", tokenizer=False)
    assert reloaded.quant_config.layer_bits == layer_bits
    for mode in ("int8", "float-sim-asic-int8"):
        assert torch.equal(logits(reloaded, ids, mode), logits(qmodel, ids, mode))


@pytest.mark.parametrize("kwargs,message", [
    (dict(mixed_precision=0.5), "use it with w_bits=4 a_bits=8"),
    (dict(w_bits=4, mixed_precision=1.5), r"in \[0, 1\]"),
    (dict(w_bits=4, layer_bits=[(4, 8), (2, 8)]), "layer_bits holds"),
])
def test_bad_mixed_precision_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(QuambaError, match=message):
        quamba.QuantConfig(**kwargs)


# --- the trained Mamba2 test model (tests/fixtures/tiny-mamba2) -----------------------------------

@pytest.fixture(scope="module")
def tiny_mamba2(tiny_mamba2_dir):
    return quamba.load_model(tiny_mamba2_dir)


@pytest.fixture(scope="module")
def tiny_recipes(tiny_mamba2, shared_data_dir):
    """FP, W8A8, W4A8 (GPTQ) and mixed W4A8/W4A16 (GPTQ) of the test model, each calibrated on
    the same 16 × 256 tokens of c4_sample (4-bit groups of 64: d_model 192)."""
    model, tokenizer = tiny_mamba2
    text = str(shared_data_dir / "text" / "c4_sample.jsonl")
    common = dict(calib_source=text, calib_num_samples=16, calib_seqlen=256)
    gptq = dict(w_bits=4, group_size=64, apply_gptq=True, gptq_source=text, gptq_num_samples=8,
                gptq_seqlen=256)
    configs = {"W8A8": quamba.QuantConfig(**common),
               "W4A8 GPTQ": quamba.QuantConfig(**common, **gptq),
               "W4AX GPTQ": quamba.QuantConfig(**common, **gptq, mixed_precision=0.25)}
    models = {"FP": model}
    models.update({name: quamba.quantize(model, tokenizer, config, progress=False)
                   for name, config in configs.items()})
    return models


def perplexity(model, windows):
    with torch.no_grad():
        logits = model(windows)[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            windows[:, 1:].reshape(-1))
    return float(torch.exp(nll))


def test_quamba2_holds_the_test_models_perplexity(tiny_mamba2, tiny_recipes, heldout_windows):
    """The issue's targets on held-out text: W8A8 within 1% of FP, W4A8 (GPTQ) within 3%, the
    mixed model no worse than W4A8."""
    _, tokenizer = tiny_mamba2
    windows = heldout_windows(tokenizer, 2)
    ppl = {name: perplexity(model, windows) for name, model in tiny_recipes.items()}
    assert ppl["W8A8"] <= 1.01 * ppl["FP"], ppl
    assert ppl["W4A8 GPTQ"] <= 1.03 * ppl["FP"], ppl
    assert ppl["W4AX GPTQ"] <= ppl["W4A8 GPTQ"] * 1.002, ppl
    layer_bits = tiny_recipes["W4AX GPTQ"].quant_config.layer_bits
    assert sorted(layer_bits) == [(4, 8)] * 3 + [(4, 16)]
