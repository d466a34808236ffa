"""The checks every quantized hybrid family's tests run (tests/quantization/test_quantize_*.py
of Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1, Jamba, Zamba2): error against FP in every SSM
mode, decode against prefill, bit-identical reload, what is refused; and a prefill with one
decode step (Falcon-Mamba's tests too)."""
import copy
import math

import pytest
import torch

import quamba

INT8_MODES = ("int8", "fp32-ssm-input", "fp32-conv", "float-sim-asic-int8")


def logits(model, tokens, mode=None):
    if mode is not None:
        model.set_ssm_mode(mode)
    with torch.no_grad():
        return model(tokens).float()


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def modes(a_bits: int) -> tuple:
    """The SSM modes a recipe runs: every int8 one, or only fp16 for weight-only W4A16."""
    return ("fp16",) if a_bits == 16 else INT8_MODES


def prefill_and_step(qmodel, tokens):
    """Logits of a prefill of all but the last token, then of one decode step."""
    cache = qmodel.allocate_cache(tokens.shape[0])
    with torch.no_grad():
        return qmodel(tokens[:, :-1], cache=cache), qmodel(tokens[:, -1:], cache=cache)


def assert_the_activation_runs_in_the_quantizer(qmodel, tokens, quantized_mlp, monkeypatch):
    """``quantized_mlp`` (QMLP or QGatedMLP) hands its activation to down_proj's per-token
    quantizer: no activation of its own runs, and the logits of a prefill and a step equal those
    of the float MLP's forward (the activation, then the quantizer) bit for bit."""
    from quamba.layers import qtransformer
    calls = []
    real = qtransformer.activated
    monkeypatch.setattr(qtransformer, "activated", lambda *a: calls.append(a) or real(*a))
    fused = prefill_and_step(qmodel, tokens)
    assert calls == []
    monkeypatch.setattr(quantized_mlp, "forward", quantized_mlp.__mro__[1].forward)
    chained = prefill_and_step(qmodel, tokens)
    assert all(torch.equal(f, c) for f, c in zip(fused, chained))


def assert_close_to_fp(qmodel, fp_model, tokens, a_bits: int, bound: float, top1: float):
    """In every mode: relative error of the logits under ``bound``, top-1 agreement over
    ``top1``."""
    reference = logits(fp_model, tokens)
    for mode in modes(a_bits):
        out = logits(qmodel, tokens, mode)
        assert rel(out, reference) < bound, mode
        assert (out.argmax(-1) == reference.argmax(-1)).float().mean() > top1, mode
    qmodel.set_ssm_mode("int8" if a_bits == 8 else "fp16")


def assert_decode_continues_the_prefill(qmodel, tokens, bounds: dict):
    """For each decode-state format of ``bounds`` (state cache → bound): a 17-token prefill
    equals the full forward's first logits, and the steps after it its last ones."""
    for state_cache, bound in bounds.items():
        qmodel.set_state_cache(state_cache)
        full = logits(qmodel, tokens)
        cache = qmodel.allocate_cache(tokens.shape[0])
        with torch.no_grad():
            prefill = qmodel(tokens[:, :17], cache=cache).float()
            steps = qmodel(tokens[:, 17:], cache=cache).float()
        assert rel(prefill, full[:, :17]) < 1e-5  # float attention over fewer keys
        assert rel(steps, full[:, 17:]) < bound, state_cache
    qmodel.set_state_cache("int8")


def assert_reload_is_bit_identical(qmodel, directory, tokens, model_class, format_version: int,
                                   a_bits: int):
    """Saved and reloaded: ``model_class``, the checkpoint's format version, and logits equal
    bit for bit in every mode. Returns the reloaded model."""
    qmodel.save_pretrained(directory)
    reloaded, _ = quamba.load_model(directory, tokenizer=False)
    assert isinstance(reloaded, model_class)
    assert f'"format_version": {format_version}' in (directory / "config.json").read_text()
    for mode in modes(a_bits):
        assert torch.equal(logits(reloaded, tokens, mode), logits(qmodel, tokens, mode)), mode
    qmodel.set_ssm_mode("int8" if a_bits == 8 else "fp16")
    return reloaded


