"""Data-parallel evaluation's speed-up: the same zero-shot tasks on one GPU and on N under
torchrun, on a quantized model of random weights at a preset's shapes (quantized and saved once,
then loaded by every run). Reports the zero-shot phase's wall time of each run, the speed-up, and
whether the metrics and the per-document records of the two runs are equal.

    python benchmarks/data_parallel_eval.py --config 2.8b --nproc 2 --out data_parallel.json

Every run is main.py as a user starts it (a subprocess; torchrun for N processes); the offline
task data and tokenizer come from ../shared/data.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
TOKENIZER = DATA / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
TASKS = "lambada_openai,hellaswag,piqa,arc_easy,arc_challenge,winogrande"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="2.8b", help="preset shapes (quamba.models.config)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) of the second run")
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--testing", action="store_true",
                        help="main.py --testing: 100 documents a task (default: all)")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--calib_data_num", type=int, default=64, help="calibration samples")
    parser.add_argument("--device", default="cuda", help="cuda (one GPU per process), or cpu")
    parser.add_argument("--workdir", default="data_parallel_work")
    parser.add_argument("--out", required=True, help="JSON summary")
    return parser.parse_args(argv)


def save_random_model(config: str, out_dir: Path, device: str) -> None:
    from quamba.models import MambaLMHeadModel, randomize_, save_model
    from quamba.models.config import preset_config
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = MambaLMHeadModel(preset_config(config), device=device, dtype=dtype)
    save_model(randomize_(model), out_dir)


def main_py(args, model: str, *flags: str, nproc: int = 1) -> list[str]:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(nproc)])
    return [*launcher, str(REPO / "main.py"), model, "--tokenizer", str(TOKENIZER),
            "--batch_size", str(args.batch_size), "--device", args.device, *flags]


def run(command: list[str]) -> float:
    """Run ``command``, its output passed through; its wall seconds."""
    print("+", " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO)
    return time.perf_counter() - started


def run_record(log_dir: Path) -> dict:
    [path] = log_dir.glob("*.json")
    return json.loads(path.read_text())


def differing_documents(one: dict, many: dict) -> dict:
    """Per task: how many documents' 0/1 metrics differ (``correctness``), and how many
    documents' log-likelihoods differ at all (``loglikelihoods``: batches of other neighbours
    round differently)."""
    counts = {}
    for task, samples in one["zero_shot"]["per_sample"].items():
        other = many["zero_shot"]["per_sample"][task]
        metrics = [key for key in samples if "," in key]
        correctness = zip(*(samples[key] for key in metrics), strict=True)
        other_correctness = zip(*(other[key] for key in metrics), strict=True)
        counts[task] = {
            "correctness": sum(a != b for a, b in zip(correctness, other_correctness)),
            "loglikelihoods": sum(a != b for a, b in zip(samples.get("loglikelihoods", []),
                                                         other.get("loglikelihoods", [])))}
    return counts


def main(argv=None) -> int:
    args = parse_args(argv)
    work = (REPO / args.workdir).resolve()
    fp_dir, saved_dir = work / f"mamba-{args.config}-random", work / "pretrained"
    if not fp_dir.is_dir():
        save_random_model(args.config, fp_dir, args.device)
    saved_name = f"quamba-{fp_dir.name}-w8a8"
    quantize_s = None
    if not (saved_dir / saved_name).is_dir():
        quantize_s = run(main_py(args, str(fp_dir), "--quantize", "--pretrained_dir",
                                 str(saved_dir), "--calib_data",
                                 str(DATA / "text" / "c4_sample.jsonl"), "--calib_data_num", str(args.calib_data_num),
                                 "--calib_seqlen", "512"))
    evaluate = ("--pretrained_dir", str(saved_dir), "--eval_zero_shot", "--task_list", args.tasks,
                "--task_data", str(DATA / "eval"),
                *(("--testing",) if args.testing else ()))
    walls, records = {}, {}
    for nproc in (1, args.nproc):
        log_dir = work / f"logs_{nproc}"
        subprocess.run(["rm", "-rf", str(log_dir)], check=True)
        walls[nproc] = run(main_py(args, saved_name, *evaluate, "--log_dir", str(log_dir),
                                   nproc=nproc))
        records[nproc] = run_record(log_dir)
    one, many = records[1], records[args.nproc]
    summary = {
        "date": datetime.now(timezone.utc).isoformat(), "git": one.get("git"),
        "devices": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                    if args.device == "cuda" else ["cpu"]),
        "config": args.config, "tasks": args.tasks, "testing": args.testing,
        "batch_size": args.batch_size, "quantize_s": quantize_s,
        "op_backends": one["model"].get("op_backends"),
        "runs": {str(n): {"world_size": records[n]["world_size"], "wall_s": walls[n],
                          "timings": records[n]["timings"]} for n in records},
        "zero_shot_speedup": one["timings"]["zero_shot_s"] / many["timings"]["zero_shot_s"],
        "wall_speedup": walls[1] / walls[args.nproc],
        "metrics_equal": one["zero_shot"]["results"] == many["zero_shot"]["results"],
        "differing_documents": differing_documents(one, many),
        "results": one["zero_shot"]["results"],
    }
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("zero_shot_speedup", "wall_speedup", "metrics_equal",
                                              "differing_documents")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
