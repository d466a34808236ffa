"""The hybrids' preallocated KV cache (AttentionState) on the CPU: a decode step, which writes at
the device position and attends over the masked buffer, against the growing cache it replaced
(keys and values concatenated every step, attention over exactly the tokens seen) for every
family with attention, FP and quantized; decode against the prefill; a prefill that replaces what
the cache held; the overflow errors; and graphed generation's bookkeeping with stand-in graphs
(the graphs themselves: tests/models/test_cuda_hybrid_graphs.py).

Measured (fp32, 2 × 13-token prompts, 9 steps): the FP models' decode logits are within 5e-7
relative of the growing cache's (2.4e-7 to 4.6e-7; the softmax sums over the longer masked
buffer in another order), not bit-identical; the quantized models' are bit-identical here (the
int8 quantizers absorb the difference), which the bound of 1e-6 does not demand.
"""
import pytest
import torch
import torch.nn.functional as F

import quamba
from quamba.errors import QuambaError
from quamba.models import generation
from quamba.models.bamba import BambaConfig, BambaLM
from quamba.models.falcon_h1 import FalconH1Config, FalconH1LM
from quamba.models.jamba import JambaConfig, JambaLM
from quamba.models.nemotron_h import NemotronHConfig, NemotronHLM
from quamba.models.quantized import QuantizedMambaLM
from quamba.models.transformer_layers import Attention, RotaryEmbedding
from quamba.models.zamba2 import Zamba2Config, Zamba2LM
from tests.models.hybrid_checks import randomize_, rel, token_ids
from tests.models.test_prefill_graph import stand_in_capture

VOCAB = 97
MAMBA2 = dict(d_model=36, vocab_size=VOCAB, d_state=5, nheads=6, headdim=12, ngroups=2,
              chunk_size=8)
# 3 attention heads over 1 KV head (Zamba2: 3 over 3), odd sizes
FAMILIES = {
    "nemotron_h": lambda: NemotronHLM(NemotronHConfig(
        pattern="M*M-*M", **MAMBA2, num_attention_heads=3, num_key_value_heads=1,
        attention_head_dim=10, intermediate_size=22, dt_min=0.01)),
    "bamba": lambda: BambaLM(BambaConfig(
        layer_types=("mamba", "attention", "mamba", "attention"), **MAMBA2,
        num_attention_heads=3, num_key_value_heads=1, rotary_dim=6, intermediate_size=22)),
    "granite": lambda: BambaLM(BambaConfig(
        layer_types=("mamba", "attention", "mamba", "attention"), **MAMBA2,
        num_attention_heads=3, num_key_value_heads=1, rotary_dim=0, intermediate_size=22,
        embedding_multiplier=3.0, attention_multiplier=0.2, logits_scaling=2.5,
        model_type="granitemoehybrid")),
    "jamba": lambda: JambaLM(JambaConfig(
        d_model=36, num_hidden_layers=4, vocab_size=VOCAB, d_state=5, dt_rank=7,
        num_attention_heads=3, num_key_value_heads=1, head_dim=12, attn_layer_period=2,
        attn_layer_offset=1, intermediate_size=22, num_experts=1, num_experts_per_tok=1)),
    "falcon_h1": lambda: FalconH1LM(FalconH1Config(
        num_hidden_layers=2, d_inner=72, **MAMBA2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=12, intermediate_size=22)),
    "zamba2": lambda: Zamba2LM(Zamba2Config(
        layer_types=("mamba", "hybrid", "mamba", "hybrid"), **MAMBA2, num_attention_heads=3,
        num_key_value_heads=3, use_rope=True, intermediate_size=22, adapter_rank=4,
        attention_adapters=True)),
}
# (family, w_bits): the quantized hybrids
QUANTIZED = [("nemotron_h", 8), ("nemotron_h", 4), ("bamba", 8), ("bamba", 4), ("granite", 8)]


def fp_model(family: str):
    torch.manual_seed(0)
    return randomize_(FAMILIES[family]().eval())


def quantized(family: str, w_bits: int):
    recipe = quamba.QuantConfig(w_bits=w_bits)
    return quamba.quantize(fp_model(family), None, recipe, calib_data=token_ids(VOCAB, 4, 32, 5),
                           progress=False)


