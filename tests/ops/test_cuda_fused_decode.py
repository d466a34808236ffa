"""qmixer_ssm_step's Triton kernels compiled on a GPU: against the chain of reference ops on the
same CUDA tensors, at small and Mamba-2.8B shapes (tests/ops/fused_step_cases.py says how each
output is compared), and greedy decoding of a random-weight model with Mamba-2.8B's layers
(2 of them) fused against unfused, eager and from a CUDA graph, over 128 tokens.

The kernel tests need Triton only; the op's cuda backend and the model tests need quamba._C
(the unfused step and the rest of the model run its kernels)."""
import pytest
import torch

import quamba
from quamba.models.config import preset_config
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops import backend
from quamba.ops.fused_decode import chain_step, qmixer_ssm_step
from tests.ops.fused_step_cases import (assert_codes_close, assert_floats_close, check_step,
                                        cloned_states, reference_step, step_case)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_extension = pytest.mark.skipif(
    not torch.cuda.is_available() or backend.cuda_extension_error() is not None,
    reason=f"needs quamba._C ({backend.cuda_extension_error()})")

DEVICE = torch.device("cuda")
# (batch, d_inner, d_state, dt_rank): small, and Mamba-2.8B's layers at batch 1 and 8
SHAPES = [(3, 300, 16, 19), (1, 5120, 16, 160), (8, 5120, 16, 160), (13, 1536, 16, 48)]
# Against the CUDA chain: d_inner a multiple of the W4A8 GEMV's groups (64 here), d_state 16
# (each of the QSScan step's lanes-per-channel variants) and 7 (padded to 8 lanes)
CHAIN_SHAPES = [(3, 384, 16, 19), (1, 5120, 16, 160), (8, 5120, 16, 160), (13, 5120, 16, 160),
                (5, 320, 7, 12)]
N_LAYER, VOCAB, PROMPT_LEN, NEW_TOKENS = 2, 4096, 16, 128


def kernel_step(**case):
    from quamba.ops import fused_decode_kernel
    return fused_decode_kernel.ssm_step_with_codes(**case)


@pytest.mark.parametrize("int8_state", [True, False], ids=["int8-state", "fp32-state"])
@pytest.mark.parametrize("int4", [False, True], ids=["w8a8", "w4a8"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_steps_match_the_reference_chain(shape, int4, int8_state):
    group_size = 128 if shape[1] % 128 == 0 else 50  # 300 channels: 6 groups of 50
    case = step_case(*shape, int4=int4, int8_state=int8_state, group_size=group_size,
                     device=DEVICE)
    for _ in range(4):
        check_step(case, torch.float16, kernel_step)


@needs_extension
@pytest.mark.parametrize("int8_state", [True, False], ids=["int8-state", "fp32-state"])
@pytest.mark.parametrize("int4", [False, True], ids=["w8a8", "w4a8"])
@pytest.mark.parametrize("shape", CHAIN_SHAPES, ids=str)
def test_kernel_steps_are_the_cuda_chain_bit_for_bit(shape, int4, int8_state):
    """Four steps against the chain of CUDA ops (the unfused decode step), each from the same
    states: every output equal bit for bit, y included. Both add C · h in state_readout's order
    (the QSScan step with each of its lanes-per-channel variants: batch 13 at d_inner 5120 takes
    one lane a channel, batch 8 four, batch 1 sixteen), so that greedy decoding takes the same
    tokens fused and unfused."""
    case = step_case(*shape, int4=int4, int8_state=int8_state, group_size=64, device=DEVICE)
    for _ in range(4):
        ran = cloned_states(case)
        fused = kernel_step(**ran, out_dtype=torch.float16)
        chain = chain_step(**case, out_dtype=torch.float16, backend_name="cuda")
        for name, out, ref in zip(("y", "u", "x_proj codes", "dt codes"), fused, chain):
            assert torch.equal(out.view(torch.int8), ref.view(torch.int8)), name
        assert torch.equal(ran["conv_state"], case["conv_state"]), "conv state"
        assert torch.equal(ran["ssm_state"].view(torch.int8),
                           case["ssm_state"].view(torch.int8)), "SSM state"


@needs_extension
@pytest.mark.parametrize("int8_state", [True, False], ids=["int8-state", "fp32-state"])
@pytest.mark.parametrize("batch", [1, 8])
def test_the_cuda_backend_runs_the_kernels(batch, int8_state):
    case = step_case(batch, 5120, 16, 160, int8_state=int8_state, device=DEVICE)
    ran = cloned_states(case)
    with backend.recording() as used:
        y = qmixer_ssm_step(**ran, backend_name="cuda")
    assert used["qmixer_ssm_step"] == {"cuda"} and "qsscan_update" not in used
    y_ref = reference_step(case, torch.float16)
    assert_floats_close(y, y_ref, "y")
    if int8_state:
        assert_codes_close(ran["ssm_state"], case["ssm_state"], "SSM state")


@pytest.fixture(scope="module")
def fp_model():
    config = preset_config("2.8b")
    config.n_layer, config.vocab_size = N_LAYER, VOCAB
    model = MambaLMHeadModel(config, device=DEVICE, dtype=torch.float16).eval()
    return randomize_(model, seed=0)


def quantized(fp_model, w_bits):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    calib = torch.randint(0, VOCAB, (4, 256), device=DEVICE, generator=gen)
    config = quamba.QuantConfig(w_bits=w_bits, a_bits=8, seed=0)
    return quamba.quantize(fp_model, config=config, calib_data=calib, progress=False)


@needs_extension
@pytest.mark.parametrize("state_cache", ["int8", "fp32"])
@pytest.mark.parametrize("w_bits", [8, 4], ids=["w8a8", "w4a8"])
def test_greedy_decoding_fused_is_unfused_over_128_tokens(fp_model, w_bits, state_cache):
    model = quantized(fp_model, w_bits).set_state_cache(state_cache)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    prompt = torch.randint(0, VOCAB, (2, PROMPT_LEN), device=DEVICE, generator=gen)
    runs = {}
    for fused in (False, True):
        model.set_fused_decode(fused)
        with backend.recording() as used:
            for graphed in (False, True):
                runs[fused, graphed] = model.generate(prompt, max_new_tokens=NEW_TOKENS,
                                                      eos_token_id=-1, cache_graph=graphed)
        assert ("qmixer_ssm_step" in used) == fused
        assert backend.on_reference(used) == []
    unfused = runs[False, False]
    assert unfused.shape == (2, PROMPT_LEN + NEW_TOKENS)
    for key, tokens in runs.items():
        differing = (tokens != unfused).nonzero()
        assert differing.numel() == 0, (f"fused, graphed = {key}: tokens differ first at (row, "
                                        f"position) {differing[0].tolist()}")
