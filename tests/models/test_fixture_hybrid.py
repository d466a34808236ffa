"""The trained hybrid test model in tests/fixtures/tiny-hybrid (written by
scripts/train_tiny_hybrid.py): a Nemotron-H with Mamba2, attention and MLP layers, as
transformers' NemotronHForCausalLM.save_pretrained writes it, with the tokenizer of
tests/fixtures/tiny-mamba."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import quamba
from quamba.models.nemotron_h import NemotronHLM

TINY_HYBRID_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-hybrid"


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((TINY_HYBRID_DIR / "training_report.json").read_text())


@pytest.fixture(scope="module")
def loaded():
    return quamba.load_model(TINY_HYBRID_DIR)


def test_loads_by_path_relative_to_the_repo_root(repo_root, monkeypatch, report):
    monkeypatch.chdir(repo_root)
    model, _ = quamba.load_model("tests/fixtures/tiny-hybrid", tokenizer=False)
    assert isinstance(model, NemotronHLM) and model.source["layout"] == "transformers"
    assert model.config.pattern == "M*M-M-"  # Mamba2, attention and MLP layers
    assert report["config"].items() <= model.config.to_dict().items()  # fields added later aside


def test_files_are_those_of_save_pretrained(report):
    names = {f.name for f in TINY_HYBRID_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((TINY_HYBRID_DIR / "config.json").read_text())
    assert config["model_type"] == "nemotron_h"
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert report["heldout"]["first_windows"]["transformers_logits_rel_error"] < 1e-4


def test_shares_the_tokenizer_of_tiny_mamba(tiny_model_dir):
    assert ((TINY_HYBRID_DIR / "tokenizer.json").read_bytes()
            == (tiny_model_dir / "tokenizer.json").read_bytes())


def test_heldout_perplexity_of_the_first_windows_matches_the_report(loaded, report,
                                                                    heldout_windows):
    model, tokenizer = loaded
    first = report["heldout"]["first_windows"]
    windows = heldout_windows(tokenizer, first["windows"])
    with torch.inference_mode():
        logits = model(windows[:, :-1])
    nll = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())
    perplexity = math.exp(nll.item())
    assert perplexity == pytest.approx(first["perplexity"], rel=1e-3)
    assert perplexity < report["heldout"]["unigram_add_one_perplexity"] / 2


def test_decode_steps_follow_the_prefill(loaded, heldout_windows):
    model, tokenizer = loaded
    tokens = heldout_windows(tokenizer, 1)[:, :80]
    with torch.inference_mode():
        full = model(tokens)
        cache = model.allocate_cache(1)
        model(tokens[:, :70], cache=cache)
        steps = torch.cat([model(tokens[:, i:i + 1], cache=cache) for i in range(70, 80)], 1)
    error = (steps - full[:, 70:]).norm() / full[:, 70:].norm()
    assert error < 1e-5
