import math

import numpy as np
import pytest
import torch
from torch import nn

from quamba.calibrate import (DEFAULT_OBSERVERS, TENSOR_KINDS, CalibrationError, CalibrationSet,
                              ObserverSpec, calibrate, content_hash)
from quamba.errors import QuambaError
from quamba.models.loading import cast_model

ALL_ABSMAX = {kind: ObserverSpec("absmax") for kind in TENSOR_KINDS}


def hook_count(model) -> int:
    return sum(len(module._forward_hooks) + len(module._forward_pre_hooks)
               for module in model.modules())


def captured_tensors(model, tokens) -> dict[tuple[int, str], torch.Tensor]:
    """Every tensor kind of every layer from one plain prefill, captured independently of
    calibrate (dt from the mixer's own _ssm_params)."""
    captured, handles = {}, []
    for layer, mixer in enumerate(model.mixers()):
        def in_proj(module, inputs, output, layer=layer):
            captured[layer, "in_proj.input"], captured[layer, "in_proj.output"] = inputs[0], output

        def x_proj(module, inputs, output, layer=layer, mixer=mixer):
            captured[layer, "x_proj.input"], captured[layer, "x_proj.output"] = inputs[0], output
            captured[layer, "dt_proj.output"] = mixer._ssm_params(output)[0]

        def out_proj(module, inputs, output, layer=layer):
            captured[layer, "out_proj.input"] = inputs[0]

        handles += [mixer.in_proj.register_forward_hook(in_proj),
                    mixer.x_proj.register_forward_hook(x_proj),
                    mixer.out_proj.register_forward_hook(out_proj)]
    cache = model.allocate_cache(tokens.shape[0])
    with torch.no_grad():
        model(tokens, cache=cache)
    for handle in handles:
        handle.remove()
    for layer, state in enumerate(cache.states):
        captured[layer, "ssm_state"] = state.ssm
    return captured


def test_ranges_cover_every_layer_and_kind(model, tokens):
    ranges = calibrate(model, tokens, batch_size=4, progress=True)
    assert list(ranges) == [0, 1]
    for kinds in ranges.values():
        assert list(kinds) == list(TENSOR_KINDS)
        assert all(math.isfinite(value) and value > 0 for value in kinds.values())


def test_ranges_are_those_of_the_named_tensors(model, tokens):
    absmax = calibrate(model, tokens, observers=ALL_ABSMAX, batch_size=8, progress=False)
    default = calibrate(model, tokens, batch_size=8, progress=False)
    for (layer, kind), tensor in captured_tensors(model, tokens).items():
        magnitudes = tensor.float().abs().flatten()
        assert absmax[layer][kind] == magnitudes.max().item(), (layer, kind)
        spec = DEFAULT_OBSERVERS[kind]
        expected = (np.quantile(magnitudes.numpy(), spec.alpha, method="inverted_cdf")
                    if spec.kind == "percentile" else magnitudes.max().item())
        assert default[layer][kind] == float(expected), (layer, kind)
    assert default[0]["x_proj.input"] < absmax[0]["x_proj.input"]


def test_deterministic_across_runs_and_batch_sizes(model, tokens):
    first = calibrate(model, tokens, batch_size=2, progress=False)
    assert calibrate(model, tokens, batch_size=2, progress=False) == first
    assert calibrate(model, tokens, batch_size=4, progress=False) == first
    assert calibrate(model, tokens, batch_size=3, progress=False) == first  # uneven last batch


def test_accepts_a_calibration_set(model, tokens):
    calib = CalibrationSet(tokens, "random", tokens.shape[0], tokens.shape[1], 0,
                           content_hash(tokens))
    assert calibrate(model, calib, progress=False) == calibrate(model, tokens, progress=False)


def test_hooks_are_removed(model, tokens):
    assert hook_count(model) == 0
    calibrate(model, tokens[:2], progress=False)
    assert hook_count(model) == 0


def test_nan_weight_raises_naming_the_layer_and_removes_hooks(model, tokens):
    with torch.no_grad():
        model.backbone.layers[1].mixer.x_proj.weight[0, 0] = float("nan")
    with pytest.raises(CalibrationError, match="^NaN in layer 1 x_proj.output"):
        calibrate(model, tokens[:2], progress=False)
    assert hook_count(model) == 0


def test_out_proj_input_is_taken_after_the_online_hadamard(model, tokens):
    class Double(nn.Module):
        def forward(self, y):
            return 2 * y

    plain = calibrate(model, tokens[:4], progress=False)
    model.backbone.layers[1].mixer.online_hadamard = Double()
    doubled = calibrate(model, tokens[:4], progress=False)
    assert doubled[1]["out_proj.input"] == 2 * plain[1]["out_proj.input"]
    assert doubled[1]["in_proj.input"] == plain[1]["in_proj.input"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model(model, tokens, dtype):
    ranges = calibrate(cast_model(model, dtype), tokens[:2], progress=False)
    assert all(math.isfinite(value) and value > 0
               for kinds in ranges.values() for value in kinds.values())


def test_bad_arguments(model, tokens):
    with pytest.raises(CalibrationError, match=r"unknown tensor kind\(s\) \['x_proj.inputs'\]"):
        calibrate(model, tokens, observers={"x_proj.inputs": ObserverSpec()}, progress=False)
    for bad in (tokens.float(), tokens[0], tokens[:0]):
        with pytest.raises(CalibrationError, match="calibration tokens"):
            calibrate(model, bad, progress=False)
    with pytest.raises(CalibrationError, match="batch_size must be a positive integer"):
        calibrate(model, tokens, batch_size=0, progress=False)
    past_vocabulary = tokens.clone()
    past_vocabulary[1, 2] = model.config.vocab_size
    with pytest.raises(QuambaError, match=f"calibration tokens: token id {model.config.vocab_size} "
                                          "is outside the model's vocabulary"):
        calibrate(model, past_vocabulary, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_matches_cpu(model, tokens):
    on_cpu = calibrate(model, tokens, progress=False)
    on_cuda = calibrate(model.cuda(), tokens, progress=False)
    for layer, kinds in on_cpu.items():
        for kind, value in kinds.items():
            assert on_cuda[layer][kind] == pytest.approx(value, rel=1e-3), (layer, kind)
