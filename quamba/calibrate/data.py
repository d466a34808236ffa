"""The calibration set: ``num_samples`` windows of ``seqlen`` tokens cut from shuffled text.

Documents are shuffled with a seeded ``torch.Generator`` (the public Quamba code never shuffled),
tokenized without special tokens, joined with the eos token after each document, and the joined
stream is cut into consecutive windows. The same source, tokenizer and seed give bit-identical
tokens; ``content_hash`` records them.

Sources:

* a Hugging Face dataset id, streamed: ``"id"`` (split ``validation``), ``"id:split"`` or
  ``"id:config:split"``. A stream is never read to its end: the first documents holding
  ``STREAM_POOL_FACTOR`` times the tokens needed form a pool, and the pool is shuffled.
* a ``datasets.Dataset`` (shuffled whole) or ``datasets.IterableDataset`` (pooled as a stream);
* a list of strings;
* a local ``.txt`` file (documents separated by blank lines) or ``.jsonl`` file (one document a
  line: the field ``text``, else the line's first string field).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quamba.calibrate.errors import CalibrationError

DEFAULT_SOURCE = "monology/pile-uncopyrighted"
DEFAULT_SPLIT = "validation"
STREAM_POOL_FACTOR = 4
LOCAL_SUFFIXES = (".txt", ".jsonl")
_TOKENIZE_CHUNK = 64  # documents per tokenizer call: batched calls are much faster
_BLANK_LINES = re.compile(r"\n\s*\n")


@dataclass
class CalibrationSet:
    tokens: torch.Tensor  # int64 [num_samples, seqlen]
    source: str
    num_samples: int
    seqlen: int
    seed: int
    content_hash: str  # sha256 hex of the tokens as little-endian int64


def load_calibration_set(source, tokenizer, num_samples: int = 512, seqlen: int = 512,
                         seed: int = 0) -> CalibrationSet:
    """Build the calibration set from ``source`` (see the module docstring; None means
    ``DEFAULT_SOURCE``). Raises :class:`CalibrationError` when the source is unknown, missing,
    unreachable, or holds fewer tokens than ``num_samples * seqlen``."""
    _check_positive(num_samples=num_samples, seqlen=seqlen)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        raise CalibrationError("the tokenizer has no eos token to join documents with")
    needed = num_samples * seqlen
    label, documents = _shuffled_documents(source, tokenizer, needed, seed)
    joined = _join_documents(documents, eos_id, needed)
    if len(joined) < needed:
        raise CalibrationError(
            f"calibration source {label} has only {len(joined)} tokens (eos between documents "
            f"included); {num_samples} samples x {seqlen} tokens need {needed}")
    tokens = torch.tensor(joined, dtype=torch.int64).view(num_samples, seqlen)
    return CalibrationSet(tokens, label, num_samples, seqlen, seed, content_hash(tokens))


def content_hash(tokens: torch.Tensor) -> str:
    data = tokens.detach().cpu().to(torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()


def _check_positive(**values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CalibrationError(f"{name} must be a positive integer, got {value!r}")


def _shuffled_documents(source, tokenizer, needed: int, seed: int):
    """(label, iterator over the token ids of each document in shuffled order)."""
    generator = torch.Generator().manual_seed(seed)
    if source is None:
        source = DEFAULT_SOURCE
    if isinstance(source, (list, tuple)) and all(isinstance(text, str) for text in source):
        texts = source
        return f"list of {len(texts)} texts", _permuted(len(texts), lambda rows: [texts[i] for i in rows],
                                                         tokenizer, generator)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and _looks_local(source)):
        texts = _read_local(str(source))
        return str(source), _permuted(len(texts), lambda rows: [texts[i] for i in rows], tokenizer,
                                      generator)
    import datasets  # only for Hub ids and dataset objects: local sources work without it
    if isinstance(source, datasets.IterableDataset):
        label = "datasets.IterableDataset"
        return label, _pooled(_row_texts(source), tokenizer, needed, generator, label)
    if isinstance(source, datasets.Dataset):
        column = _text_column(source)
        label = f"datasets.Dataset ({len(source)} rows, column {column!r})"
        text_only = source.select_columns([column])
        return label, _permuted(len(source), lambda rows: text_only[rows][column], tokenizer,
                                generator)
    if isinstance(source, str):
        label, stream = _open_hub_stream(source)
        return label, _pooled(_row_texts(stream), tokenizer, needed, generator, label)
    raise CalibrationError(
        f"unknown calibration source of type {type(source).__name__}: give a dataset id, a "
        ".txt/.jsonl path, a list of strings or a datasets.Dataset")


def _permuted(count: int, fetch: Callable[[list[int]], list], tokenizer, generator):
    """Token ids of documents ``fetch``ed in a seeded random order, tokenized lazily so a large
    source is only read as far as needed."""
    order = torch.randperm(count, generator=generator).tolist()
    texts = (text for chunk in _chunks(order, _TOKENIZE_CHUNK) for text in fetch(chunk))
    return _tokenized(texts, tokenizer)


def _pooled(texts: Iterable, tokenizer, needed: int, generator, label: str):
    """Shuffle a stream within its first documents that hold ``STREAM_POOL_FACTOR * needed``
    tokens (or all of it, when shorter)."""
    pool, pooled_tokens = [], 0
    try:
        for doc in _tokenized(texts, tokenizer):
            pool.append(doc)
            pooled_tokens += len(doc) + 1
            if pooled_tokens >= STREAM_POOL_FACTOR * needed:
                break
    except Exception as exc:  # a stream can fail mid-way in many ways (network, decoding)
        raise CalibrationError(f"reading calibration source {label} failed: {_first_line(exc)}") from None
    return (pool[i] for i in torch.randperm(len(pool), generator=generator).tolist())


def _tokenized(texts: Iterable, tokenizer) -> Iterator[list[int]]:
    non_blank = (text for text in texts if text and not text.isspace())
    for chunk in _chunks(non_blank, _TOKENIZE_CHUNK):
        yield from tokenizer(chunk, add_special_tokens=False)["input_ids"]


def _join_documents(documents: Iterable[list[int]], eos_id: int, needed: int) -> list[int]:
    """Documents joined, each followed by eos, cut at ``needed`` tokens (shorter if exhausted)."""
    joined = []
    for doc in documents:
        joined.extend(doc)
        joined.append(eos_id)
        if len(joined) >= needed:
            return joined[:needed]
    return joined


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def _text_column(dataset) -> str:
    string_columns = [name for name, feature in dataset.features.items()
                      if getattr(feature, "dtype", None) in ("string", "large_string")]
    if not string_columns:
        raise CalibrationError(f"the dataset has no string column (columns: {dataset.column_names})")
    return "text" if "text" in string_columns else string_columns[0]


def _row_text(row: dict):
    """The field ``text`` if it is a string, else the row's first string field (None if none)."""
    if isinstance(row.get("text"), str):
        return row["text"]
    return next((value for value in row.values() if isinstance(value, str)), None)


