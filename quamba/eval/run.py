"""Evaluation runs: lm-eval tasks and perplexity on a prepared model (or the top-1 accuracy of a
Vision Mamba classifier, quamba.eval.images), recorded as one JSON file.

:func:`evaluate_zero_shot` runs lm-eval tasks through the quamba adapter and keeps, besides
lm-eval's metrics with their standard errors, each document's 0/1 correctness per metric, so
two runs (say two SSM modes) can be compared pairwise on the same documents.
:func:`execute_run` is what ``main.py`` does: prepare the model, run the evaluations asked for,
and write one JSON file (:func:`write_run_json`).
"""
from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from quamba.errors import QuambaError
from quamba.utils.io import atomic_write_text, check_directory_target
from quamba.version import __version__

log = logging.getLogger("quamba")

DEFAULT_TASKS = ("lambada_openai", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")
TESTING_LIMIT = 100


def evaluate_zero_shot(model, tokenizer, tasks, task_data=None, limit: int | None = None,
                       num_fewshot: int = 0, batch_size: int = 16, max_length: int = 2048,
                       seed: int = 0, bootstrap_iters: int = 100000) -> dict:
    """Run lm-eval ``tasks`` (offline from ``task_data`` when given) on ``model``.

    Returns lm-eval's ``results`` (keys like ``results["piqa"]["acc,none"]`` and
    ``"acc_stderr,none"``), sample counts, task versions and data sources, and ``per_sample``:
    per task, the document ids and, for every metric whose per-document values are 0/1, those
    values in the same order.
    """
    import lm_eval

    from quamba.eval.lm import QuambaLM
    from quamba.eval.tasks import check_task_names, task_manager

    names = check_task_names(tasks, task_data)
    adapter = QuambaLM(model=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    output = lm_eval.simple_evaluate(
        model=adapter, tasks=names, num_fewshot=num_fewshot, limit=limit,
        task_manager=task_manager(task_data), log_samples=True, bootstrap_iters=bootstrap_iters,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    if output is None:  # a data-parallel run's rank other than 0
        return None
    return {
        "results": output["results"],
        "n_samples": output["n-samples"],
        "versions": output["versions"],
        "num_fewshot": num_fewshot,
        "limit": limit,
        "task_data": None if task_data is None else str(task_data),
        "task_sources": {task: _task_source(config) for task, config in output["configs"].items()},
        "lm_eval_version": output.get("lm_eval_version"),
        "per_sample": per_sample_correctness(output["samples"]),
    }


def _task_source(config: dict) -> dict:
    kwargs = config.get("dataset_kwargs") or {}
    return {"dataset_path": config.get("dataset_path"), "dataset_name": config.get("dataset_name"),
            "data_files": kwargs.get("data_files"),
            "split": config.get("test_split") or config.get("validation_split"),
            "note": (config.get("metadata") or {}).get("note")}


def per_sample_correctness(samples: dict) -> dict:
    """Per task: ``doc_id`` and, per 0/1 metric (keyed ``metric,filter`` as lm-eval's results),
    each document's value, sorted by document id. Where every document's responses are
    log-likelihoods (multiple choice, lambada), also ``loglikelihoods``: each document's, one
    per choice, and, where the gold answer is a choice's index, ``gold``: what two runs'
    per-document agreement is explained by (quamba.eval.agreement)."""
    table = {}
    for task, rows in samples.items():
        rows = sorted(rows, key=lambda row: (row["doc_id"], row.get("filter", "none")))
        columns = {"doc_id": sorted({row["doc_id"] for row in rows})}
        for row in rows:
            for metric in row.get("metrics", []):
                columns.setdefault(f"{metric},{row.get('filter', 'none')}", []).append(row.get(metric))
        table[task] = {key: [int(v) for v in values] if key != "doc_id" else values
                       for key, values in columns.items() if key == "doc_id" or _all_binary(values)}
        table[task].update(_loglikelihood_columns([r for r in rows if r.get("filter", "none") == "none"]))
    return table


def _loglikelihood_columns(rows: list[dict]) -> dict:
    """``loglikelihoods`` (and ``gold``) of one task's unfiltered rows, or {} where a response is
    not a (log-likelihood, is_greedy) pair (generation tasks)."""
    responses = [row.get("filtered_resps") for row in rows]
    if not rows or not all(isinstance(r, (list, tuple)) and r and all(
            isinstance(choice, (list, tuple)) and len(choice) == 2 for choice in r) for r in responses):
        return {}
    columns = {"loglikelihoods": [[float(choice[0]) for choice in r] for r in responses]}
    golds = [row.get("target") for row in rows]
    if all(isinstance(gold, int) and not isinstance(gold, bool) for gold in golds):
        columns["gold"] = golds
    return columns


def _all_binary(values) -> bool:
    return all(isinstance(v, (bool, int, float)) and v in (0, 1) for v in values)


def summary_lines(results: dict) -> list[str]:
    """One line per task: each metric with its standard error."""
    lines = []
    for task, metrics in results.items():
        parts = []
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            shown = f"{metric} {value:.4f}"
            parts.append(shown + (f" ± {stderr:.4f}" if isinstance(stderr, float) else ""))
        lines.append(f"{task}: {', '.join(parts)}")
    return lines


# --- run records -------------------------------------------------------------------------------

def run_json_path(log_dir, model_name: str) -> Path:
    """A new file name under ``log_dir``: model, UTC time and a random suffix."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(model_name).rstrip("/")).name) or "model"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(log_dir) / f"{slug}-{stamp}-{uuid.uuid4().hex[:8]}.json"


def write_run_json(path, payload: dict) -> Path:
    """Write ``payload`` with the quamba version, git state and time as one new JSON file.

    The write is atomic; an existing file is never appended to or replaced. Non-finite floats
    become null, so the file is strict JSON."""
    path = Path(path)
    if path.exists():
        raise QuambaError(f"run file {path} already exists; each run writes a new file")
    record = {"quamba_version": __version__, "git": git_state(),
              "written_at": datetime.now(timezone.utc).isoformat(), **payload}
    text = json.dumps(_plain(record), indent=2, allow_nan=False)
    return atomic_write_text(path, text + "\n")


def git_state() -> dict | None:
    """The commit of the quamba checkout and whether it has local changes; None outside git."""
    repo = Path(__file__).resolve().parent
    try:
        commit = _git(repo, "rev-parse", "HEAD")
        dirty = bool(_git(repo, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          timeout=10, check=True)
    return done.stdout.strip()


def _plain(value):
    """``value`` as JSON-ready data: numpy and torch scalars unwrapped, non-finite floats None."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(item) for item in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return _plain(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


# --- a whole run (what main.py does) ----------------------------------------------------------

@dataclass
class EvalPlan:
    """The evaluations of one run. ``few_shot``: the number of shots of a few-shot run (None:
    no few-shot run). ``limit``: documents per task (None: all)."""

    zero_shot: bool = False
    few_shot: int | None = None
    tasks: tuple[str, ...] = DEFAULT_TASKS
    limit: int | None = None
    perplexity: bool = False
    ppl_dataset: str = "wikitext2"
    ppl_window: int = 2048
    batch_size: int = 16
    task_data: str | None = None
    log_dir: str = "logs"
    seed: int = 0
    image_set: str | None = None  # top-1 accuracy of a Vision Mamba classifier on this set

    def check(self) -> None:
        """Fail on bad options before any model is loaded."""
        if self.batch_size <= 0 or self.ppl_window <= 0:
            raise QuambaError("batch_size and ppl_window must be positive")
        if self.few_shot is not None and self.few_shot < 0:
            raise QuambaError(f"the number of few-shot examples must be >= 0, got {self.few_shot}")
        if self.limit is not None and self.limit <= 0:
            raise QuambaError(f"limit must be positive, got {self.limit}")
        if self.zero_shot or self.few_shot is not None:
            from quamba.eval.tasks import check_task_names
            check_task_names(self.tasks, self.task_data)
        if self.perplexity and self.ppl_dataset != "wikitext2" and not Path(self.ppl_dataset).is_file():
            raise QuambaError(
                f"perplexity dataset {self.ppl_dataset!r} is neither wikitext2 nor an existing file")
        if self.image_set is not None and self.runs_language_tasks:
            raise QuambaError("image classification and language tasks need different models: run "
                              "them separately")
        if self.image_set not in (None, "digits") and not Path(self.image_set).is_dir():
            raise QuambaError(f"image set {self.image_set!r} is neither digits nor a directory")
        if self.runs_anything:
            check_directory_target(self.log_dir, "--log_dir")

    @property
    def runs_language_tasks(self) -> bool:
        return self.zero_shot or self.few_shot is not None or self.perplexity

    @property
    def runs_anything(self) -> bool:
        return self.runs_language_tasks or self.image_set is not None


def check_model_fits(model, plan: EvalPlan) -> None:
    """Language tasks need a language model, image classification a Vision Mamba classifier."""
    from quamba.models.vision import VisionMamba
    vision = isinstance(model, VisionMamba)
    if vision and plan.runs_language_tasks:
        raise QuambaError("this is a Vision Mamba classifier: evaluate it with --eval_image, not "
                          "language tasks")
    if plan.image_set is not None and not vision:
        raise QuambaError("--eval_image needs a Vision Mamba classifier; this is a language model")


def execute_run(request, plan: EvalPlan,
                config: dict | None = None) -> tuple[dict | None, Path | None]:
    """Prepare the model ``request`` asks for (:mod:`quamba.cli_support`), run ``plan``, and
    write the run file when anything was evaluated. Returns ``(record, path or None)``.

    Launched by torchrun, every rank evaluates its share (:mod:`quamba.eval.distributed`) and
    rank 0 alone writes the record; the other ranks return ``(None, None)``."""
    from quamba.cli_support import check_request, image_calibration_default
    from quamba.eval import distributed

    plan.check()
    check_request(request)
    request = replace(request, device=distributed.local_device(request.device))
    request = image_calibration_default(request, plan.image_set)
    with distributed.process_group(request.device):
        record, name = _evaluate(request, plan, config)
        if distributed.rank() != 0:
            return None, None
    if not plan.runs_anything:
        return record, None
    return record, write_run_json(run_json_path(plan.log_dir, name), record)


def _check_data_parallel(request, plan: EvalPlan, world_size: int) -> None:
    if world_size == 1:
        return
    if request.quantize and not request.pretrained_dir:
        raise QuambaError("a data-parallel --quantize needs --pretrained_dir: rank 0 calibrates "
                          "once and saves the model there, the other ranks load it")
    if plan.image_set is not None:
        raise QuambaError("--eval_image runs in one process; start it without torchrun")
    if plan.few_shot is not None:
        log.warning("lm-eval samples each rank's few-shot examples in its own order, so the "
                    "prompts of a data-parallel few-shot run differ from a single process's")


def _evaluate(request, plan: EvalPlan, config: dict | None) -> tuple[dict, str]:
    """The run record of ``plan`` on the model of ``request``, and the model's name."""
    from quamba.cli_support import prepare_model
    from quamba.eval import distributed
    from quamba.eval.perplexity import evaluate_perplexity

    _check_data_parallel(request, plan, distributed.world_size())
    torch.manual_seed(plan.seed)
    started = time.perf_counter()
    if request.quantize:
        prepared = distributed.rank0_first(lambda: prepare_model(request))
    else:
        prepared = prepare_model(request)
    check_model_fits(prepared.model, plan)
    log.info("%s", prepared.summary())
    timings = {"prepare_model_s": time.perf_counter() - started}
    record = {"config": {"model_request": asdict(request), "plan": asdict(plan), **(config or {})},
              "world_size": distributed.world_size(), "model": prepared.to_dict(),
              "timings": timings}
    if plan.limit is not None:
        log.warning("each task is limited to %d documents: standard errors are large (about 5 "
                    "points at 100), so small differences mean nothing", plan.limit)
    shots = ([("zero_shot", 0)] if plan.zero_shot else []) + (
        [("few_shot", plan.few_shot)] if plan.few_shot is not None else [])
    for key, num_fewshot in shots:
        began = time.perf_counter()
        record[key] = evaluate_zero_shot(prepared.model, prepared.tokenizer, plan.tasks, plan.task_data,
                                         plan.limit, num_fewshot, plan.batch_size, seed=plan.seed)
        timings[f"{key}_s"] = time.perf_counter() - began
    if plan.perplexity:
        began = time.perf_counter()
        record["perplexity"] = evaluate_perplexity(prepared.model, prepared.tokenizer, plan.ppl_dataset,
                                                   plan.task_data, plan.ppl_window, plan.batch_size)
        timings["perplexity_s"] = time.perf_counter() - began
    if plan.image_set is not None:
        from quamba.eval.images import evaluate_images, load_image_set
        began = time.perf_counter()
        config = prepared.model.config
        images = load_image_set(plan.image_set, "test", config.img_size, config.channels)
        record["image_classification"] = evaluate_images(prepared.model, images, plan.batch_size)
        timings["image_classification_s"] = time.perf_counter() - began
    timings["total_s"] = time.perf_counter() - started
    if hasattr(prepared.model, "op_backends"):  # which backend each op ran on, as profiles record
        record["model"]["op_backends"] = prepared.model.op_backends()
    return record, prepared.name