def quantize_on(fp_model, calib_tokens, w_bits=8, a_bits=8, **fields):
    """``fp_model`` quantized with QuantConfig(w_bits, a_bits, **fields), calibrated on
    ``calib_tokens`` (each family's test draws them from its own vocabulary)."""
    config = quamba.QuantConfig(w_bits=w_bits, a_bits=a_bits, **fields)
    return quamba.quantize(fp_model, None, config, calib_data=calib_tokens, progress=False)


def quantize_recipes(fp_model, calib_tokens, recipes: dict) -> dict:
    """Recipe name → ``fp_model`` quantized with that recipe's (w_bits, a_bits, ...)."""
    return {name: quantize_on(fp_model, calib_tokens, w_bits, a_bits)
            for name, (w_bits, a_bits, *_) in recipes.items()}


def error_with_float_blocks(fp_model, calib_tokens, tokens, keep_float) -> float:
    """Relative error of the logits of ``fp_model`` quantized W8A8 but for the blocks
    ``keep_float(index, fp_block)`` names, which stay FP."""
    qmodel = quantize_on(fp_model, calib_tokens)
    for i, block in enumerate(fp_model.backbone.layers):
        if keep_float(i, block):
            qmodel.backbone.layers[i] = copy.deepcopy(block)
    return rel(logits(qmodel, tokens), logits(fp_model, tokens))


def assert_the_dt_floor_is_used(qmodel, tokens, time_step_min: float, mixer_class):
    """The first mixer floors dt's int8 codes at softplus⁻¹(``time_step_min``); without the
    floor (on every ``mixer_class``) the logits change."""
    mixer = qmodel.backbone.layers[0].mixer
    assert mixer.dt_floor == pytest.approx(math.log(math.expm1(time_step_min)))
    floored = logits(qmodel, tokens, "int8")
    unfloored = copy.deepcopy(qmodel)
    for module in unfloored.modules():
        if isinstance(module, mixer_class):
            module.dt_floor = None
    assert not torch.equal(logits(unfloored, tokens), floored)


def assert_quantize_refuses(fp_model, calib_tokens, match: str, **fields):
    """quamba.quantize with QuantConfig(**fields) raises a QuambaError that ``match`` finds."""
    with pytest.raises(quamba.QuambaError, match=match):
        quamba.quantize(fp_model, None, quamba.QuantConfig(**fields), calib_data=calib_tokens)


def assert_moe_export_is_refused(qmodel, directory):
    """W8A8 MoE layers have static expert inputs, which the export formats cannot hold."""
    with pytest.raises(quamba.QuambaError, match="^W8A8 MoE layers cannot be exported: "):
        quamba.export(qmodel, directory)


def reloaded_in(qmodel, directory, dtype: str):
    """``qmodel`` saved in ``directory`` and loaded back in ``dtype``."""
    qmodel.save_pretrained(directory)
    return quamba.from_pretrained(directory, dtype=dtype, tokenizer=False)[0]


def assert_older_quamba_refuses(qmodel, directory, monkeypatch, format_version: int):
    """Saved, then loaded by a quamba that knows formats up to ``format_version`` - 1: refused
    in one line rather than loaded without what that format added."""
    from quamba.errors import CheckpointError
    qmodel.save_pretrained(directory)
    known = format_version - 1
    monkeypatch.setattr("quamba.quantization.checkpoint.NEWEST_FORMAT_VERSION", known)
    with pytest.raises(CheckpointError, match=f"format version {format_version} is newer than "
                       rf"this quamba supports \({known}\); upgrade quamba$"):
        quamba.from_pretrained(directory, tokenizer=False)
