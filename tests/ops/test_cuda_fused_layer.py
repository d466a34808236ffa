"""qmamba_layer_step's layer kernel (csrc/fused_decode/layer_step_cuda.cu) on a GPU: random-weight
W8A8 and W4A8 models with Mamba-2.8B's blocks (2 of them), each block's step against the chain of
CUDA ops bit for bit (out, residual, both states) over several steps, and greedy decoding with the
layer kernel against op by op, eager and from a CUDA graph, over 128 tokens: the same tokens; and a
block's decode step is the layer kernel alone."""
import copy

import pytest
import torch

import quamba
from quamba.models.config import preset_config
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.models.quantized import QMambaBlock
from quamba.ops import backend
from quamba.ops.fused_decode.layer_step import OP, chain_layer_step, qmamba_layer_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or backend.cuda_extension_error() is not None,
                       reason=f"needs a CUDA device and quamba._C ({backend.cuda_extension_error()})"),
]

DEVICE = torch.device("cuda")
N_LAYER, VOCAB, PROMPT_LEN, NEW_TOKENS, STEPS = 2, 4096, 16, 128, 4


@pytest.fixture(scope="module")
def fp_model():
    config = preset_config("2.8b")
    config.n_layer, config.vocab_size = N_LAYER, VOCAB
    return randomize_(MambaLMHeadModel(config, device=DEVICE, dtype=torch.float16).eval(), seed=0)


@pytest.fixture(scope="module", params=[8, 4], ids=["w8a8", "w4a8"])
def model(request, fp_model):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    calib = torch.randint(0, VOCAB, (4, 256), device=DEVICE, generator=gen)
    config = quamba.QuantConfig(w_bits=request.param, a_bits=8, seed=0)
    model = quamba.quantize(fp_model, config=config, calib_data=calib, progress=False)
    return model


def kernel_lacks(model) -> str | None:
    block = next(b for b in model.modules() if isinstance(b, QMambaBlock))
    cache = model.allocate_cache(1, device=DEVICE)
    hidden = torch.zeros(1, 1, model.config.d_model, dtype=torch.float16, device=DEVICE)
    if block.mixer.layer_step_weights(block.norm, hidden, None, cache.states[0]) is not None:
        return None
    from quamba.ops.fused_decode import layer_step_cuda
    lacks = layer_step_cuda.lacks(hidden, None, block.mixer.layer_weights(block.norm),
                                  cache.states[0].conv, cache.states[0].ssm)
    return lacks or "the block does not qualify"


def test_each_block_step_is_the_cuda_chain_bit_for_bit(model):
    lacks = kernel_lacks(model)
    if lacks:
        pytest.skip(f"the layer kernel cannot run here: {lacks}")
    cache = model.allocate_cache(1, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    for state in cache.states:  # states mid-generation: random codes
        state.conv.copy_(torch.randint(-127, 128, state.conv.shape, generator=gen, device=DEVICE))
        state.ssm.copy_(torch.randint(-127, 128, state.ssm.shape, generator=gen, device=DEVICE))
    d_model = model.config.d_model
    for step in range(STEPS):
        hidden = torch.randn(1, 1, d_model, generator=gen, device=DEVICE).half()
        residual = (None if step % 2 == 0
                    else 4 * torch.randn(1, 1, d_model, generator=gen, device=DEVICE))
        for block, state in zip(model.backbone.layers, cache.states):
            weights = block.mixer.layer_weights(block.norm)
            chain_state = copy.deepcopy(state)
            with torch.no_grad(), backend.recording() as used:
                out, res = qmamba_layer_step(hidden, residual, weights, state.conv, state.ssm,
                                             backend_name="cuda")
            assert used[OP] == {"cuda"} and "rmsnorm_quant" not in used
            ref_out, ref_res = chain_layer_step(hidden, residual, weights, chain_state.conv,
                                                chain_state.ssm, backend_name="cuda")
            assert torch.equal(res, ref_res), f"step {step}: residual"
            assert torch.equal(state.conv, chain_state.conv), f"step {step}: conv state"
            assert torch.equal(state.ssm, chain_state.ssm), f"step {step}: SSM state"
            assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16)), f"step {step}: out"
            hidden, residual = out, res


def test_greedy_decoding_with_the_layer_kernel_is_op_by_op_over_128_tokens(model):
    lacks = kernel_lacks(model)
    if lacks:
        pytest.skip(f"the layer kernel cannot run here: {lacks}")
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), device=DEVICE, generator=gen)
    runs = {}
    for fused in (False, True):
        model.set_fused_layer(fused)
        with backend.recording() as used:
            for graphed in (False, True):
                runs[fused, graphed] = model.generate(prompt, max_new_tokens=NEW_TOKENS,
                                                     eos_token_id=-1, cache_graph=graphed)
        assert (OP in used) == fused
        assert backend.on_reference(used) == []
    model.set_fused_layer(True)
    unfused = runs[False, False]
    assert unfused.shape == (1, PROMPT_LEN + NEW_TOKENS)
    for key, tokens in runs.items():
        differing = (tokens != unfused).nonzero()
        assert differing.numel() == 0, (f"fused, graphed = {key}: tokens differ first at (row, "
                                        f"position) {differing[0].tolist()}")


def test_a_block_step_under_inference_mode_is_the_layer_kernel_alone(model):
    """Generation runs under torch.inference_mode. The launcher's repacked weights are made once
    there too: when W4A8's were remade at every step, each block ran two more kernels."""
    lacks = kernel_lacks(model)
    if lacks:
        pytest.skip(f"the layer kernel cannot run here: {lacks}")
    cache = model.allocate_cache(1, device=DEVICE)
    hidden = torch.randn(1, 1, model.config.d_model, device=DEVICE).half()
    cuda = [torch.profiler.ProfilerActivity.CUDA]
    with torch.inference_mode():
        for _ in range(2):  # the first steps make the launcher's constants; the second is profiled
            with torch.profiler.profile(activities=cuda) as profile:
                out, residual = hidden, None
                for block, state in zip(model.backbone.layers, cache.states):
                    out, residual = block(out, residual, state=state, step=True)
                torch.cuda.synchronize()
    kernels = [event.name for event in profile.events() if event.device_type.name == "CUDA"]
    assert len(kernels) == N_LAYER and all("layer_step_kernel" in name for name in kernels), kernels


def test_the_kernel_says_what_it_cannot_run():
    lacks = torch.ops.quamba.qmamba_layer_step_lacks
    index = torch.cuda.current_device()
    assert "Mamba-2.8B" in lacks(768, 1536, 16, 48, 4, index)
    assert "Mamba-2.8B" in lacks(2560, 5120, 16, 160, 3, index)
    hidden = torch.zeros(2560, dtype=torch.float16, device=DEVICE)
    with pytest.raises(RuntimeError, match="in_proj"):
        torch.ops.quamba.qmamba_layer_step(
            hidden, None, torch.zeros(10, 2560, dtype=torch.int8, device=DEVICE), 1.0,
            torch.zeros(1, dtype=torch.int8, device=DEVICE), hidden, 1.0, hidden, None, 1.0, 1.0,
            1.0, hidden, hidden, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, hidden, 1.0, hidden, 1.0, hidden,
            1.0, 1e-5, 1.0, 1.0, 1.0, None, None, None, None, hidden)
