"""lm-eval tasks read from local JSONL files (offline), or from the Hub as lm-eval normally does.

For a task-data directory laid out like ../shared/data/eval (``<task>_<split>.jsonl``), task YAMLs
are written to a temporary directory. Each ``include:``s lm-eval's installed task YAML by absolute
path and overrides only where the data comes from (``dataset_path: json``, absolute
``data_files``, split names), so prompts and metrics stay lm-eval's. The local files use the
field names of the upstream datasets (checked for every task: lambada ``text``; piqa ``goal``,
``sol1``, ``sol2``, ``label``; arc ``question``, ``choices{text,label}``, ``answerKey``;
winogrande ``sentence``, ``option1``, ``option2``, ``answer``; wikitext ``page``), so no
``doc_to_*`` is overridden. The exception is hellaswag, whose local copy is approximate
(``query``, ``choices``, ``label``) and needs a task of its own (see ``HELLASWAG_NOTE``).

The local files hold only the evaluated split, so each offline task evaluates that split and,
for few-shot runs, draws its examples from the same split, never the document being scored
(lm-eval's sampler excludes it when the few-shot split is the evaluated split).
"""
from __future__ import annotations

import functools
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import lm_eval.tasks
import yaml
from lm_eval.tasks import TaskManager

from quamba.errors import QuambaError

UPSTREAM_TASKS_DIR = Path(lm_eval.tasks.__file__).parent

HELLASWAG_NOTE = ("APPROXIMATE local hellaswag: query = activity label + ': ' + context, lightly "
                  "cleaned; lm-eval's own preprocessing differs slightly, so scores are "
                  "comparable to, not identical with, published hellaswag numbers")

# The task YAML written for hellaswag: its local fields differ from the upstream dataset's.
_HELLASWAG_TASK = {
    "output_type": "multiple_choice",
    "doc_to_text": "{{query}}",
    "doc_to_choice": "choices",
    "doc_to_target": "{{label}}",
    "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                    {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    "metadata": {"version": 1.0, "note": HELLASWAG_NOTE},
}


@dataclass(frozen=True)
class OfflineTask:
    name: str
    data_file: str  # file name in the task-data directory
    split: str  # the split that file holds
    upstream_yaml: str | None  # lm-eval's task YAML, relative to lm_eval/tasks


OFFLINE_TASKS = (
    OfflineTask("lambada_openai", "lambada_openai_test.jsonl", "test", "lambada/lambada_openai.yaml"),
    OfflineTask("hellaswag", "hellaswag_validation_approx.jsonl", "validation", None),
    OfflineTask("piqa", "piqa_validation.jsonl", "validation", "piqa/piqa.yaml"),
    OfflineTask("arc_easy", "arc_easy_test.jsonl", "test", "arc/arc_easy.yaml"),
    OfflineTask("arc_challenge", "arc_challenge_test.jsonl", "test", "arc/arc_challenge.yaml"),
    OfflineTask("winogrande", "winogrande_validation.jsonl", "validation", "winogrande/default.yaml"),
    OfflineTask("wikitext", "wikitext2_test_docs.jsonl", "test", "wikitext/wikitext.yaml"),
)


class UnknownTaskError(QuambaError, KeyError):
    """A task name that neither the task data nor lm-eval knows."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def available_offline_tasks(task_data) -> list[OfflineTask]:
    """The offline tasks whose data file is present in ``task_data``."""
    data_dir = Path(task_data).expanduser()
    if not data_dir.is_dir():
        raise QuambaError(f"task data directory {str(task_data)!r} does not exist")
    present = [task for task in OFFLINE_TASKS if (data_dir / task.data_file).is_file()]
    if not present:
        expected = ", ".join(task.data_file for task in OFFLINE_TASKS)
        raise QuambaError(f"task data directory {str(task_data)!r} holds none of {expected}")
    return present


def offline_task_config(task: OfflineTask, data_dir: Path) -> dict:
    """The YAML content of one offline task: lm-eval's own task with local data keys."""
    data_file = str((data_dir / task.data_file).resolve())
    if task.upstream_yaml:
        config = {"include": str(UPSTREAM_TASKS_DIR / task.upstream_yaml)}
    else:
        config = dict(_HELLASWAG_TASK)
    config.update({
        "task": task.name,
        # Without tags the built-in tags (lambada, ai2_arc, ...) stay whole; they find these
        # tasks by name.
        "tag": [],
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {task.split: data_file}},
        "training_split": None,
        "validation_split": None,
        "test_split": task.split,
        "fewshot_split": task.split,
    })
    return config


def write_offline_task_yamls(task_data, out_dir) -> list[str]:
    """Write one YAML per offline task present in ``task_data`` into ``out_dir``; their names."""
    data_dir = Path(task_data).expanduser()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for task in available_offline_tasks(data_dir):
        text = yaml.safe_dump(offline_task_config(task, data_dir), sort_keys=False)
        (out_dir / f"quamba_offline_{task.name}.yaml").write_text(text)
        names.append(task.name)
    return names


@functools.lru_cache(maxsize=None)
def _task_manager(task_data: str | None) -> TaskManager:
    if task_data is None:
        return TaskManager()
    yaml_dir = tempfile.mkdtemp(prefix="quamba-tasks-")
    write_offline_task_yamls(task_data, yaml_dir)
    # Only the offline tasks: indexing lm-eval's ~15k built-in tasks takes seconds and would
    # offer tasks that need the Hub.
    manager = TaskManager(include_path=yaml_dir, include_defaults=False)
    weakref.finalize(manager, shutil.rmtree, yaml_dir, True)
    return manager


def task_manager(task_data=None) -> TaskManager:
    """lm-eval's TaskManager: the offline tasks of ``task_data`` only, or (None) lm-eval's
    built-in tasks, read from the Hub. Built once per process and task-data directory."""
    return _task_manager(None if task_data is None else str(Path(task_data).expanduser().resolve()))


def check_task_names(names, task_data=None) -> list[str]:
    """``names`` as a list, or :class:`UnknownTaskError` naming the first unknown one and the
    tasks available."""
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise QuambaError("no task given")
    manager = task_manager(task_data)
    for name in names:
        if name not in manager.all_tasks:
            raise UnknownTaskError(f"unknown task {name!r}; available: {_available(manager, task_data)}")
    return names


def _available(manager: TaskManager, task_data) -> str:
    if task_data is not None:
        return f"{', '.join(manager.all_tasks)} (offline, from {task_data})"
    standard = [task.name for task in OFFLINE_TASKS]
    return (f"{', '.join(standard)} and {len(manager.all_tasks) - len(standard)} more lm-eval "
            "tasks (lm-eval ls tasks)")
