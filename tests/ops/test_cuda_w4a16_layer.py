"""w4a16_layer_step's layer kernel (csrc/fused_decode/w4a16_layer_cuda.cu) on a GPU, on a
random-weight W4A16 model with Mamba-2.8B's blocks (2 of them): each block's step from random
states, with and without a residual, against the step in fp64 (tests/ops/w4a16_step_cases.py) as
close as the chain of CUDA ops it replaces, its residual and the shifted columns of its conv state
the chain's bit for bit; greedy decoding with
the layer kernel against op by op, eager and from a CUDA graph, over 128 tokens; and the op's
fallback to the chain where the kernel cannot run."""
import copy
import logging

import pytest
import torch

import quamba
from quamba.models.config import preset_config
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops import backend
from quamba.ops.fused_decode import w4a16_step
from quamba.ops.fused_decode.w4a16_step import LAYER_OP, chain_layer_step, w4a16_layer_step
from tests.ops.w4a16_step_cases import fp64_layer_step, relative_error, teacher_forced_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not torch.cuda.is_available() or backend.cuda_extension_error() is not None,
                       reason=f"needs quamba._C ({backend.cuda_extension_error()})"),
]

DEVICE = torch.device("cuda")
N_LAYER, VOCAB, PROMPT_LEN, NEW_TOKENS, STEPS = 2, 4096, 16, 128, 4
# the kernel's error against fp64 may exceed the chain's by this factor, plus this much relative
# to the largest value (both round h, x, z, u, x_proj's output, dt, y and out to float16, so a
# value near a rounding boundary may round either way)
ERROR_FACTOR, SLACK = 2.0, 2e-3


@pytest.fixture(scope="module")
def model():
    config = preset_config("2.8b")
    config.n_layer, config.vocab_size = N_LAYER, VOCAB
    fp_model = MambaLMHeadModel(config, device=DEVICE, dtype=torch.float16).eval()
    return quamba.quantize(randomize_(fp_model, seed=0),
                           config=quamba.QuantConfig(w_bits=4, a_bits=16), progress=False)


def skip_unless_the_kernel_runs(model) -> None:
    block, state = model.backbone.layers[0], model.allocate_cache(1, device=DEVICE).states[0]
    hidden = torch.zeros(1, 1, model.config.d_model, dtype=torch.float16, device=DEVICE)
    if block.mixer.layer_step_weights(block.norm, hidden, None, state) is None:
        from quamba.ops.fused_decode import w4a16_layer_cuda
        weights = block.mixer.layer_weights(block.norm)
        lacks = w4a16_layer_cuda.lacks(hidden, None, weights, state.conv, state.ssm)
        pytest.skip(f"the layer kernel cannot run here: {lacks or 'the block does not qualify'}")


