import hashlib
import json

import datasets
import pytest
import torch

from quamba.calibrate import CalibrationError, load_calibration_set

NUMBERED_DOCS = [f"document number {i}." for i in range(300)]


def document_order(calib, tokenizer) -> list[int]:
    """Indices of the NUMBERED_DOCS in the order the calibration set holds them (whole ones)."""
    pieces = tokenizer.decode(calib.tokens.flatten()).split(tokenizer.eos_token)[:-1]
    return [NUMBERED_DOCS.index(piece) for piece in pieces]


def test_shuffle_is_seeded_and_really_shuffles(tokenizer):
    first = load_calibration_set(NUMBERED_DOCS, tokenizer, num_samples=4, seqlen=256, seed=0)
    again = load_calibration_set(NUMBERED_DOCS, tokenizer, num_samples=4, seqlen=256, seed=0)
    other = load_calibration_set(NUMBERED_DOCS, tokenizer, num_samples=4, seqlen=256, seed=1)
    order, other_order = document_order(first, tokenizer), document_order(other, tokenizer)
    assert torch.equal(first.tokens, again.tokens) and first.content_hash == again.content_hash
    assert first.content_hash != other.content_hash and order != other_order
    assert len(order) > 100 and len(set(order)) == len(order)
    assert order != sorted(order)
    assert max(order) > len(order) + 50  # drawn from the whole list, not its head


def test_set_fields_and_hash(tokenizer, c4_sample):
    calib = load_calibration_set(c4_sample, tokenizer, num_samples=6, seqlen=64, seed=3)
    assert calib.tokens.shape == (6, 64) and calib.tokens.dtype == torch.int64
    assert (calib.num_samples, calib.seqlen, calib.seed, calib.source) == (6, 64, 3, str(c4_sample))
    expected = hashlib.sha256(calib.tokens.numpy().astype("<i8").tobytes()).hexdigest()
    assert calib.content_hash == expected
    assert (calib.tokens == tokenizer.eos_token_id).any()  # documents are joined with eos


def test_jsonl_source_is_shuffled(tokenizer, c4_sample):
    calib = load_calibration_set(str(c4_sample), tokenizer, num_samples=4, seqlen=64, seed=0)
    first_doc = json.loads(c4_sample.read_text().splitlines()[0])["text"]
    head = tokenizer(first_doc, add_special_tokens=False)["input_ids"][:64]
    assert calib.tokens[0].tolist() != head


def test_txt_source_splits_on_blank_lines(tokenizer, tmp_path, shakespeare):
    path = tmp_path / "docs.txt"
    path.write_text("alpha one\nstill alpha\n\nbeta two\n \n\n\ngamma three\n")
    calib = load_calibration_set(path, tokenizer, num_samples=1, seqlen=12, seed=0)
    pieces = tokenizer.decode(calib.tokens[0]).split(tokenizer.eos_token)
    assert sorted(pieces[:3]) == ["alpha one\nstill alpha", "beta two", "gamma three"]
    assert load_calibration_set(shakespeare, tokenizer, 8, 128).tokens.shape == (8, 128)


def test_jsonl_field_choice(tokenizer, tmp_path):
    rows = [{"id": 1, "title": "TITLE", "text": "body one"}, {"id": 2, "page": "page two"},
            {"id": 3}, {"text": None, "page": "page three"}]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    calib = load_calibration_set(path, tokenizer, num_samples=1, seqlen=9, seed=0)
    pieces = tokenizer.decode(calib.tokens[0]).split(tokenizer.eos_token)
    assert sorted(pieces[:3]) == ["body one", "page three", "page two"]


def test_list_dataset_and_stream_agree(tokenizer):
    """The three in-memory source types shuffle the same documents the same way (a short stream
    is pooled whole)."""
    dataset = datasets.Dataset.from_dict({"id": list(range(300)), "text": NUMBERED_DOCS})
    results = [load_calibration_set(source, tokenizer, num_samples=2, seqlen=256, seed=5)
               for source in (NUMBERED_DOCS, dataset, dataset.to_iterable_dataset())]
    assert results[0].content_hash == results[1].content_hash == results[2].content_hash
    assert "Dataset" in results[1].source and "IterableDataset" in results[2].source


def test_stream_is_not_read_to_the_end(tokenizer):
    read = []

    def documents():
        for i in range(100_000):
            read.append(i)
            yield {"text": f"streamed document {i}"}

    stream = datasets.IterableDataset.from_generator(documents)
    calib = load_calibration_set(stream, tokenizer, num_samples=2, seqlen=32, seed=0)
    assert calib.tokens.shape == (2, 32)
    assert len(read) < 1000


@pytest.mark.parametrize("source, message", [
    ("nobody/no-such-dataset", "cannot open calibration dataset nobody/no-such-dataset:validation"),
    (None, "monology/pile-uncopyrighted:validation"),
    ("org/name:config:split:extra", "not a dataset id"),
    ("./missing.txt", "does not exist"),
    ("missing.jsonl", "does not exist"),
    (42, "unknown calibration source of type int"),
    (["text", 3], "unknown calibration source of type list"),
])
def test_bad_sources(tokenizer, source, message):
    with pytest.raises(CalibrationError, match=message) as error:
        load_calibration_set(source, tokenizer, num_samples=2, seqlen=8)
    assert "\n" not in str(error.value)


def test_bad_files(tokenizer, tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    for path, message in [(tmp_path / "data.csv", "unsupported type"), (tmp_path, "is a directory"),
                          (tmp_path / "bad.jsonl", "line 2 is not valid JSON")]:
        with pytest.raises(CalibrationError, match=message):
            load_calibration_set(path, tokenizer, num_samples=1, seqlen=4)


def test_too_little_text_says_how_much_there_was(tokenizer):
    docs = ["one two three", "four five"]
    available = sum(len(tokenizer(doc, add_special_tokens=False)["input_ids"]) + 1 for doc in docs)
    with pytest.raises(CalibrationError, match=rf"has only {available} tokens.*need 64$"):
        load_calibration_set(docs, tokenizer, num_samples=2, seqlen=32)


def test_bad_request_and_tokenizer(tokenizer):
    with pytest.raises(CalibrationError, match="num_samples must be a positive integer"):
        load_calibration_set(NUMBERED_DOCS, tokenizer, num_samples=0)
    with pytest.raises(CalibrationError, match="no eos token"):
        load_calibration_set(NUMBERED_DOCS, object(), num_samples=1, seqlen=8)
