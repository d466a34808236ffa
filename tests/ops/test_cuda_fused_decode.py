"""qmixer_ssm_step's kernels on a GPU: its Triton kernels against the chain of reference ops on the
same CUDA tensors, at small and Mamba-2.8B shapes (tests/ops/fused_step_cases.py says how each
output is compared), both its Triton kernels and its cluster kernel (csrc/fused_decode) against the
chain of CUDA ops bit for bit, and greedy decoding of a random-weight model with Mamba-2.8B's
layers (2 of them) fused against unfused, eager and from a CUDA graph, over 128 tokens.

The Triton kernel tests need Triton only; the cluster kernel, the op's cuda backend and the model
tests need quamba._C (the unfused step and the rest of the model run its kernels)."""
import pytest
import torch

import quamba
from quamba.models.config import preset_config
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops import backend
from quamba.ops.fused_decode.mixer_step import chain_step, qmixer_ssm_step
from tests.ops.fused_step_cases import (
    assert_codes_close,
    assert_floats_close,
    check_step,
    cloned_states,
    reference_step,
    step_case,
)

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
# The cluster kernel's (batch, d_inner, d_state, dt_rank, conv width), W8A8 x_proj
CLUSTER_SHAPES = [(1, 5120, 16, 160, 4), (8, 5120, 16, 160, 4), (13, 5120, 16, 160, 4),
                  (3, 384, 16, 20, 4), (2, 1536, 16, 48, 2), (5, 1008, 12, 64, 3),
                  (1, 48, 16, 8, 4)]
N_LAYER, VOCAB, PROMPT_LEN, NEW_TOKENS = 2, 4096, 16, 128


def kernel_step(**case):
    from quamba.ops.fused_decode import mixer_step_triton
    return mixer_step_triton.ssm_step_with_codes(**case)


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


def cluster_step(out_dtype, **case):
    """The cluster kernel (csrc/fused_decode) with the step's integer intermediates, as
    kernel_step returns them."""
    from quamba.ops.fused_decode import mixer_step_cuda
    batch, d_inner = case["x"].shape
    n_out = case["x_proj"].weight.shape[0]
    codes = tuple(torch.empty(batch, n, dtype=torch.int8, device=DEVICE)
                  for n in (d_inner, n_out, d_inner))
    lacks = mixer_step_cuda.lacks(case["x"], case["conv"], case["x_proj"], case["dt_proj"],
                             case["ssm_state"])
    if lacks is not None:
        pytest.skip(f"the cluster kernel cannot run here: {lacks}")
    y = mixer_step_cuda.ssm_step(**case, out_dtype=out_dtype, codes=codes)
    return (y, *codes)


@needs_extension
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("int8_state", [True, False], ids=["int8-state", "fp32-state"])
@pytest.mark.parametrize("shape", CLUSTER_SHAPES, ids=str)
def test_cluster_kernel_steps_are_the_cuda_chain_bit_for_bit(shape, int8_state, out_dtype):
    """The cluster kernel's y, codes and states against the chain of CUDA ops, four steps from
    the same states: clusters of 16 blocks (Mamba-2.8B, 130m's d_inner), of 6 and of one, a last
    block with fewer channels (1008 = 15 · 64 + 48), d_state 12 (states read one by one), conv
    width 2 and the one-lane QSScan step of batch 13."""
    batch, d_inner, d_state, dt_rank, width = shape
    case = step_case(batch, d_inner, d_state, dt_rank, width=width, int8_state=int8_state,
                     device=DEVICE)
    for _ in range(4):
        ran = cloned_states(case)
        fused = cluster_step(out_dtype, **ran)
        chain = chain_step(**case, out_dtype=out_dtype, backend_name="cuda")
        for name, out, ref in zip(("y", "u", "x_proj codes", "dt codes"), fused, chain):
            assert torch.equal(out.view(torch.int8), ref.view(torch.int8)), name
        assert torch.equal(ran["conv_state"], case["conv_state"]), "conv state"
        assert torch.equal(ran["ssm_state"].view(torch.int8),
                           case["ssm_state"].view(torch.int8)), "SSM state"


@needs_extension
def test_cluster_kernel_rejects_what_it_cannot_step():
    """Sizes outside the kernel get the reason from qmixer_ssm_step_lacks, and a call with them
    a one-line error rather than a launch."""
    lacks = torch.ops.quamba.qmixer_ssm_step_lacks
    assert lacks(5120, 160, 16) == ""
    assert "multiple of 16" in lacks(5000, 160, 16)
    assert "dt_rank" in lacks(5120, 162, 16)
    assert "d_state" in lacks(5120, 160, 8)
    assert "shared memory" in lacks(8192, 512, 16)
    case = step_case(1, 384, 8, 20, device=DEVICE)
    with pytest.raises(RuntimeError, match="d_state must be 9 to 16"):
        torch.ops.quamba.qmixer_ssm_step(
            case["x"], case["z"], 1.0, case["conv_state"], case["ssm_state"], 1.0,
            case["conv"].weight, None, 1.0, 1.0, 1.0, case["x_proj"].weight, 1.0,
            case["dt_proj"].weight, 1.0, 1.0, 1.0, 1.0, case["params"].A_log, 1.0,
            case["params"].D, 1.0, case["params"].dt_bias, 1.0, torch.float16)


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
