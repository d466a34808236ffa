"""Perplexity of a text over windows of ``window`` tokens (default 2048).

The text is tokenized whole and every token is predicted exactly once, the first after the eos
token, exactly as lm-eval's ``loglikelihood_rolling`` does (:func:`quamba.eval.scoring.rolling_windows`):
the model reads ``window`` tokens per window, windows do not overlap, and the last, partial
window takes its context from the tokens before it instead of being dropped.
In a data-parallel run (torchrun) each rank scores every world_size-th batch of windows.

Texts: ``wikitext2`` (the wikitext-2-raw-v1 test split; from the task-data directory's
wikitext2_test_docs.jsonl when one is given, else from the Hub), or a .txt / .jsonl file.
Documents are joined with blank lines ("\\n\\n").
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm import tqdm

from quamba.errors import QuambaError
from quamba.eval import distributed
from quamba.eval.scoring import rolling_windows, score_continuations
from quamba.models.hub import check_token_ids

WIKITEXT2 = "wikitext2"
LOCAL_WIKITEXT2 = "wikitext2_test_docs.jsonl"
JSONL_TEXT_FIELDS = ("text", "page")
DEFAULT_WINDOW = 2048


def load_text(source: str, task_data=None) -> tuple[str, str]:
    """``(text, description of where it came from)`` for ``source``: ``wikitext2`` or a file."""
    if source == WIKITEXT2:
        local = Path(task_data).expanduser() / LOCAL_WIKITEXT2 if task_data else None
        if local is not None and local.is_file():
            return _read_jsonl(local), f"wikitext-2-raw-v1 test documents ({local})"
        return _hub_wikitext2(), "wikitext-2-raw-v1 test (Hub: wikitext)"
    path = Path(source).expanduser()
    if not path.is_file():
        raise QuambaError(f"perplexity text {source!r} is neither {WIKITEXT2!r} nor an existing file")
    if path.suffix == ".jsonl":
        return _read_jsonl(path), str(path)
    if path.suffix == ".txt":
        return path.read_text(encoding="utf-8"), str(path)
    raise QuambaError(f"perplexity text file {source!r} must end in .txt or .jsonl")


def _read_jsonl(path: Path) -> str:
    documents = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise QuambaError(f"{path}:{number} is not valid JSON") from None
        field = next((f for f in JSONL_TEXT_FIELDS if isinstance(record, dict) and f in record), None)
        if field is None:
            raise QuambaError(
                f"{path}:{number} has none of the text fields {', '.join(JSONL_TEXT_FIELDS)}")
        documents.append(record[field])
    if not documents:
        raise QuambaError(f"{path} holds no documents")
    return "\n\n".join(documents)


def _hub_wikitext2() -> str:
    import datasets
    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as exc:  # offline, unreachable or missing: datasets raises many types
        raise QuambaError(f"cannot load wikitext-2-raw-v1 from the Hub ({type(exc).__name__}); "
                          f"give a task-data directory holding {LOCAL_WIKITEXT2}") from None
    return "\n\n".join(rows["text"])


def perplexity(model, tokenizer, text: str, window: int = DEFAULT_WINDOW, batch_size: int = 8,
               progress: bool = True) -> dict:
    """Perplexity, bits per byte, and the counts behind them, of ``text`` under ``model``."""
    if window <= 0 or batch_size <= 0:
        raise QuambaError(f"window and batch_size must be positive, got {window} and {batch_size}")
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if not tokens:
        raise QuambaError("the text holds no tokens")
    check_token_ids(tokens, model.config.vocab_size, "the perplexity text")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    windows = rolling_windows(tokens, eos, window)
    starts = distributed.shard(list(range(0, len(windows), batch_size)))
    mine = {}
    for start in tqdm(starts, disable=not progress or distributed.rank() != 0, desc="perplexity"):
        batch = windows[start:start + batch_size]
        scores = score_continuations(model, batch, window, pad_id=eos)
        mine[start] = sum(score for score, _ in scores)
    nll = -_sum_in_order(distributed.all_gather_objects(mine))
    n_bytes = len(text.encode("utf-8"))
    return {"perplexity": math.exp(nll / len(tokens)), "bits_per_byte": nll / (n_bytes * math.log(2)),
            "nll": nll, "tokens": len(tokens), "bytes": n_bytes, "windows": len(windows),
            "window": window}


def _sum_in_order(per_rank: list[dict]) -> float:
    """The batches' log-probabilities, summed in batch order whichever rank scored them.

    Each rank scores whole batches, the same as a single process would, and the sum is taken in
    the single-process order, so the perplexity is that run's to the last bit (all-reducing each
    rank's partial sum would round differently)."""
    total = 0.0
    for _, logprob in sorted(item for part in per_rank for item in part.items()):
        total += logprob
    return total


def evaluate_perplexity(model, tokenizer, source: str = WIKITEXT2, task_data=None,
                        window: int = DEFAULT_WINDOW, batch_size: int = 8,
                        progress: bool = True) -> dict:
    """:func:`perplexity` of the text ``source`` names (see :func:`load_text`), with its origin."""
    text, origin = load_text(source, task_data)
    return {"dataset": source, "source": origin,
            **perplexity(model, tokenizer, text, window, batch_size, progress)}