@pytest.fixture(scope="module", params=[*FAMILIES, *(f"{f} w{w}a8" for f, w in QUANTIZED)])
def model(request):
    family, _, recipe = request.param.partition(" ")
    return quantized(family, int(recipe[1])) if recipe else fp_model(family)


def growing_attend_step(self, q, k, v, state):
    """The decode step of the growing KV cache: RoPE at the host's count of the tokens seen, the
    new key and value appended to theirs, attention over exactly those (written into the buffer
    only so that the next step finds them)."""
    seen = int(state.length)
    if self.rotary is not None:
        q, k = self.rotary(q, seen), self.rotary(k, seen)
    keys = torch.cat([state.key[:, :, :seen], k], dim=2)
    values = torch.cat([state.value[:, :, :seen], v], dim=2)
    state.key[:, :, :seen + 1], state.value[:, :, :seen + 1] = keys, values
    state.length += 1
    return F.scaled_dot_product_attention(q, keys, values, scale=self.scale, enable_gqa=True)


def decode(model, tokens, prompt_len: int, max_seqlen: int):
    """Logits of a prefill of ``prompt_len`` tokens, and of one step per later token."""
    with torch.no_grad():
        cache = model.allocate_cache(tokens.shape[0], max_seqlen=max_seqlen)
        prefill = model(tokens[:, :prompt_len], cache=cache)
        return prefill, model(tokens[:, prompt_len:], cache=cache)


def test_decode_equals_the_growing_cache_and_the_prefill(model, monkeypatch):
    tokens = token_ids(VOCAB, 2, 22, seed=3)
    prefill, steps = decode(model, tokens, 13, 30)
    with monkeypatch.context() as patch:
        patch.setattr(Attention, "attend_step", growing_attend_step)
        grown_prefill, grown = decode(model, tokens, 13, 30)
    assert torch.equal(prefill, grown_prefill)
    assert rel(steps, grown) < 1e-6
    if not isinstance(model, QuantizedMambaLM):  # theirs: tests/quantization/hybrid_checks.py
        with torch.no_grad():
            assert rel(steps, model(tokens)[:, 13:]) < 1e-5


@pytest.mark.parametrize("rotary", [None, 6])
@pytest.mark.parametrize("batch, heads, kv_heads, prompt_len", [(2, 3, 1, 13), (1, 4, 4, 1),
                                                                 (3, 6, 2, 30)])
def test_attention_step_equals_attention_over_the_tokens_seen(rotary, batch, heads, kv_heads,
                                                              prompt_len):
    torch.manual_seed(1)
    rope = RotaryEmbedding(rotary, 10000.0) if rotary else None
    attention = Attention(20, heads, kv_heads, 8, rotary=rope).eval()
    x = torch.randn(batch, prompt_len + 7, 20)
    with torch.no_grad():
        full = attention(x)
        state = attention.allocate_state(batch, max_seqlen=prompt_len + 11)
        attention(x[:, :prompt_len], state)
        steps = [attention(x[:, t:t + 1], state, step=True) for t in range(prompt_len, x.shape[1])]
    assert int(state.length) == x.shape[1]
    assert (torch.cat(steps, dim=1) - full[:, prompt_len:]).abs().max() < 1e-6


def test_a_prefill_replaces_what_the_cache_held():
    """What a replayed prefill graph relies on: a prefill into a used cache (longer earlier
    sequence) decodes as into a fresh one."""
    model = fp_model("bamba")
    tokens = token_ids(VOCAB, 2, 12, seed=4)
    with torch.no_grad():
        used = model.allocate_cache(2, max_seqlen=40)
        model(token_ids(VOCAB, 2, 30, seed=5), cache=used)
        used.seqlen_offset = 0
        model(tokens[:, :7], cache=used)
        reused = model(tokens[:, 7:], cache=used)
    assert torch.equal(reused, decode(model, tokens, 7, 40)[1])


def test_tokens_past_the_kv_cache_are_refused():
    model = fp_model("nemotron_h")
    cache = model.allocate_cache(2, max_seqlen=20)
    with torch.no_grad():
        model(token_ids(VOCAB, 2, 17), cache=cache)
        model(token_ids(VOCAB, 2, 3), cache=cache)
        with pytest.raises(QuambaError, match=r"^20 \+ 1 tokens do not fit the KV cache of 20: "
                           "allocate it with a larger max_seqlen$"):
            model(token_ids(VOCAB, 2, 1), cache=cache)
        with pytest.raises(QuambaError, match=r"^0 \+ 21 tokens do not fit the KV cache of 20"):
            model(token_ids(VOCAB, 2, 21), cache=model.allocate_cache(2, max_seqlen=20))


