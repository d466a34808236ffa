"""Plot TTFT and TPOT per precision from benchmarks/profile_mamba.py results (one JSON per model
size and batch): one panel per measure, a group of bars per run, one bar per precision, each
labelled with its speed-up over the run's FP16 baseline (mamba-ssm's model; a hybrid's: the
faster of quamba's FP16 model and transformers' for that measure, as ``ratio_baselines`` records).

    python benchmarks/plot_profile.py profile_130m_b1.json profile_2.8b_b1.json ... --out e2e.png
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MEASURES = [("ttft_ms", "ttft_speedup", "TTFT: prefill, ms"), ("tpot_ms", "tpot_speedup", "TPOT: one decode step, ms")]


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        runs.extend(result["runs"] if "runs" in result else [result])  # several batch sizes
    return runs


def plot(runs: list[dict], out: str) -> None:
    names = list(dict.fromkeys(row["name"] for run in runs for row in run["rows"]))
    fig, axes = plt.subplots(1, len(MEASURES), figsize=(6 * len(MEASURES), 4.5))
    width = 0.8 / len(names)
    for ax, (key, ratio_key, title) in zip(axes, MEASURES):
        for i, name in enumerate(names):
            xs, heights, ratios = [], [], []
            for j, run in enumerate(runs):
                row = next((r for r in run["rows"] if r["name"] == name), None)
                if row is not None:
                    xs.append(j + (i - (len(names) - 1) / 2) * width)
                    heights.append(row[key])
                    ratios.append(row.get(ratio_key))
            bars = ax.bar(xs, heights, width, label=name)
            for bar, ratio in zip(bars, ratios):
                if ratio is not None:
                    ax.annotate(f"{ratio:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([f"{run['model']}\nbatch {run['batch']}" for run in runs])
        ax.set_yscale("log")
        ax.set_ylim(top=ax.get_ylim()[1] * 4)  # room for the labels
        ax.set_title(title)
    meta = runs[0]["meta"]
    fig.suptitle(f"prompt {runs[0]['prompt_len']}, on {meta['device']} ({meta['date']}, commit "
                 f"{meta['commit']}); labels: speed-up over the run's FP16 baseline", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(out))
    with tempfile.NamedTemporaryFile(dir=directory, suffix=".png", delete=False) as tmp:
        fig.savefig(tmp.name, dpi=120)
    os.replace(tmp.name, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="profile_mamba.py JSON files")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args()
    plot(load_runs(args.results), args.out)


if __name__ == "__main__":
    main()