def _row_texts(rows: Iterable[dict]) -> Iterator:
    return (_row_text(row) for row in rows)


def _looks_local(source: str) -> bool:
    """A path that exists, or a string that can only be meant as one (a path prefix or a text
    file suffix); anything else is taken for a dataset id."""
    return (os.path.exists(os.path.expanduser(source)) or source.startswith(("/", ".", "~"))
            or source.endswith(LOCAL_SUFFIXES + (".json",)))


def _read_local(source: str) -> list[str]:
    path = Path(os.path.expanduser(source))
    if not path.exists():
        raise CalibrationError(f"calibration file {source!r} does not exist")
    if path.is_dir():
        raise CalibrationError(f"calibration source {source!r} is a directory; give a .txt or .jsonl file")
    if path.suffix not in LOCAL_SUFFIXES:
        raise CalibrationError(f"calibration file {source!r} has an unsupported type; use .txt or .jsonl")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"calibration file {source!r} is not UTF-8 text: {exc.reason}") from None
    if path.suffix == ".txt":
        return [doc.strip() for doc in _BLANK_LINES.split(text)]
    return _jsonl_texts(text, source)


def _jsonl_texts(text: str, source: str) -> list[str]:
    texts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{source} line {number} is not valid JSON: {exc.msg}") from None
        if isinstance(row, dict) and (row_text := _row_text(row)) is not None:
            texts.append(row_text)
    return texts


def _open_hub_stream(spec: str):
    """(label, streamed split) for ``id``, ``id:split`` or ``id:config:split``."""
    import datasets
    parts = spec.split(":")
    if len(parts) > 3 or not all(parts):
        raise CalibrationError(
            f"calibration source {spec!r} is not a dataset id of the form id[:split] or id:config:split")
    if len(parts) == 1:
        dataset_id, config, split = parts[0], None, DEFAULT_SPLIT
    elif len(parts) == 2:
        (dataset_id, split), config = parts, None
    else:
        dataset_id, config, split = parts
    label = f"{dataset_id}:{config}:{split}" if config else f"{dataset_id}:{split}"
    try:
        return label, datasets.load_dataset(dataset_id, config, split=split, streaming=True)
    except Exception as exc:  # datasets raises many types: offline, not found, bad split, auth
        raise CalibrationError(f"cannot open calibration dataset {label}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
