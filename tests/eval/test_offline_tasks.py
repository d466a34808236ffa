"""Offline lm-eval tasks: YAMLs over lm-eval's own task files, name checks, and real runs of
lambada_openai and piqa on a few documents."""
import json
from pathlib import Path

import pytest
import yaml
from lm_eval.tasks._yaml_loader import load_yaml

from quamba.errors import QuambaError
from quamba.eval.run import evaluate_zero_shot
from quamba.eval.tasks import (OFFLINE_TASKS, UPSTREAM_TASKS_DIR, UnknownTaskError,
                               available_offline_tasks, check_task_names, offline_task_config,
                               write_offline_task_yamls)

TASK_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval"


def first_row(task):
    return json.loads((TASK_DATA / task.data_file).read_text().splitlines()[0])


def test_every_offline_task_includes_lm_evals_yaml_and_overrides_only_data_keys(tmp_path):
    names = write_offline_task_yamls(TASK_DATA, tmp_path)
    assert names == [task.name for task in OFFLINE_TASKS]
    data_keys = {"task", "tag", "dataset_path", "dataset_name", "dataset_kwargs", "training_split",
                 "validation_split", "test_split", "fewshot_split"}
    for task in OFFLINE_TASKS:
        written = yaml.safe_load((tmp_path / f"quamba_offline_{task.name}.yaml").read_text())
        data_file = Path(written["dataset_kwargs"]["data_files"][task.split])
        assert data_file.is_absolute() and data_file.is_file()
        if task.upstream_yaml is None:  # hellaswag: a task of its own over the approximate copy
            assert "APPROXIMATE" in written["metadata"]["note"]
            assert set(first_row(task)) == {"query", "choices", "label"}
            continue
        include = Path(written.pop("include"))
        assert include.is_absolute() and include.is_file() and UPSTREAM_TASKS_DIR in include.parents
        assert set(written) == data_keys
        merged = load_yaml(tmp_path / f"quamba_offline_{task.name}.yaml", resolve_func=False)
        assert merged["output_type"] == load_yaml(include, resolve_func=False)["output_type"]


@pytest.mark.parametrize("task_name, fields", [
    ("lambada_openai", {"text"}),
    ("piqa", {"goal", "sol1", "sol2", "label"}),
    ("arc_easy", {"id", "question", "choices", "answerKey"}),
    ("arc_challenge", {"id", "question", "choices", "answerKey"}),
    ("winogrande", {"sentence", "option1", "option2", "answer"}),
    ("wikitext", {"page"}),
])
def test_local_files_have_the_fields_the_upstream_prompts_use(task_name, fields):
    task = next(t for t in OFFLINE_TASKS if t.name == task_name)
    assert set(first_row(task)) == fields


def test_config_points_the_evaluated_and_few_shot_split_at_the_local_file():
    piqa = next(t for t in OFFLINE_TASKS if t.name == "piqa")
    config = offline_task_config(piqa, TASK_DATA)
    assert config["test_split"] == config["fewshot_split"] == "validation"
    assert config["training_split"] is None and config["validation_split"] is None
    assert config["dataset_path"] == "json"


def test_unknown_task_lists_the_available_ones():
    with pytest.raises(UnknownTaskError) as caught:
        check_task_names(["piqa", "no_such_task"], TASK_DATA)
    message = str(caught.value)
    assert "\n" not in message and "'no_such_task'" in message
    for task in OFFLINE_TASKS:
        assert task.name in message


def test_task_data_directory_problems_are_one_line_errors(tmp_path):
    with pytest.raises(QuambaError, match="does not exist"):
        available_offline_tasks(tmp_path / "missing")
    with pytest.raises(QuambaError, match="holds none of"):
        available_offline_tasks(tmp_path)


def test_only_tasks_with_data_are_offered(small_task_data):
    assert [task.name for task in available_offline_tasks(small_task_data)] == ["piqa", "wikitext"]


def test_lambada_and_piqa_run_offline(model, tokenizer):
    result = evaluate_zero_shot(model, tokenizer, ["lambada_openai", "piqa"], task_data=TASK_DATA,
                                limit=4, batch_size=4, bootstrap_iters=10)
    for task, metrics in (("lambada_openai", ["acc"]), ("piqa", ["acc", "acc_norm"])):
        results = result["results"][task]
        per_sample = result["per_sample"][task]
        assert per_sample["doc_id"] == [0, 1, 2, 3]
        assert result["n_samples"][task]["effective"] == 4
        assert result["task_sources"][task]["dataset_path"] == "json"
        for metric in metrics:
            assert 0.0 <= results[f"{metric},none"] <= 1.0
            assert f"{metric}_stderr,none" in results
            values = per_sample[f"{metric},none"]
            assert set(values) <= {0, 1}
            assert sum(values) / len(values) == pytest.approx(results[f"{metric},none"])
    assert "perplexity,none" not in result["per_sample"]["lambada_openai"]
    assert result["results"]["lambada_openai"]["perplexity,none"] > 1


def test_the_other_offline_tasks_run(model, tokenizer):
    tasks = ["hellaswag", "arc_easy", "arc_challenge", "winogrande", "wikitext"]
    result = evaluate_zero_shot(model, tokenizer, tasks, task_data=TASK_DATA, limit=2, batch_size=8,
                                bootstrap_iters=10)
    for task in tasks[:-1]:
        assert 0.0 <= result["results"][task]["acc,none"] <= 1.0
        assert len(result["per_sample"][task]["acc,none"]) == 2
    assert result["results"]["wikitext"]["word_perplexity,none"] > 1
    assert "APPROXIMATE" in result["task_sources"]["hellaswag"]["note"]