@torch.no_grad()
def test_each_block_step_is_as_close_to_fp64_as_the_chain_of_cuda_ops(model):
    skip_unless_the_kernel_runs(model)
    cache = model.allocate_cache(1, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    for state in cache.states:  # states mid-generation
        state.conv.copy_(torch.randn(state.conv.shape, generator=gen, device=DEVICE))
        state.ssm.copy_(torch.randn(state.ssm.shape, generator=gen, device=DEVICE))
    d_model = model.config.d_model
    for step in range(STEPS):
        hidden = torch.randn(1, 1, d_model, generator=gen, device=DEVICE).half()
        residual = (None if step % 2 == 0
                    else 4 * torch.randn(1, 1, d_model, generator=gen, device=DEVICE))
        for block, state in zip(model.backbone.layers, cache.states):
            weights = block.mixer.layer_weights(block.norm)
            ref_out, _, ref_conv, ref_ssm = fp64_layer_step(hidden, residual, weights, state.conv,
                                                            state.ssm)
            chain = copy.deepcopy(state)
            with backend.recording() as used:
                out, res = w4a16_layer_step(hidden, residual, weights, state.conv, state.ssm,
                                            backend_name="cuda")
            assert used == {LAYER_OP: {"cuda"}}  # the kernel, not the chain
            chain_out, chain_res = chain_layer_step(hidden, residual, weights, chain.conv,
                                                    chain.ssm, backend_name="cuda")
            assert out.dtype == torch.float16 and out.shape == hidden.shape
            residual_sum = hidden.float() if residual is None else hidden.float() + residual
            assert torch.equal(res, residual_sum)
            assert torch.equal(res, chain_res), f"step {step}: residual"
            # the conv state's older columns shift as they are; its newest is in_proj's x
            assert torch.equal(state.conv[..., :-1], chain.conv[..., :-1]), f"step {step}: conv"
            for name, got, expected, ref in [("out", out, chain_out, ref_out),
                                             ("x", state.conv[..., -1], chain.conv[..., -1],
                                              ref_conv[..., -1]),
                                             ("ssm_state", state.ssm, chain.ssm, ref_ssm)]:
                bound = ERROR_FACTOR * relative_error(expected, ref) + SLACK
                assert relative_error(got, ref) <= bound, f"step {step}: {name}"
            hidden, residual = out, res


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_greedy_decoding_with_the_layer_kernel_takes_op_by_ops_choices(model, graphed,
                                                                       monkeypatch):
    """Over 128 greedy tokens, each token the layer kernel's decode step chose is the op-by-op
    step's argmax on the same tokens, or within a near-tie of it (float sums in another order)."""
    skip_unless_the_kernel_runs(model)
    from quamba.ops.fused_decode import w4a16_layer_cuda
    launches = []
    launch = w4a16_layer_cuda.layer_step
    monkeypatch.setattr(w4a16_layer_cuda, "layer_step",
                        lambda *args: launches.append(1) or launch(*args))
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), device=DEVICE, generator=gen)
    with backend.recording() as used:
        tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=-1,
                                cache_graph=graphed)
    assert launches and LAYER_OP in used and backend.on_reference(used) == []
    try:
        logits = teacher_forced_logits(model.set_fused_layer(False), tokens, PROMPT_LEN)
    finally:
        model.set_fused_layer(True)
    chosen = tokens[:, PROMPT_LEN:]
    margin = logits.max(-1).values - logits.gather(-1, chosen[..., None])[..., 0]
    assert (margin == 0).float().mean() >= 0.95
    assert margin.max() <= 1e-2 * logits.std(), f"largest margin {margin.max():.4f}"


@torch.no_grad()
def test_the_op_runs_the_chain_where_the_kernel_cannot_and_says_so(model, caplog):
    skip_unless_the_kernel_runs(model)
    index = torch.cuda.current_device()
    assert "Mamba-2.8B" in torch.ops.quamba.w4a16_layer_step_lacks(768, 1536, 16, 48, 4, index)
    block, state = model.backbone.layers[0], model.allocate_cache(2, device=DEVICE).states[0]
    hidden = torch.randn(2, 1, model.config.d_model, device=DEVICE).half()
    assert block.mixer.layer_step_weights(block.norm, hidden, None, state) is None
    weights, chain = block.mixer.layer_weights(block.norm), copy.deepcopy(state)
    w4a16_step._log_chain.cache_clear()  # it says so once per reason and process
    with caplog.at_level(logging.INFO, logger="quamba"), backend.recording() as used:
        out, res = w4a16_layer_step(hidden, None, weights, state.conv, state.ssm,
                                    backend_name="cuda")
    assert "w4a16_ssm_step" in used
    assert f"{LAYER_OP} runs the chain" in caplog.text and "batch 1, not 2" in caplog.text
    chain_out, chain_res = chain_layer_step(hidden, None, weights, chain.conv, chain.ssm,
                                            backend_name="cuda")
    assert torch.equal(out, chain_out) and torch.equal(res, chain_res)
    assert torch.equal(state.ssm, chain.ssm) and torch.equal(state.conv, chain.conv)
