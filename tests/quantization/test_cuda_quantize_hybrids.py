"""Every hybrid family quantized on the GPU (fp16, W8A8, W4A8 and W4A16): Nemotron-H (Mamba2,
attention, relu² MLP, MoE), Bamba (partial RoPE, SwiGLU), Granite-4.0-H (µP multipliers, MoE),
Falcon-H1 (Mamba2 and attention in parallel), Jamba (Mamba1 with norms of Δ, B and C, MoE) and
Zamba2 (shared blocks with LoRA adapters). Each quantized op of the Mamba layers, the attention,
MLP and expert linears runs its kernel (W4A16: its 4-bit linears; its conv and scan stay in float),
the model's logits stay near the torch backend's, and the decode steps continue the prefill.

Sizes are within every kernel's limits (4-bit input widths and groups multiples of 32 and 128, a
Hadamard size for the residual stream). On the CPU (fp32, torch backend) the same models' decode
steps through the int8 state are 0.011 (Falcon-H1) to 0.032 (Nemotron-H) off the full forward in
W8A8, 0.090 in Jamba's W4A8; the prefill equals it within 1e-7."""
import pytest
import torch

import quamba
from quamba.models.bamba import BambaConfig, BambaLM
from quamba.models.falcon_h1 import FalconH1Config, FalconH1LM
from quamba.models.jamba import JambaConfig, JambaLM
from quamba.models.mamba import randomize_
from quamba.models.nemotron_h import NemotronHConfig, NemotronHLM
from quamba.models.zamba2 import Zamba2Config, Zamba2LM
from quamba.ops import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 1000
MAMBA2 = dict(d_model=256, vocab_size=VOCAB, d_state=64, nheads=8, headdim=64, ngroups=2,
              chunk_size=64)
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
CONFIGS = {
    # Mamba, attention, Mamba, MLP, Mamba, MoE
    "nemotron_h": (NemotronHLM, NemotronHConfig(
        pattern="M*M-ME", **MAMBA2, **ATTENTION, attention_head_dim=64, n_routed_experts=4,
        moe_intermediate_size=256, moe_shared_expert_intermediate_size=256)),
    "bamba": (BambaLM, BambaConfig(
        layer_types=("mamba", "attention", "mamba"), **MAMBA2, **ATTENTION, rotary_dim=32)),
    "granitemoehybrid": (BambaLM, BambaConfig(
        layer_types=("mamba", "attention", "mamba"), **MAMBA2, **ATTENTION, rotary_dim=32,
        num_experts=4, expert_size=256, embedding_multiplier=3.0, residual_multiplier=0.4,
        attention_multiplier=0.2, logits_scaling=2.5, model_type="granitemoehybrid")),
    "falcon_h1": (FalconH1LM, FalconH1Config(
        num_hidden_layers=2, d_inner=512, head_dim=64, **MAMBA2, **ATTENTION)),
    # Mamba1 layers 0 and 2, attention 1 and 3, MoE feed-forwards after layers 1 and 3
    "jamba": (JambaLM, JambaConfig(
        d_model=256, num_hidden_layers=4, vocab_size=VOCAB, d_state=16, dt_rank=16, head_dim=64,
        attn_layer_period=2, attn_layer_offset=1, num_experts=4, expert_layer_period=2,
        expert_layer_offset=1, **ATTENTION)),
    # 2 Mamba and 3 hybrid layers over 2 shared blocks (block 0 used twice), RoPE, adapters
    "zamba2": (Zamba2LM, Zamba2Config(
        layer_types=("mamba", "hybrid", "hybrid", "mamba", "hybrid"), d_model=256,
        vocab_size=VOCAB, d_state=64, nheads=8, headdim=64, chunk_size=64, num_attention_heads=4,
        num_key_value_heads=4, use_rope=True, intermediate_size=512, num_mem_blocks=2,
        adapter_rank=8, attention_adapters=True, dt_min=0.01)),
}
RECIPES = {"w8a8": {}, "w4a8": {"w_bits": 4}, "w4a16": {"w_bits": 4, "a_bits": 16}}
LINEARS = {"w8a8": "w8a8_linear", "w4a8": "w4a8_linear", "w4a16": "w4a16_linear"}


def tokens(batch, seqlen, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seqlen), device="cuda", generator=generator)


@pytest.fixture(scope="module", params=list(CONFIGS))
def fp_model(request):
    model_class, config = CONFIGS[request.param]
    return randomize_(model_class(config, device="cuda", dtype=torch.float16).eval(), seed=0)


@pytest.fixture(scope="module", params=list(RECIPES))
def recipe(request):
    return request.param


@pytest.fixture(scope="module")
def qmodel(recipe, fp_model):
    assert backend.cuda_extension_error() is None, backend.cuda_extension_error()
    return quamba.quantize(fp_model, None, quamba.QuantConfig(**RECIPES[recipe]),
                           calib_data=tokens(8, 128, seed=1), progress=False)


def test_every_quantized_op_runs_on_cuda(qmodel, recipe):
    with torch.inference_mode(), backend.recording() as ran:
        cache = qmodel.allocate_cache(2)
        qmodel(tokens(2, 33, seed=2), cache=cache)
        qmodel(tokens(2, 1, seed=3), cache=cache)
    if recipe != "w4a16":  # W4A16's float conv and scan: the FP16 baseline's kernels
        assert backend.on_reference(ran) == [], backend.summary(ran)
    assert any(op.startswith(LINEARS[recipe]) and "cuda" in used
               for op, used in ran.items())


def test_kernels_match_the_torch_reference(qmodel, monkeypatch):
    ids = tokens(3, 100, seed=4)
    with torch.inference_mode():
        fast = qmodel(ids).float()
        monkeypatch.setenv("QUAMBA_BACKEND", "torch")
        reference = qmodel(ids).float()
    assert (fast - reference).norm() / reference.norm() < 6e-2


def test_decode_continues_the_prefill(qmodel):
    """Zamba2's steps through the int8 decode state: 0.067 (W8A8) and 0.060 (W4A8) off the full
    forward on an H200."""
    ids = tokens(2, 48, seed=5)
    with torch.inference_mode():
        full = qmodel(ids).float()
        cache = qmodel.allocate_cache(2)
        prefill = qmodel(ids[:, :40], cache=cache).float()
        steps = qmodel(ids[:, 40:], cache=cache).float()
    assert (prefill - full[:, :40]).norm() / full[:, :40].norm() < 2e-2
    assert (steps - full[:, 40:]).norm() / full[:, 40:].norm() < 0.15
