"""Hybrids decoding from CUDA graphs: random small FP16 Nemotron-H (Mamba2, attention without
RoPE, relu² MLP) and Bamba (Mamba2, partial-RoPE attention, SwiGLU) models and their W8A8 and
W4A8 quantizations give the eager path's greedy tokens over 32 steps from graphed decode steps,
with and without a graphed prefill, at batch 1 and 3; the replays advance the KV caches' device
lengths; a longer sequence recaptures with a larger cache; a model with MoE layers is refused.
(The KV cache against its torch reference and the bookkeeping: tests/models/test_kv_cache.py.)"""
import pytest
import torch

import quamba
from quamba.errors import QuambaError
from quamba.models.bamba import BambaConfig, BambaLM
from quamba.models.generation import graphed_decoder
from quamba.models.mamba import randomize_
from quamba.models.nemotron_h import NemotronHConfig, NemotronHLM
from quamba.models.state import AttentionState
from quamba.ops.backend import cuda_extension_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 1000
NEW_TOKENS = 32
# sizes within the kernels' limits (4-bit input widths and groups multiples of 32 and 128)
MAMBA2 = dict(d_model=256, vocab_size=VOCAB, d_state=64, nheads=8, headdim=64, ngroups=2,
              chunk_size=64)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


def nemotron_h(pattern: str = "M*M-M*-"):
    config = NemotronHConfig(pattern=pattern, **MAMBA2, **ATTENTION, attention_head_dim=64,
                             n_routed_experts=4, moe_intermediate_size=256,
                             moe_shared_expert_intermediate_size=256)
    return randomize_(NemotronHLM(config, device="cuda", dtype=torch.float16)).eval()


def bamba():
    config = BambaConfig(layer_types=("mamba", "attention", "mamba", "attention"), **MAMBA2,
                         **ATTENTION, rotary_dim=32)
    return randomize_(BambaLM(config, device="cuda", dtype=torch.float16)).eval()


def prompts(batch: int, length: int, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), device="cuda", generator=generator)


def quantized(fp_model, w_bits: int):
    if cuda_extension_error() is not None:
        pytest.skip(cuda_extension_error())
    return quamba.quantize(fp_model, None, quamba.QuantConfig(w_bits=w_bits),
                           calib_data=prompts(8, 128, 0), progress=False)


@pytest.fixture(scope="module")
def fp_models():
    return {"nemotron_h": nemotron_h(), "bamba": bamba()}


@pytest.fixture(scope="module", params=["nemotron_h fp16", "nemotron_h w8a8", "nemotron_h w4a8",
                                        "bamba fp16", "bamba w8a8", "bamba w4a8"])
def model(request, fp_models):
    family, recipe = request.param.split()
    fp_model = fp_models[family]
    return fp_model if recipe == "fp16" else quantized(fp_model, int(recipe[1]))


def kv_lengths(cache) -> list[int]:
    return [int(state.length) for state in cache.states if isinstance(state, AttentionState)]


@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_decode_gives_the_eager_tokens(model, batch):
    for seed, length in ((0, 37), (1, 45)):  # the second replays the graphs the first captured
        ids = prompts(batch, length, seed)
        eager = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=-1)
        graphed = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=-1,
                                 cache_graph=True)
        both = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=-1, cache_graph=True,
                              prefill_graph=True)
        assert torch.equal(graphed, eager) and torch.equal(both, eager)
        cache, _ = graphed_decoder(model, batch, "cuda", length + NEW_TOKENS)
        # the prompt and the 31 steps after it, each replay advancing the device lengths
        assert kv_lengths(cache) == [length + NEW_TOKENS - 1] * 2
        assert cache.seqlen_offset == length + NEW_TOKENS - 1


def test_a_longer_sequence_recaptures_with_a_larger_cache(fp_models):
    model = fp_models["bamba"]
    ids = prompts(2, 37, 2)
    model.generate(ids, max_new_tokens=8, cache_graph=True, eos_token_id=-1)
    small, _ = graphed_decoder(model, 2, "cuda", 45)
    ids = prompts(2, 230, 3)
    eager = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=-1)
    graphed = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=-1, cache_graph=True,
                             prefill_graph=True)
    large, _ = graphed_decoder(model, 2, "cuda", 262)
    assert torch.equal(graphed, eager)
    assert (small.max_seqlen, large.max_seqlen) == (256, 512)


def test_a_model_with_moe_layers_is_refused():
    model = nemotron_h("M*E")
    with pytest.raises(QuambaError, match="^NemotronHLM cannot decode from CUDA graphs: its MoE "
                       "layers read their expert routing on the host$"):
        model.generate(prompts(1, 9, 4), max_new_tokens=4, cache_graph=True)