def test_a_mamba_state_has_no_length_limit():
    model = fp_model("nemotron_h")
    layers = model.backbone.layers
    model.backbone.layers = torch.nn.ModuleList(layers[i] for i in (0, 2, 3, 5))  # "MM-M"
    cache = model.allocate_cache(1, max_seqlen=4)
    assert cache.max_seqlen is None
    with torch.no_grad():
        model(token_ids(VOCAB, 1, 9), cache=cache)


def test_generate_allocates_the_prompt_and_the_new_tokens(monkeypatch):
    """In a power of two of tokens, at least 256: the length that a decode graph's cache holds."""
    model = fp_model("zamba2")
    caches = []
    allocate = model.allocate_cache
    monkeypatch.setattr(model, "allocate_cache",
                        lambda *args, **kw: caches.append(allocate(*args, **kw)) or caches[-1])
    for new_tokens, max_seqlen in ((7, 256), (300, 512)):
        out = model.generate(token_ids(VOCAB, 2, 5, seed=6), max_new_tokens=new_tokens,
                             eos_token_id=-1)
        assert out.shape == (2, 5 + new_tokens) and caches[-1].max_seqlen == max_seqlen


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """CUDA graphs replaced by StandInGraph (tests/models/test_prefill_graph.py), on the CPU."""
    monkeypatch.setattr(generation, "_warm_up", lambda fn, device, runs: fn())
    monkeypatch.setattr(generation, "_capture", stand_in_capture)
    monkeypatch.setattr(generation, "_cuda_device", torch.device)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


@pytest.mark.parametrize("family", ["bamba", "falcon_h1"])
def test_graphed_generation_gives_the_eager_tokens(family, stand_in_graphs):
    """With stand-in graphs the replays recompute, so equal tokens mean that the graphs' cache,
    its KV capacity and the device positions are wired right."""
    model = fp_model(family)
    for length, new_tokens in ((5, 12), (9, 7), (200, 70)):
        ids = token_ids(VOCAB, 2, length, seed=length)
        eager = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=-1)
        graphed = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=-1,
                                 cache_graph=True, prefill_graph=True)
        assert torch.equal(graphed, eager)
    cache, _ = generation.graphed_decoder(model, 2, "cpu", 270)
    assert cache.max_seqlen == 512  # 256 held the first two; 270 tokens took the next power of 2


def test_a_graphed_step_past_the_kv_cache_is_refused(stand_in_graphs):
    model = fp_model("bamba")
    cache, step = generation.graphed_decoder(model, 1, "cpu", 10)
    cache.seqlen_offset = 0
    with torch.no_grad():
        model(token_ids(VOCAB, 1, 255), cache=cache)
        step(torch.zeros(1, dtype=torch.long))
        assert cache.seqlen_offset == 256
        with pytest.raises(QuambaError, match=r"^256 \+ 1 tokens do not fit the KV cache of 256"):
            step(torch.zeros(1, dtype=torch.long))


def test_cache_seqlen_is_a_power_of_two_from_256():
    assert [generation.cache_seqlen(n) for n in (1, 256, 257, 1152)] == [256, 256, 512, 2048]


@pytest.mark.parametrize("family", ["nemotron_h", "granite"])
def test_moe_layers_are_refused_for_graphs(family):
    config = FAMILIES[family]().config
    if family == "nemotron_h":
        model = NemotronHLM(NemotronHConfig(**{**config.__dict__, "pattern": "M*E",
                                               "n_routed_experts": 4, "moe_intermediate_size": 8,
                                               "moe_shared_expert_intermediate_size": 8}))
    else:
        model = BambaLM(BambaConfig(**{**config.__dict__, "num_experts": 4, "expert_size": 8}))
    name = "MoE" if family == "nemotron_h" else "GraniteMoE"
    with pytest.raises(QuambaError, match=f"^{type(model).__name__} cannot decode from CUDA "
                       f"graphs: its {name} layers read their expert routing on the host$"):
        model.generate(token_ids(VOCAB, 1, 4), max_new_tokens=2, cache_graph=True)
