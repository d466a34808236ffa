"""The FP Mamba2 LM: logits equal to transformers' Mamba2ForCausalLM, the chunked SSD against its
step-by-step recurrence, decode against prefill, and loading both Hub layouts."""
import json

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

import quamba
from quamba.errors import CheckpointError
from quamba.models.config import MambaConfig, preset_config
from quamba.models.loading import save_model
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops.ssd.ssd import ssd_scan, ssd_state_update

# Odd sizes: ngroups 2 (3 heads per group), headdim 16, chunk 16 < the prompt, d_state 12.
HF_CONFIG = dict(vocab_size=101, hidden_size=48, num_hidden_layers=2, state_size=12, expand=2,
                 num_heads=6, head_dim=16, n_groups=2, chunk_size=16, conv_kernel=4,
                 tie_word_embeddings=True)


def random_reference(seed: int = 0) -> Mamba2ForCausalLM:
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(Mamba2Config(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand_like(param) * 15 + 1))
            elif name.endswith(".D"):
                param.copy_(torch.rand_like(param) + 0.5)
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn_like(param) * 0.5 - 3)
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mamba2-hf")
    random_reference().save_pretrained(directory)
    return directory


def ids(batch: int, length: int, seed: int = 1):
    return torch.randint(0, HF_CONFIG["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_logits_equal_transformers_mamba2(hf_dir):
    model, _ = quamba.load_model(hf_dir, tokenizer=False)
    assert model.config.layer == "Mamba2" and model.source["layout"] == "transformers"
    assert (model.config.nheads, model.config.headdim, model.config.ngroups) == (6, 16, 2)
    reference = random_reference()
    tokens = ids(2, 37)  # three chunks of 16, the last partial
    with torch.no_grad():
        assert rel(model(tokens), reference(tokens).logits) < 1e-4


def test_decode_steps_follow_the_prefill(hf_dir):
    model, _ = quamba.load_model(hf_dir, tokenizer=False)
    tokens = ids(3, 29, seed=2)
    with torch.no_grad():
        full = model(tokens)
        cache = model.allocate_cache(3)
        model(tokens[:, :17], cache=cache)
        steps = model(tokens[:, 17:], cache=cache)
    assert rel(steps, full[:, 17:]) < 1e-5
    assert model.generate(tokens[:, :4], max_new_tokens=6).shape == (3, 10)


@pytest.mark.parametrize("seqlen, chunk_size", [(1, 4), (7, 3), (32, 8), (33, 8), (50, 64)])
def test_chunked_scan_equals_the_step_by_step_recurrence(seqlen, chunk_size):
    gen = torch.Generator().manual_seed(seqlen)
    batch, nheads, headdim, ngroups, d_state = 2, 6, 5, 3, 7
    x = torch.randn(batch, seqlen, nheads, headdim, generator=gen, dtype=torch.float64)
    dt = torch.randn(batch, seqlen, nheads, generator=gen, dtype=torch.float64)
    B, C = (torch.randn(batch, seqlen, ngroups, d_state, generator=gen, dtype=torch.float64)
            for _ in range(2))
    A = -torch.rand(nheads, generator=gen, dtype=torch.float64) * 4
    D, dt_bias = torch.randn(nheads, generator=gen), torch.randn(nheads, generator=gen)
    initial = torch.randn(batch, nheads, headdim, d_state, generator=gen)
    y, last = ssd_scan(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state=initial)
    state, steps = initial.clone(), []
    for t in range(seqlen):
        steps.append(ssd_state_update(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, dt_bias))
    assert torch.allclose(y, torch.stack(steps, dim=1), atol=1e-5, rtol=1e-5)
    assert torch.allclose(last, state, atol=1e-5, rtol=1e-5)


def test_mamba_ssm_layout_round_trip(tmp_path):
    config = MambaConfig(d_model=40, n_layer=2, vocab_size=97, d_state=8, layer="Mamba2", headdim=10,
                         ngroups=4, chunk_size=8)
    model = randomize_(MambaLMHeadModel(config).eval(), seed=3)
    save_model(model, tmp_path / "m", layout="mamba_ssm")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["ssm_cfg"]["layer"] == "Mamba2" and saved["ssm_cfg"]["ngroups"] == 4
    loaded, _ = quamba.load_model(tmp_path / "m", tokenizer=False)
    assert loaded.source["layout"] == "mamba_ssm" and loaded.config.layer == "Mamba2"
    tokens = ids(2, 19)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_hub_config_of_state_spaces_mamba2_is_read():
    """config.json of state-spaces/mamba2-130m (its fields, as published)."""
    config = MambaConfig.from_mamba_ssm({
        "d_model": 768, "d_intermediate": 0, "n_layer": 24, "vocab_size": 50277,
        "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
        "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16,
        "tie_embeddings": True})
    assert (config.layer, config.d_state, config.headdim, config.nheads, config.ngroups) == \
        ("Mamba2", 128, 64, 24, 1)


@pytest.mark.parametrize("ssm_cfg, message", [
    ({"layer": "Mamba2", "norm_before_gate": True}, "norm_before_gate=True is not supported"),
    ({"layer": "Mamba2", "D_has_hdim": True}, "D_has_hdim=True is not supported"),
    ({"layer": "Mamba2", "d_ssm": 64}, "d_ssm < d_inner"),
    ({"layer": "Mamba2", "headdim": 48}, "not a multiple of headdim"),
    ({"layer": "Mamba3"}, "Mamba1 and Mamba2 models are supported"),
])
def test_unsupported_mamba2_configs_are_refused(tmp_path, ssm_cfg, message):
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 64, "n_layer": 1, "vocab_size": 10,
                                                      "ssm_cfg": ssm_cfg}))
    with pytest.raises(CheckpointError, match=message):
        quamba.load_model(tmp_path, tokenizer=False)


@pytest.mark.parametrize("name,d_inner,nheads,n_layer", [("mamba2-130m", 1536, 24, 24),
                                                         ("mamba2-2.7b", 5120, 80, 64)])
def test_presets_have_the_published_mamba2_shapes(name, d_inner, nheads, n_layer):
    config = preset_config(name)
    assert (config.layer, config.d_inner, config.nheads) == ("Mamba2", d_inner, nheads)
    assert config.n_layer == n_layer
    assert (config.d_state, config.headdim, config.ngroups) == (128, 64, 1)
    assert config.padded_vocab_size == 50288
    ssm_cfg = config.to_mamba_ssm()["ssm_cfg"]  # what profile_mamba.py gives mamba-ssm's own model
    assert ssm_cfg["layer"] == "Mamba2" and ssm_cfg["d_state"] == 128 and ssm_cfg["headdim"] == 64
