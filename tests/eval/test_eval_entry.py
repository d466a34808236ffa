"""``python -m quamba.eval``: lm-eval's CLI with the quamba model and optional offline tasks."""
from quamba.eval.__main__ import split_task_data


def test_task_data_is_taken_out_of_lm_evals_arguments(monkeypatch):
    monkeypatch.delenv("QUAMBA_TASK_DATA", raising=False)
    assert split_task_data(["--model", "quamba", "--task_data", "/d", "--limit", "5"]) == (
        ["--model", "quamba", "--limit", "5"], "/d")
    assert split_task_data(["--task-data=/e", "--tasks", "piqa"]) == (["--tasks", "piqa"], "/e")
    assert split_task_data(["--tasks", "piqa"]) == (["--tasks", "piqa"], None)


def test_task_data_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("QUAMBA_TASK_DATA", "/env")
    assert split_task_data(["--tasks", "piqa"]) == (["--tasks", "piqa"], "/env")
