"""Calibrating Zamba2 (tests/models/test_zamba2.py's random model): a shared block's linear
inputs observed under each layer that runs it, the layers' own linears and their Mamba2 state."""
import pytest
import torch

import quamba
from quamba.calibrate import calibrate
from tests.models.test_zamba2 import ids, random_reference


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zamba2")
    random_reference().save_pretrained(directory)
    return quamba.load_model(directory, tokenizer=False)[0]


def absmax_per_call(module, model, tokens) -> list[float]:
    """The absmax of ``module``'s input at each of its calls in one forward."""
    seen = []
    handle = module.register_forward_pre_hook(lambda _, inputs: seen.append(
        inputs[0].abs().max().item()))
    with torch.no_grad():
        model(tokens)
    handle.remove()
    return seen


def test_each_use_of_a_shared_block_is_observed_under_its_layer(model):
    tokens = ids(4, 16, seed=5)
    ranges = calibrate(model, tokens, batch_size=4, progress=False)
    block = model.backbone.shared_blocks[0]  # run by layers 1 and 4
    for kind, linear in (("shared.in_proj.input", block.attention.q_proj),
                         ("shared.attention.o_proj.input", block.attention.o_proj),
                         ("shared.gate_up_proj.input", block.gate_up_proj),
                         ("shared.down_proj.input", block.down_proj)):
        first, second = absmax_per_call(linear, model, tokens)
        assert (ranges[1][kind], ranges[4][kind]) == (first, second)
    layer = model.backbone.layers[3]
    assert ranges[3]["linear.input"] == absmax_per_call(layer.linear, model, tokens)[0]
    assert ranges[3]["shared.in_proj.input"] == absmax_per_call(
        model.backbone.shared_blocks[1].attention.q_proj, model, tokens)[0]
    for i in (0, 2, 5):  # Mamba layers: no shared block, no linear
        assert not any(kind.startswith(("shared.", "linear.")) for kind in ranges[i])
    assert all("ssm_state" in ranges[i] for i in range(6))  # hybrid layers' HybridState too
    assert not any(module._forward_pre_hooks for module in model.modules())
