"""The checks every quantized hybrid family's tests run (tests/quantization/test_quantize_*.py
of Nemotron-H, Bamba, Granite-4.0-H): error against FP in every SSM mode, decode against
prefill, bit-identical reload; and a prefill with one decode step (Falcon-Mamba's tests too)."""
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
