"""Published model shapes for benchmarks and tests with random weights (no download): the Mamba1 and
Mamba2 sizes of quamba.models.config.PRESETS, and one hybrid of each design as the fields of its
published config.json (transformers layout), read by the family's own parser.

Where a field of a published config.json was not found, the preset leaves it out and the
family's parser takes transformers' default; the comment above the preset names each such field.
None of them changes a weight's shape except where said.
"""
from __future__ import annotations

from quamba.models.config import PRESETS, ConfigError, preset_config
from quamba.models.loading import config_from_dict, lm_class

# nvidia/Nemotron-H-8B-Base-8K's config.json (its fields as copied into Megatron-Bridge's NemotronH
# bridge tests): 52 layers, 24 Mamba2, 4 attention, 24 squared-ReLU MLPs; untied 131072-row
# vocabulary; its attention_head_dim is transformers 5's head_dim. Not in it: time_step_min (Δ's
# floor; transformers' default 1e-3).
NEMOTRON_H_8B = dict(
    model_type="nemotron_h", hidden_size=4096, num_hidden_layers=52,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    vocab_size=131072, tie_word_embeddings=False, layer_norm_epsilon=1e-5, residual_in_fp32=False,
    mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
    chunk_size=128, use_conv_bias=True, use_bias=False, mamba_hidden_act="silu",
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, attention_bias=False,
    intermediate_size=21504, mlp_bias=False, mlp_hidden_act="relu2",
    bos_token_id=1, eos_token_id=2, pad_token_id=0)

# tiiuae/Falcon-H1-1.5B-Base: 24 layers of parallel Mamba2 (48 heads of 64, d_state 256) and
# attention (8 heads of 128, 2 KV heads), SwiGLU 4608, vocabulary 65537. Not found:
# tie_word_embeddings (untied here, transformers' default and that of Falcon-H1-3B and -7B; a tied
# model has 134M fewer parameters), mamba_chunk_size (transformers' 256), mamba_rms_norm
# (transformers' False) and the µP multipliers (folded into random weights, they change no shape
# and no speed).
FALCON_H1_1_5B = dict(
    model_type="falcon_h1", hidden_size=2048, num_hidden_layers=24, vocab_size=65537,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=4608,
    mamba_d_ssm=3072, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=256, mamba_d_conv=4,
    mamba_n_groups=1)

# Zyphra/Zamba2-2.7B: 54 layers, 45 Mamba2 (80 heads of 64, d_state 64, 1 group) and 9 hybrid
# layers taking turns on 2 shared blocks (32 heads of 160 over 2 · 2560, MLP 10240), no RoPE, no
# attention adapters, tied 32000-row vocabulary. The hybrid layers' places are transformers'
# default layers_block_type, which its Zamba2Config documents as the 2.7B model's (the count, 45
# and 9, matches the published config; the list itself was not found). Not found: adapter_rank
# (transformers' 128).
ZAMBA2_2_7B = dict(
    model_type="zamba2", hidden_size=2560, num_hidden_layers=54, vocab_size=32000,
    tie_word_embeddings=True,
    layers_block_type=(["mamba"] * 6 + ["hybrid"]) + (["mamba"] * 5 + ["hybrid"]) * 6
    + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3 + ["hybrid"] + ["mamba"] * 2,
    n_mamba_heads=80, mamba_expand=2, mamba_d_state=64, mamba_ngroups=1, mamba_d_conv=4,
    num_attention_heads=32, num_key_value_heads=32, intermediate_size=10240, num_mem_blocks=2,
    use_shared_attention_adapter=False, use_mem_rope=False, hidden_act="gelu")

# ibm-granite/granite-4.0-h-tiny: 40 layers, 36 Mamba2 (48 heads of 64, d_state 128) and 4
# attention (12 heads, 4 KV heads), each followed by an MoE of 64 experts of 512 (6 a token) and
# a shared MLP of 1024; tied 100352-row vocabulary. The µP multipliers are those of IBM's GGUF
# export of the model (embedding 12, logits 6, residual 0.22, attention 1/128). Not found:
# position_embedding_type (none here: no RoPE).
GRANITE_4_0_H_TINY = dict(
    model_type="granitemoehybrid", hidden_size=1536, num_hidden_layers=40, vocab_size=100352,
    tie_word_embeddings=True,
    layer_types=["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3
    + ["mamba"] * 4,
    num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64,
    mamba_expand=2, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=256,
    num_local_experts=64, num_experts_per_tok=6, intermediate_size=512,
    shared_intermediate_size=1024, embedding_multiplier=12.0, logits_scaling=6.0,
    residual_multiplier=0.22, attention_multiplier=0.0078125)

HYBRID_PRESETS = {"nemotron-h-8b": NEMOTRON_H_8B, "falcon-h1-1.5b": FALCON_H1_1_5B,
                  "zamba2-2.7b": ZAMBA2_2_7B, "granite-4.0-h-tiny": GRANITE_4_0_H_TINY}
PRESET_NAMES = (*PRESETS, *HYBRID_PRESETS)


def model_config(name: str):
    """The config of preset ``name``: a MambaConfig, or the hybrid family's config."""
    if name in HYBRID_PRESETS:
        return config_from_dict(HYBRID_PRESETS[name])
    if name in PRESETS:
        return preset_config(name)
    raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")


def build_preset(name: str, device=None, dtype=None):
    """An FP model of preset ``name`` with initial weights (``randomize_`` fills them)."""
    config = model_config(name)
    return lm_class(config)(config, device=device, dtype=dtype)
