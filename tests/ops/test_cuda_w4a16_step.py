"""w4a16_ssm_step's cluster kernel on a GPU: against the step in fp64
(tests/ops/w4a16_step_cases.py) as close as the chain of CUDA ops it replaces (causal-conv1d's conv update, the 4-bit GEMV,
cuBLAS, mamba-ssm's step) at small and Mamba-2.8B shapes, float16 and bfloat16; its fallback to
that chain where it cannot run; and greedy decoding of a random-weight W4A16 model with Mamba-2.8B's
layers (2 of them), fused, eager and from a CUDA graph, against the unfused decode step."""
import logging

import pytest
import torch

import quamba
from quamba.models.config import preset_config
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops import backend
from quamba.ops.fused_decode import w4a16_step
from quamba.ops.fused_decode.w4a16_step import chain_step, w4a16_ssm_step
from tests.ops.w4a16_step_cases import (
    cloned,
    fp64_step,
    relative_error,
    step_case,
    teacher_forced_logits,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not torch.cuda.is_available() or backend.cuda_extension_error() is not None,
                       reason=f"needs quamba._C ({backend.cuda_extension_error()})"),
]

DEVICE = torch.device("cuda")
# (batch, d_inner, d_state, dt_rank, conv width, group size, dtype): Mamba-2.8B's mixers at batch
# 1, 8 and 13, Mamba-130m's, and small ones (a slice short of whole, d_state below 16, widths 2, 3)
SHAPES = [(1, 5120, 16, 160, 4, 128, torch.float16), (8, 5120, 16, 160, 4, 128, torch.float16),
          (13, 5120, 16, 160, 4, 128, torch.bfloat16), (3, 1536, 16, 48, 4, 128, torch.float16),
          (5, 1120, 12, 64, 3, 32, torch.bfloat16), (2, 96, 16, 8, 2, 32, torch.float16)]
# the kernel's error against fp64 may exceed the chain's by this factor, plus this much relative
# to the largest value (both round u, x_proj's output and dt to the dtype, so a value near a
# rounding boundary may round either way)
ERROR_FACTOR = 2.0
SLACK = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
N_LAYER, VOCAB, PROMPT_LEN, NEW_TOKENS = 2, 4096, 16, 128


def kernel_step(case):
    from quamba.ops.fused_decode import w4a16_step_cuda
    assert w4a16_step_cuda.lacks(**case) is None
    return w4a16_step_cuda.ssm_step(**case)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_is_as_close_to_fp64_as_the_chain_of_cuda_ops(shape):
    *sizes, dtype = shape
    case = step_case(*sizes, dtype=dtype, device=DEVICE, seed=sum(sizes))
    y_ref, conv_ref, state_ref = fp64_step(**case)
    chain, kernel = cloned(case), cloned(case)
    y_chain = chain_step(**chain, backend_name="cuda")
    y_kernel = kernel_step(kernel)
    assert y_kernel.dtype == dtype and y_kernel.shape == case["x"].shape
    assert torch.equal(kernel["conv_state"], chain["conv_state"])
    assert torch.equal(kernel["conv_state"].double(), conv_ref)
    for name, got, expected, ref in [("y", y_kernel, y_chain, y_ref),
                                     ("ssm_state", kernel["ssm_state"], chain["ssm_state"],
                                      state_ref)]:
        bound = ERROR_FACTOR * relative_error(expected, ref) + SLACK[dtype]
        assert relative_error(got, ref) <= bound, name


def test_ungated_step_without_conv_bias():
    case = step_case(3, 1536, 16, 48, 4, 128, device=DEVICE, gated=False, conv_bias=False)
    y_ref, _, _ = fp64_step(**case)
    y_chain = chain_step(**cloned(case), backend_name="cuda")
    bound = ERROR_FACTOR * relative_error(y_chain, y_ref) + SLACK[torch.float16]
    assert relative_error(kernel_step(cloned(case)), y_ref) <= bound


def test_op_runs_the_kernel_and_says_when_it_runs_the_chain(caplog):
    case = step_case(2, 1536, 16, 48, 4, 128, device=DEVICE)
    with backend.recording() as used:
        y = w4a16_ssm_step(**cloned(case))
    assert used["w4a16_ssm_step"] == {"cuda"} and "w4a16_linear" not in used
    assert torch.equal(y, kernel_step(cloned(case)))
    fp32 = step_case(2, 1536, 16, 48, 4, 128, dtype=torch.float32, device=DEVICE)
    w4a16_step._log_chain.cache_clear()  # it says so once per reason and process
    with caplog.at_level(logging.WARNING, logger="quamba"), backend.recording() as used:
        y = w4a16_ssm_step(**cloned(fp32))
    assert "w4a16_linear" in used and "float16 or bfloat16" in caplog.text
    assert torch.equal(y, chain_step(**cloned(fp32), backend_name="cuda"))


@pytest.fixture(scope="module")
def w4a16_model():
    config = preset_config("2.8b")
    config.n_layer, config.vocab_size = N_LAYER, VOCAB
    fp_model = MambaLMHeadModel(config, device=DEVICE, dtype=torch.float16).eval()
    fp_model = randomize_(fp_model, seed=0)
    return quamba.quantize(fp_model, config=quamba.QuantConfig(w_bits=4, a_bits=16), progress=False)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_greedy_decoding_fused_takes_the_unfused_steps_choices(w4a16_model, graphed):
    """Over 128 greedy tokens, each token the fused decode step chose is the unfused step's
    argmax on the same tokens, or within a near-tie of it (float sums in another order)."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    prompt = torch.randint(0, VOCAB, (2, PROMPT_LEN), device=DEVICE, generator=gen)
    with backend.recording() as used:
        tokens = w4a16_model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=-1,
                                      cache_graph=graphed)
    assert "w4a16_ssm_step" in used and backend.on_reference(used) == []
    assert "selective_state_update" not in used  # the kernel, not the chain, stepped the SSM
    try:
        logits = teacher_forced_logits(w4a16_model.set_fused_ssm_step(False), tokens, PROMPT_LEN)
    finally:
        w4a16_model.set_fused_ssm_step(True)
    chosen = tokens[:, PROMPT_LEN:]
    margin = logits.max(-1).values - logits.gather(-1, chosen[..., None])[..., 0]
    assert (margin == 0).float().mean() >= 0.95
    assert margin.max() <= 1e-2 * logits.std(), f"largest margin {margin.max():.4f}"
