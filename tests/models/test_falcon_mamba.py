"""Falcon-Mamba (model_type falcon_mamba): quamba's Mamba1 LM with the norms of dt, B and C against
transformers' FalconMambaForCausalLM, loaded from the directory transformers' save_pretrained
writes; decoding against the full forward; configs quamba cannot honour refused by name."""
import json

import pytest
import torch
from transformers import FalconMambaConfig, FalconMambaForCausalLM

from quamba.errors import CheckpointError
from quamba.models import load_model, save_model

# odd sizes: d_inner 2·37, dt_rank 5, d_state 7, vocab 101; three layers
HF_CONFIG = dict(hidden_size=37, num_hidden_layers=3, vocab_size=101, state_size=7,
                 time_step_rank=5, conv_kernel=4, mixer_rms_eps=1e-5, tie_word_embeddings=False,
                 layer_norm_epsilon=1e-5)


def max_relative_error(actual, expected) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def random_ids(vocab: int, batch: int, seqlen: int, seed: int = 0):
    return torch.randint(0, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def random_falcon_mamba(seed: int = 0, **overrides) -> FalconMambaForCausalLM:
    """transformers' model with every weight random at a realistic scale (norm weights near 1)."""
    torch.manual_seed(seed)
    model = FalconMambaForCausalLM(FalconMambaConfig(**{**HF_CONFIG, **overrides})).eval()
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", "norm_f.weight")):
            param.copy_(1 + 0.1 * torch.randn_like(param))
        elif name.endswith(("A_log", ".D", "dt_proj.bias")):
            param.add_(0.1 * torch.randn_like(param))
        else:
            param.copy_(torch.randn_like(param) * (0.3 if "conv1d" in name else 0.05))
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = random_falcon_mamba()
    path = tmp_path_factory.mktemp("falcon") / "falcon-mamba"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def ours(hf_dir):
    return load_model(hf_dir[1], tokenizer=False)[0]


def test_the_directory_is_transformers_falcon_mamba(hf_dir, ours):
    raw = json.loads((hf_dir[1] / "config.json").read_text())
    assert raw["model_type"] == "falcon_mamba"
    assert ours.source["layout"] == "transformers"
    assert ours.config.mixer_rms_eps == 1e-5 and ours.config.d_inner == 74
    assert not ours.config.tie_embeddings


@pytest.mark.parametrize("batch, seqlen", [(1, 1), (2, 13)])
def test_logits_match_transformers(hf_dir, ours, batch, seqlen):
    hf_model, _ = hf_dir
    ids = random_ids(HF_CONFIG["vocab_size"], batch, seqlen)
    with torch.no_grad():
        expected = hf_model(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    assert max_relative_error(got, expected) <= 1e-4


def test_the_norms_matter(hf_dir, ours):
    """Without its norms the same weights give other logits: the test above checks them."""
    from copy import deepcopy
    plain = deepcopy(ours)
    for mixer in plain.mixers():
        mixer.mixer_rms_eps = None
    ids = random_ids(HF_CONFIG["vocab_size"], 1, 13)
    with torch.no_grad():
        assert max_relative_error(plain(ids), ours(ids)) > 1e-2


@pytest.mark.parametrize("prefill_len", [1, 6])
def test_decode_steps_reproduce_full_forward(ours, prefill_len):
    ids = random_ids(HF_CONFIG["vocab_size"], 2, 11, seed=1)
    with torch.no_grad():
        full = ours(ids)
        cache = ours.allocate_cache(2)
        prefill = ours(ids[:, :prefill_len], cache=cache)
        assert max_relative_error(prefill, full[:, :prefill_len]) <= 1e-5
        for t in range(prefill_len, ids.shape[1]):
            step = ours(ids[:, t:t + 1], cache=cache)
            assert max_relative_error(step[:, 0], full[:, t]) <= 1e-4, f"position {t}"


def test_greedy_generate_matches_transformers(hf_dir, ours):
    hf_model, _ = hf_dir
    prompt = random_ids(HF_CONFIG["vocab_size"], 2, 5, seed=2)
    got = ours.generate(prompt, max_new_tokens=8)
    expected = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, expected)


def test_saved_by_quamba_loads_in_transformers(hf_dir, ours, tmp_path):
    hf_model, _ = hf_dir
    path = save_model(ours, tmp_path / "resaved")
    again = FalconMambaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = random_ids(HF_CONFIG["vocab_size"], 1, 9, seed=3)
    with torch.no_grad():
        assert max_relative_error(again(ids).logits, hf_model(ids).logits) <= 1e-6


def test_the_mamba_ssm_layout_is_refused(ours, tmp_path):
    with pytest.raises(CheckpointError, match="mixer_rms_eps"):
        save_model(ours, tmp_path / "ssm", layout="mamba_ssm")
    assert not (tmp_path / "ssm").exists()


def test_intermediate_size_sets_d_inner_as_in_transformers(hf_dir, tmp_path):
    """tiiuae/falcon-mamba-7b's config says expand 16 and intermediate_size 8192 (2 × 4096):
    transformers builds d_inner from intermediate_size, and so does quamba."""
    _, path = hf_dir
    raw = json.loads((path / "config.json").read_text())
    raw["expand"] = 16
    (path / "config.json").write_text(json.dumps(raw))
    try:
        model, _ = load_model(path, tokenizer=False)
    finally:
        raw["expand"] = 2
        (path / "config.json").write_text(json.dumps(raw))
    assert model.config.d_inner == raw["intermediate_size"] == 74


@pytest.mark.parametrize("change, expected", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"intermediate_size": 80}, "intermediate_size 80 is not a positive multiple of hidden_size"),
    ({"mixer_rms_eps": None}, "mixer_rms_eps is null"),
    ({"mixer_rms_eps": -1.0}, "mixer_rms_eps must be a positive number"),
    ({"model_type": "falcon_mamba2"}, "model_type is 'falcon_mamba2'"),
])
def test_options_quamba_cannot_honour_are_refused_by_name(hf_dir, tmp_path, change, expected):
    _, path = hf_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    raw = {**json.loads((path / "config.json").read_text()), **change}
    (bad / "config.json").write_text(json.dumps(raw))
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError) as caught:
        load_model(bad, tokenizer=False)
    message = str(caught.value)
    assert expected in message and "\n" not in message
