"""The published shapes of quamba.models.presets: each builds (on the meta device: no memory) as
its family's model with the parameter count of the published model, and the hybrids' layer
patterns are the published ones."""
import pytest
import torch

from quamba.models.config import ConfigError
from quamba.models.presets import HYBRID_PRESETS, build_preset, model_config

# preset: (its model class, its parameters here, the published size in billions: the model's
# name or card)
COUNTS = {
    "falcon-mamba-7b": ("MambaLMHeadModel", 7_272_665_088, 7.27),
    "codestral-mamba-7b": ("MambaLMHeadModel", 7_285_403_648, 7.285403648),  # Mistral's count
    "mamba2-8b": ("MambaLMHeadModel", 8_236_999_680, 8),
    "nemotron-h-8b": ("NemotronHLM", 8_100_852_736, 8),
    "falcon-h1-1.5b": ("FalconH1LM", 1_554_789_760, 1.5),
    "zamba2-2.7b": ("Zamba2LM", 2_662_214_560, 2.7),
    "granite-4.0-h-tiny": ("BambaLM", 6_939_037_248, 7),  # 7B total, 1B active
}


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied head counted once


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_presets_have_the_published_parameter_count(name):
    model = build_preset(name, device="meta", dtype=torch.float16)
    kind, count, published = COUNTS[name]
    assert type(model).__name__ == kind and parameters(model) == count
    assert abs(count / 1e9 - published) / published < 0.04


def test_the_hybrid_layer_patterns_are_the_published_ones():
    from transformers import Zamba2Config
    nemotron = model_config("nemotron-h-8b")
    assert [nemotron.pattern.count(k) for k in "M*-"] == [24, 4, 24] and nemotron.n_layer == 52
    assert (nemotron.d_inner, nemotron.ngroups, nemotron.attention_head_dim) == (8192, 8, 128)
    zamba = model_config("zamba2-2.7b")
    default_kinds = ["hybrid" if kind == "hybrid" else "mamba"
                     for kind in Zamba2Config().layers_block_type]
    assert list(zamba.layer_types) == default_kinds and zamba.layer_types.count("hybrid") == 9
    assert (zamba.nheads, zamba.headdim, zamba.head_dim, zamba.num_mem_blocks) == (80, 64, 160, 2)
    granite = model_config("granite-4.0-h-tiny")
    attention = [i for i, kind in enumerate(granite.layer_types) if kind == "attention"]
    assert attention == [5, 15, 25, 35]
    assert (granite.num_experts, granite.expert_size, granite.rotary_dim) == (64, 512, 0)
    falcon = model_config("falcon-h1-1.5b")
    assert (falcon.d_inner, falcon.nheads, falcon.headdim, falcon.n_layer) == (3072, 48, 64, 48)
    assert set(HYBRID_PRESETS) == {"nemotron-h-8b", "falcon-h1-1.5b", "zamba2-2.7b",
                                   "granite-4.0-h-tiny"}


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError, match="unknown model preset 'mamba3'; choose one of 130m"):
        model_config("mamba3")
