"""qmamba_layer_step (quamba.ops.fused_decode.layer_step) on the trained test model: its torch
reference with the weights a block hands it (QMambaMixer.layer_weights) is the block's own decode
step, norm and mixer op by op, bit for bit, W8A8 and W4A8, at every layer and for several steps; the
op refuses inputs outside its scope with a one-line error; and the blocks run op by op where the
layer kernel cannot apply (here: no GPU). tests/ops/test_cuda_fused_layer.py checks the kernel on a
GPU."""
import copy

import pytest
import torch

import quamba
from quamba.calibrate import load_calibration_set
from quamba.models.quantized import QMambaBlock
from quamba.ops import backend
from quamba.ops.fused_decode.layer_step import OP, qmamba_layer_step

CALIB_SAMPLES, CALIB_SEQLEN, STEPS = 8, 128, 4


def quantized(tiny_model_dir, shared_data_dir, **config):
    model, tokenizer = quamba.load_model(tiny_model_dir)
    calib = load_calibration_set(str(shared_data_dir / "text" / "c4_sample.jsonl"), tokenizer,
                                 CALIB_SAMPLES, CALIB_SEQLEN, seed=0)
    qmodel = quamba.quantize(model, tokenizer, quamba.QuantConfig(**config), calib_data=calib,
                             progress=False)
    return qmodel, tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir, shared_data_dir):
    return quantized(tiny_model_dir, shared_data_dir)


@pytest.fixture(scope="module")
def w4a8_and_tokenizer(tiny_model_dir, shared_data_dir):
    return quantized(tiny_model_dir, shared_data_dir, w_bits=4, a_bits=8, group_size=64)


def blocks(model):
    return [b for b in model.modules() if isinstance(b, QMambaBlock)]


def prefilled_cache(model, tokenizer, batch):
    ids = tokenizer(["The history of the city"] * batch, return_tensors="pt")["input_ids"]
    cache = model.allocate_cache(batch)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


@pytest.mark.parametrize("precision", ["w8a8", "w4a8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_reference_is_the_block_step_bit_for_bit(request, precision, batch):
    fixture = "model_and_tokenizer" if precision == "w8a8" else "w4a8_and_tokenizer"
    model, tokenizer = request.getfixturevalue(fixture)
    cache = prefilled_cache(model, tokenizer, batch)
    gen = torch.Generator().manual_seed(batch)
    hidden = torch.randn(batch, 1, model.config.d_model, generator=gen).half()
    residual = None
    for block, state in zip(blocks(model), cache.states):
        weights = block.mixer.layer_weights(block.norm)
        assert weights is not None
        fused_state = copy.deepcopy(state)
        for _ in range(STEPS):
            with torch.no_grad(), backend.recording() as used:
                out, res = qmamba_layer_step(hidden, residual, weights, fused_state.conv,
                                             fused_state.ssm, backend_name="torch")
                ref_out, ref_res = block(hidden, residual, state=state, step=True)
            assert used[OP] == {"torch"}
            assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
            assert torch.equal(fused_state.conv, state.conv)
            assert torch.equal(fused_state.ssm, state.ssm)
        hidden, residual = out, res  # the next block's input, as the model chains them


def test_blocks_run_op_by_op_without_the_kernel(model_and_tokenizer, w4a8_and_tokenizer):
    """On the CPU (and wherever the layer kernel cannot apply) a block's decode step is its norm
    and mixer: the op is never selected. The layer kernel is on by default for W8A8 and W4A8
    blocks, and set_fused_layer switches every mixer."""
    model, tokenizer = model_and_tokenizer
    w4a8, _ = w4a8_and_tokenizer
    assert all(b.mixer.fused_layer for b in blocks(model))
    assert all(b.mixer.fused_layer for b in blocks(w4a8))
    cache = prefilled_cache(model, tokenizer, 1)
    with torch.no_grad(), backend.recording() as used:
        model(torch.tensor([[5]]), cache=cache)
    assert OP not in used and "rmsnorm_quant" in used
    model.set_fused_layer(False)
    assert not any(b.mixer.fused_layer for b in blocks(model))
    model.set_fused_layer(True)
    assert all(b.mixer.fused_layer for b in blocks(model))


def test_weights_outside_the_op_are_none(tiny_model_dir, shared_data_dir):
    """Blocks without the Hadamard rotation keep their norm weight, which the op does not take:
    layer_weights says None."""
    model, _ = quantized(tiny_model_dir, shared_data_dir, hadamard=False)
    assert all(b.mixer.layer_weights(b.norm) is None for b in blocks(model))


def test_bad_inputs_get_one_line_errors(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cache = prefilled_cache(model, tokenizer, 1)
    block, state = blocks(model)[0], cache.states[0]
    weights = block.mixer.layer_weights(block.norm)
    d_model = model.config.d_model
    hidden = torch.zeros(1, 1, d_model, dtype=torch.float16)
    cases = [
        (dict(hidden=torch.zeros(1, 2, d_model, dtype=torch.float16)), "hidden must be float"),
        (dict(residual=torch.zeros(1, 1, d_model, dtype=torch.float16)), "residual must be fp32"),
        (dict(ssm_state=state.ssm.float()), "ssm_state must be int8"),
        (dict(conv_state=state.conv.expand(2, -1, -1)), "batch"),
    ]
    for change, message in cases:
        args = dict(hidden=hidden, residual=None, layer=weights, conv_state=state.conv,
                    ssm_state=state.ssm, backend_name="torch")
        args.update(change)
        with pytest.raises(ValueError, match=message) as error:
            qmamba_layer_step(**args)
        assert "\n" not in str(error.value)
