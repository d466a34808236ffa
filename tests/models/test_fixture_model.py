"""The trained test models: tests/fixtures/tiny-mamba (written by scripts/train_tiny_mamba.py),
and what both it and tiny-mamba2 (tests/models/test_fixture_mamba2.py) must satisfy."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import quamba

MAX_FIXTURE_BYTES = 8_000_000
EVAL_WINDOWS = 2


@pytest.fixture(scope="module")
def report(tiny_model_dir) -> dict:
    return json.loads((tiny_model_dir / "training_report.json").read_text())


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return quamba.load_model(tiny_model_dir)


def test_loads_by_path_relative_to_the_repo_root(repo_root, monkeypatch, report):
    monkeypatch.chdir(repo_root)
    model, tokenizer = quamba.load_model("tests/fixtures/tiny-mamba")
    assert model.source["layout"] == "transformers"
    assert (model.config.d_model, model.config.n_layer, model.config.d_inner) == (192, 4, 384)
    assert model.config.padded_vocab_size == len(tokenizer) == report["config"]["vocab_size"] == 4096
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == 0
    assert tokenizer.convert_tokens_to_ids("<|padding|>") == 1


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_mamba2_dir"])
def trained_dir(request):
    """Each trained test LM: tiny-mamba (Mamba1) and tiny-mamba2."""
    return request.getfixturevalue(request.param)


def test_fixture_is_small(trained_dir):
    size = sum(f.stat().st_size for f in trained_dir.rglob("*") if f.is_file())
    assert size <= MAX_FIXTURE_BYTES


def test_generate_produces_text(trained_dir):
    model, tokenizer = quamba.load_model(trained_dir)
    prompt = tokenizer("The history of the city", return_tensors="pt")["input_ids"]
    output = model.generate(prompt, max_new_tokens=20)
    text = tokenizer.decode(output[0, prompt.shape[1]:], skip_special_tokens=True)
    assert text.strip()


def test_report_shows_the_model_beats_the_unigram_baseline(trained_dir):
    heldout = json.loads((trained_dir / "training_report.json").read_text())["heldout"]
    assert heldout["perplexity"] < heldout["unigram_add_one_perplexity"] / 2


def test_heldout_perplexity_is_below_the_unigram_baseline(loaded, report, heldout_windows):
    model, tokenizer = loaded
    windows = heldout_windows(tokenizer, EVAL_WINDOWS)
    with torch.inference_mode():
        logits = model(windows[:, :-1])
    nll = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())
    assert math.exp(nll.item()) < report["heldout"]["unigram_add_one_perplexity"]


def test_op_backends_names_every_op_the_model_runs(loaded):
    model, _ = loaded
    ran = model.op_backends()
    assert ran == {op: "torch" for op in ("causal_conv1d", "causal_conv1d_update", "rms_norm",
                                          "selective_scan", "selective_state_update")}
