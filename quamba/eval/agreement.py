"""Per-document agreement of two zero-shot runs of the same model and documents (a GPU run and a
CPU run, say), with every flipped document set beside its log-likelihood margins.

A document flips when one run gets it right and the other wrong. That happens where the runs'
float rounding differs by more than the document's margin: for a multiple-choice task, the gold
choice's log-likelihood minus the best other choice's (the sign of ``acc``); for a task scored
by one continuation (lambada), only its log-likelihood is recorded, so the report gives the two
values. A flip is *explained* when its smaller margin lies within the noise: the largest change
of margin between the runs over the documents that did not flip.

    python -m quamba.eval.agreement RUN_A.json RUN_B.json --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quamba.errors import QuambaError
from quamba.utils.io import atomic_write_text

METRIC = "acc,none"


def margins(samples: dict) -> list[float] | None:
    """Each document's acc margin (gold log-likelihood minus the best other choice's), or None
    where the run recorded no choices with a gold index."""
    if "gold" not in samples:
        return None
    return [lls[gold] - max(ll for i, ll in enumerate(lls) if i != gold)
            for lls, gold in zip(samples["loglikelihoods"], samples["gold"])]


def task_agreement(samples_a: dict, samples_b: dict) -> dict:
    """Agreement of one task's per-document ``acc`` in two runs, and the flipped documents."""
    if samples_a["doc_id"] != samples_b["doc_id"]:
        raise QuambaError("the runs scored different documents; agreement needs the same ones")
    if METRIC not in samples_a or METRIC not in samples_b:
        raise QuambaError(f"a run holds no per-document {METRIC}")
    correct_a, correct_b = samples_a[METRIC], samples_b[METRIC]
    flipped = [i for i, (a, b) in enumerate(zip(correct_a, correct_b)) if a != b]
    report = {"documents": len(correct_a), "agree": len(correct_a) - len(flipped),
              "accuracy_a": sum(correct_a) / len(correct_a),
              "accuracy_b": sum(correct_b) / len(correct_b), "flips": []}
    margin_a, margin_b = margins(samples_a), margins(samples_b)
    if margin_a is not None and margin_b is not None:
        kept = [abs(x - y) for i, (x, y) in enumerate(zip(margin_a, margin_b)) if i not in flipped]
        report["noise"] = max(kept, default=0.0)
        report["flips"] = [_flip(samples_a, i, correct_a[i], margin_a[i], margin_b[i],
                                 report["noise"]) for i in flipped]
    elif "loglikelihoods" in samples_a and "loglikelihoods" in samples_b:
        lls_a, lls_b = samples_a["loglikelihoods"], samples_b["loglikelihoods"]
        report["flips"] = [{"doc_id": samples_a["doc_id"][i], "correct_a": correct_a[i],
                            "loglikelihood_a": lls_a[i][0], "loglikelihood_b": lls_b[i][0]}
                           for i in flipped]
    return report


def _flip(samples: dict, index: int, correct_a: int, margin_a: float, margin_b: float,
          noise: float) -> dict:
    return {"doc_id": samples["doc_id"][index], "correct_a": correct_a, "margin_a": margin_a,
            "margin_b": margin_b, "explained": min(abs(margin_a), abs(margin_b)) <= noise}


def agreement(run_a: dict, run_b: dict) -> dict:
    """Per task (those both runs scored): documents, agreement and flips (task_agreement)."""
    per_a, per_b = (run["zero_shot"]["per_sample"] for run in (run_a, run_b))
    tasks = [task for task in per_a if task in per_b]
    if not tasks:
        raise QuambaError("the runs share no task")
    return {task: task_agreement(per_a[task], per_b[task]) for task in tasks}


def report_markdown(report: dict, name_a: str, name_b: str) -> str:
    lines = [f"# Per-document agreement: {name_a} (a) vs {name_b} (b)", "",
             "| task | documents | agree | acc a | acc b | flips | explained by margins | noise |",
             "|---|---|---|---|---|---|---|---|"]
    for task, row in report.items():
        explained = sum(flip.get("explained", False) for flip in row["flips"])
        noise = f"{row['noise']:.3g}" if "noise" in row else "—"
        lines.append(f"| {task} | {row['documents']} | {row['agree']} "
                     f"({row['agree'] / row['documents']:.2%}) | {row['accuracy_a']:.4f} | "
                     f"{row['accuracy_b']:.4f} | {len(row['flips'])} | "
                     f"{explained if 'noise' in row else '—'} | {noise} |")
    lines += ["", "noise: the largest change of a document's margin between the runs over the "
              "documents that did not flip. Flipped documents:", ""]
    for task, row in report.items():
        for flip in row["flips"]:
            values = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in flip.items()}
            lines.append(f"- {task} {values}")
    return "\n".join(lines) + "\n"


def write_report(path_a, path_b, out_dir) -> tuple[Path, Path]:
    runs = [json.loads(Path(path).read_text()) for path in (path_a, path_b)]
    report = agreement(*runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = atomic_write_text(out_dir / "agreement.json", json.dumps(report, indent=2) + "\n")
    md_path = atomic_write_text(out_dir / "agreement.md",
                                report_markdown(report, Path(path_a).name, Path(path_b).name))
    return json_path, md_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quamba.eval.agreement",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="run JSON (main.py --log_dir)")
    parser.add_argument("run_b", help="run JSON of the same tasks and documents")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.run_a, args.run_b, args.out)
    except (QuambaError, OSError, json.JSONDecodeError, KeyError) as exc:
        print(f"error: {exc if isinstance(exc, QuambaError) else f'unreadable run: {exc!r}'}",
              file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
