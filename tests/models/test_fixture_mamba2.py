"""The trained Mamba2 test model in tests/fixtures/tiny-mamba2 (written by
scripts/train_tiny_mamba2.py): mamba_ssm's Hub layout, the tokenizer of tests/fixtures/tiny-mamba
(size, generation and the report's baseline: tests/models/test_fixture_model.py)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import quamba


@pytest.fixture(scope="module")
def report(tiny_mamba2_dir) -> dict:
    return json.loads((tiny_mamba2_dir / "training_report.json").read_text())


@pytest.fixture(scope="module")
def loaded(tiny_mamba2_dir):
    return quamba.load_model(tiny_mamba2_dir)


def test_loads_by_path_relative_to_the_repo_root(repo_root, monkeypatch, report):
    monkeypatch.chdir(repo_root)
    model, _ = quamba.load_model("tests/fixtures/tiny-mamba2", tokenizer=False)
    assert model.source["layout"] == "mamba_ssm"
    assert model.config.layer == "Mamba2"
    assert report["config"].items() <= model.config.to_dict().items()  # fields added later aside
    assert (model.config.nheads, model.config.headdim, model.config.ngroups) == (8, 48, 2)


def test_files_are_those_of_a_mamba_ssm_checkpoint(tiny_mamba2_dir):
    names = {f.name for f in tiny_mamba2_dir.iterdir()}
    assert {"config.json", "pytorch_model.bin"} <= names
    assert not names & {"model.safetensors", "model.safetensors.index.json"}
    config = json.loads((tiny_mamba2_dir / "config.json").read_text())
    assert config["ssm_cfg"]["layer"] == "Mamba2"


def test_shares_the_tokenizer_of_tiny_mamba(tiny_mamba2_dir, tiny_model_dir):
    assert ((tiny_mamba2_dir / "tokenizer.json").read_bytes()
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


def test_op_backends_names_every_op_the_model_runs(loaded):
    model, _ = loaded
    ops = ("causal_conv1d", "causal_conv1d_update", "gated_rms_norm", "rms_norm", "ssd_scan",
           "ssd_state_update")
    assert model.op_backends() == {op: "torch" for op in ops}
