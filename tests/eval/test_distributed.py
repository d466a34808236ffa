"""Data-parallel evaluation: main.py under torchrun with 2 CPU processes (gloo) records what one
process records, and a rank that fails stops every rank."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quamba.errors import QuambaError
from quamba.eval import distributed
from quamba.eval.lm import _in_document_order, _undeal

REPO = Path(__file__).resolve().parents[2]
DOCS_PER_TASK = 9  # odd: rank 0 gets one document more than rank 1


@pytest.fixture(scope="module")
def task_data(shared_data_dir, tmp_path_factory):
    """The first documents of lambada_openai and piqa."""
    data_dir = tmp_path_factory.mktemp("task-data")
    for name in ("lambada_openai_test.jsonl", "piqa_validation.jsonl"):
        lines = (shared_data_dir / "eval" / name).read_text().splitlines()[:DOCS_PER_TASK]
        (data_dir / name).write_text("\n".join(lines) + "\n")
    return data_dir


def torchrun(args, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"))
    env.pop("QUAMBA_TASK_DATA", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", str(REPO / "main.py"), *map(str, args)]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, check=False)


def main_in_process(args) -> int:
    spec = importlib.util.spec_from_file_location("quamba_main", REPO / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(arg) for arg in args])


def only_record(log_dir: Path) -> dict:
    runs = list(log_dir.iterdir())
    assert len(runs) == 1, runs
    return json.loads(runs[0].read_text())


@pytest.mark.slow  # about 15 s: three processes import torch and lm-eval
def test_two_ranks_record_what_one_process_records(tiny_model_dir, shared_data_dir, task_data,
                                                  tmp_path):
    """Quantized once on rank 0 and loaded by rank 1; lm-eval tasks and perplexity. Batch size 1
    scores each request alone, so the records are equal to the last bit (larger batches hold
    other requests on each rank, which moves the log-likelihoods by float rounding)."""
    text = tmp_path / "text.txt"
    text.write_text((shared_data_dir / "text" / "tinyshakespeare.txt").read_text()[:20000])
    args = [tiny_model_dir, "--quantize", "--pretrained_dir", tmp_path / "pretrained",
            "--calib_data", shared_data_dir / "text" / "c4_sample.jsonl", "--calib_data_num", "4",
            "--calib_seqlen", "64", "--eval_zero_shot", "--task_list", "lambada_openai,piqa",
            "--task_data", task_data, "--eval_ppl", "--ppl_dataset", text, "--ppl_window", "256",
            "--batch_size", "1"]
    done = torchrun([*args, "--log_dir", tmp_path / "two"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("run record:") == 1 and "piqa: acc" in done.stdout
    assert done.stderr.count("Building contexts for piqa") == 1  # rank 1 logs nothing
    assert main_in_process([*args, "--log_dir", tmp_path / "one"]) == 0
    two, one = only_record(tmp_path / "two"), only_record(tmp_path / "one")
    assert (two["world_size"], one["world_size"]) == (2, 1)
    assert two["model"]["how"] == "quantized" and one["model"]["how"].startswith("reused")
    for key in ("results", "n_samples", "per_sample"):
        assert two["zero_shot"][key] == one["zero_shot"][key], key
    assert two["zero_shot"]["per_sample"]["piqa"]["doc_id"] == list(range(DOCS_PER_TASK))
    assert two["perplexity"] == one["perplexity"]


def test_a_rank_that_fails_stops_every_rank(tiny_model_dir, tmp_path):
    """Rank 0 cannot read the calibration set; rank 1, waiting for the saved model, stops too."""
    missing = tmp_path / "missing.jsonl"
    done = torchrun([tiny_model_dir, "--quantize", "--pretrained_dir", tmp_path / "pretrained",
                     "--calib_data", missing, "--eval_ppl", "--log_dir", tmp_path / "logs"],
                    tmp_path)
    assert done.returncode != 0
    # the two ranks write to one pipe, so their lines may interleave
    assert f"error: calibration file '{missing}' does not exist" in done.stderr
    assert "error: rank 1: stopped, rank 0 failed to prepare the model" in done.stderr
    for source in ("main.py", "quamba"):  # no traceback from quamba (torchrun prints its own)
        assert f'File "{REPO / source}' not in done.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "pretrained").exists()


def test_gathered_payloads_come_back_in_document_order():
    """lm-eval's evaluate() deals documents 0..4 to two ranks as [0, 2, 4] and [1, 3]."""
    samples = [[{"doc_id": d, "filter": f} for f in ("a", "b") for d in docs]
               for docs in ([0, 2, 4], [1, 3])]
    metrics = [{("acc", "a"): [0.0, 2.0, 4.0]}, {("acc", "a"): [1.0, 3.0]}]
    merged = _in_document_order([{"t": samples[0]}, {"t": samples[1]}])["t"]
    assert [(s["filter"], s["doc_id"]) for s in merged] == [(f, d) for f in "ab" for d in range(5)]
    assert _in_document_order([{"t": m} for m in metrics])["t"] == {("acc", "a"): [0, 1, 2, 3, 4]}
    assert _undeal([[None, None], [None]]) == [None] * 3


def test_single_process_is_unchanged(monkeypatch):
    for name in distributed.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not distributed.launched() and distributed.world_size() == 1
    assert distributed.local_device("cuda:1") == "cuda:1"
    assert distributed.shard([1, 2, 3]) == [1, 2, 3]
    with distributed.process_group("cpu"):
        assert distributed.gather_objects("x") == ["x"]


def test_each_rank_takes_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.launched()
    assert distributed.local_device("cuda") == "cuda:1"
    assert distributed.local_device("cpu") == "cpu"
    with pytest.raises(QuambaError, match="give --device cuda"):
        distributed.local_device("cuda:0")
