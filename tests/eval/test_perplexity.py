"""Perplexity: text sources, window counts, batching, and bits per byte."""
import json
import math

import pytest

from quamba.errors import QuambaError
from quamba.eval.perplexity import evaluate_perplexity, load_text, perplexity

TEXT = ("The quick brown fox jumps over the lazy dog. " * 12).strip()


def test_jsonl_documents_are_joined_with_blank_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"page": "first"}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    text, origin = load_text(str(path))
    assert text == "first\n\nsecond" and origin == str(path)


def test_txt_is_read_whole(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("line one\nline two\n")
    assert load_text(str(path))[0] == "line one\nline two\n"


def test_wikitext2_reads_the_task_data_copy(small_task_data):
    text, origin = load_text("wikitext2", small_task_data)
    first = json.loads((small_task_data / "wikitext2_test_docs.jsonl").read_text())["page"]
    assert text == first and "wikitext2_test_docs.jsonl" in origin


@pytest.mark.parametrize("content, suffix, message", [
    (None, ".txt", "neither"),
    ("x", ".csv", "must end in"),
    ('{"title": "no text"}\n', ".jsonl", "none of the text fields"),
    ("not json\n", ".jsonl", "not valid JSON"),
])
def test_bad_sources_are_one_line_errors(tmp_path, content, suffix, message):
    path = tmp_path / f"source{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(QuambaError, match=message) as caught:
        load_text(str(path))
    assert "\n" not in str(caught.value)


def test_counts_batching_and_bits_per_byte(model, tokenizer):
    one = perplexity(model, tokenizer, TEXT, window=16, batch_size=1, progress=False)
    many = perplexity(model, tokenizer, TEXT, window=16, batch_size=4, progress=False)
    tokens = len(tokenizer.encode(TEXT))
    assert one["tokens"] == many["tokens"] == tokens
    assert one["windows"] == math.ceil(tokens / 16)
    assert one["nll"] == pytest.approx(many["nll"], rel=1e-5)
    assert one["bits_per_byte"] == pytest.approx(one["nll"] / (len(TEXT.encode()) * math.log(2)))
    assert one["perplexity"] > 1


def test_evaluate_perplexity_on_a_file(model, tokenizer, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    result = evaluate_perplexity(model, tokenizer, str(path), window=32, batch_size=2, progress=False)
    assert result["dataset"] == str(path) and result["window"] == 32
    assert result["perplexity"] == pytest.approx(
        perplexity(model, tokenizer, TEXT, window=32, progress=False)["perplexity"], rel=1e-5)


def test_another_models_tokenizer_is_a_one_line_error(tokenizer):
    """GPT-NeoX ids (up to 50276) into a model of 64 tokens: named, not an IndexError."""
    from quamba.models.config import MambaConfig
    from quamba.models.mamba import MambaLMHeadModel
    small = MambaLMHeadModel(MambaConfig(d_model=16, n_layer=1, vocab_size=64)).eval()
    with pytest.raises(QuambaError, match=r"the perplexity text: token id \d+ is outside the "
                                          r"model's vocabulary of 64: the tokenizer is another"):
        perplexity(small, tokenizer, TEXT, window=16, progress=False)
