"""Comparing SSM modes: task accuracy with paired tests, and layer-by-layer SQNR.

* ``report``: from one run JSON per mode (main.py's --log_dir files), a Markdown table per task
  of each mode's accuracy ± stderr, its difference to ``int8`` and McNemar's exact test on the
  per-document correctness (the same documents in every run), plus a PNG chart.
* ``layers``: on a few samples, the SQNR of each layer's intermediates in each mode against the
  unquantized (rotated) model, as a Markdown table and a PNG plot.

    python -m quamba.eval.compare report RUN.json [RUN.json ...] --out DIR
    python -m quamba.eval.compare layers QUANTIZED_MODEL --text FILE --out DIR
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch

from quamba.errors import QuambaError
from quamba.layers.modes import SSM_MODES
from quamba.utils.io import atomic_write_text

REFERENCE_MODE = "int8"
# Intermediates compared layer by layer (names of the mixers' taps), Mamba1's and Mamba2's; a
# hybrid's other layers (attention, MLP, MoE) are compared by their output only.
LAYER_TAPS = ("x", "u", "dt", "y", "out_proj.input", "out")
MAMBA2_LAYER_TAPS = ("z", "xbc", "y", "out_proj.input", "out")
OUTPUT_TAPS = ("out",)
KIND_TAPS = {"mamba1": LAYER_TAPS, "mamba2": MAMBA2_LAYER_TAPS}


# --- paired statistics -------------------------------------------------------------------------

def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pair counts (binomial, p = 1/2)."""
    n = only_first + only_second
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_first, only_second) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_counts(reference: dict, other: dict, metric: str) -> tuple[int, int]:
    """(documents right only in ``reference``, right only in ``other``) for one task's
    per-sample table; the document ids must be the same."""
    if reference["doc_id"] != other["doc_id"]:
        raise QuambaError("the runs scored different documents; a paired test needs the same ones")
    pairs = list(zip(reference[metric], other[metric]))
    return sum(a > b for a, b in pairs), sum(b > a for a, b in pairs)


# --- mode report -------------------------------------------------------------------------------

def load_runs(paths) -> dict[str, dict]:
    """Run records keyed by SSM mode (one run per mode)."""
    runs = {}
    for path in paths:
        record = json.loads(Path(path).read_text())
        if "zero_shot" not in record:
            raise QuambaError(f"{path} holds no zero-shot results")
        mode = record["model"].get("ssm_mode") or "fp16"
        if mode in runs:
            raise QuambaError(f"two runs for mode {mode}: {path}")
        runs[mode] = record
    if REFERENCE_MODE not in runs:
        raise QuambaError(f"no run in mode {REFERENCE_MODE}: it is the reference of the comparison")
    return dict(sorted(runs.items(), key=lambda item: _mode_order(item[0])))


def _mode_order(mode: str) -> int:
    return SSM_MODES.index(mode) if mode in SSM_MODES else len(SSM_MODES)


def _accuracy_metric(results: dict) -> str:
    return "acc,none" if "acc,none" in results else next(
        k for k in results if k.endswith(",none") and "_stderr" not in k)


def mode_table(runs: dict[str, dict]) -> list[dict]:
    """One row per (task, mode): accuracy, stderr, difference to int8, McNemar p-value."""
    reference = runs[REFERENCE_MODE]["zero_shot"]
    rows = []
    for task, ref_results in reference["results"].items():
        metric = _accuracy_metric(ref_results)
        name = metric.split(",")[0]
        for mode, record in runs.items():
            results = record["zero_shot"]["results"][task]
            samples = record["zero_shot"]["per_sample"][task]
            only_ref, only_mode = paired_counts(reference["per_sample"][task], samples, metric)
            rows.append({
                "task": task, "metric": name, "mode": mode, "n": len(samples["doc_id"]),
                "value": results[metric], "stderr": results.get(f"{name}_stderr,none"),
                "diff": results[metric] - ref_results[metric],
                "only_int8": only_ref, "only_mode": only_mode,
                "p_value": mcnemar_exact(only_ref, only_mode),
            })
    return rows


def mode_report_markdown(rows: list[dict]) -> str:
    lines = ["# SSM mode comparison", "",
             f"Difference and McNemar's exact test against `{REFERENCE_MODE}` on per-document "
             "correctness (same documents in every mode). `only int8 / only mode`: documents only "
             "one of the two got right.", ""]
    for task in dict.fromkeys(row["task"] for row in rows):
        task_rows = [row for row in rows if row["task"] == task]
        lines += [f"## {task} ({task_rows[0]['metric']}, n = {task_rows[0]['n']})", "",
                  "| mode | accuracy | ± stderr | diff vs int8 | only int8 / only mode | McNemar p |",
                  "|---|---|---|---|---|---|"]
        for row in task_rows:
            stderr = "—" if row["stderr"] is None else f"{row['stderr']:.4f}"
            lines.append(f"| {row['mode']} | {row['value']:.4f} | {stderr} | {row['diff']:+.4f} | "
                         f"{row['only_int8']} / {row['only_mode']} | {row['p_value']:.3g} |")
        lines.append("")
    return "\n".join(lines)


def plot_mode_chart(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(6, 2 * len(tasks)), 4))
    for i, mode in enumerate(modes):
        mode_rows = {row["task"]: row for row in rows if row["mode"] == mode}
        xs = [t + (i - (len(modes) - 1) / 2) * width for t in range(len(tasks))]
        ax.bar(xs, [mode_rows[t]["value"] for t in tasks], width,
               yerr=[mode_rows[t]["stderr"] or 0 for t in tasks], capsize=3, label=mode)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("accuracy (± stderr)")
    ax.set_title("Zero-shot accuracy per SSM mode")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_mode_report(run_paths, out_dir) -> tuple[Path, Path]:
    rows = mode_table(load_runs(run_paths))
    out_dir = Path(out_dir)
    report = atomic_write_text(out_dir / "mode_report.md", mode_report_markdown(rows))
    chart = out_dir / "mode_accuracy.png"
    plot_mode_chart(rows, chart)
    return report, chart


# --- layer-wise SQNR ---------------------------------------------------------------------------

def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10·log10(‖reference‖² / ‖reference − approx‖²); inf when equal."""
    reference, approx = reference.double(), approx.double()
    noise = (reference - approx).pow(2).sum().item()
    signal = reference.pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def layer_kinds(model) -> list[str]:
    """Each block's kind, as the layer report labels it: "mamba1" or "mamba2" for a Mamba mixer,
    else its mixer's class in lower case (a hybrid's "attention", "mlp", "gatedmlp", "moe" ...)."""
    from quamba.models.mamba import MambaMixer
    from quamba.models.mamba2 import Mamba2Mixer
    kinds = []
    for mixer in model.mixers():
        if isinstance(mixer, Mamba2Mixer):
            kinds.append("mamba2")
        elif isinstance(mixer, MambaMixer):
            kinds.append("mamba1")
        else:
            kinds.append(type(mixer).__name__.lower())
    return kinds


def _record_taps(model, ids) -> list[dict]:
    """Each block's intermediates on ``ids``: a Mamba mixer's taps (FP or quantized, which record
    them when their ``taps`` is a dict), another layer's output ("out", by a forward hook)."""
    mixers = model.mixers()
    records = [{} for _ in mixers]
    hooks = []
    for mixer, record in zip(mixers, records):
        if hasattr(mixer, "taps"):
            mixer.taps = record
        else:
            hooks.append(mixer.register_forward_hook(_output_recorder(record)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
        for mixer in mixers:
            if hasattr(mixer, "taps"):
                mixer.taps = None
    return [{name: t.float().cpu() for name, t in record.items()} for record in records]


def _output_recorder(record: dict):
    def hook(module, inputs, output):
        record["out"] = output
    return hook


def layerwise_sqnr(qmodel, ids: torch.Tensor, modes=SSM_MODES[:-1]) -> dict:
    """``sqnr[mode][layer][tap]`` in dB of each quantized mode against the unquantized model,
    rotated as the quantized one is so every intermediate lives in the same basis. A Mamba
    layer has its mixer's taps (LAYER_TAPS or MAMBA2_LAYER_TAPS), a hybrid's other layers their
    output only; :func:`layer_kinds` names each layer's kind."""
    from quamba.quantization.rotation import quantization_basis_
    reference_model = copy.deepcopy(qmodel._fp())
    reference_model.float()
    quantization_basis_(reference_model, qmodel.quant_config.hadamard)
    tap_names = [KIND_TAPS.get(kind, OUTPUT_TAPS) for kind in layer_kinds(reference_model)]
    reference = _record_taps(reference_model, ids)
    previous_mode = qmodel.ssm_mode
    results = {}
    try:
        for mode in modes:
            qmodel.set_ssm_mode(mode)
            taps = _record_taps(qmodel, ids)
            results[mode] = [{name: sqnr_db(ref[name], layer[name]) for name in names}
                             for names, ref, layer in zip(tap_names, reference, taps)]
    finally:
        qmodel.set_ssm_mode(previous_mode)
    return results


def _taps_in_order(sqnr: dict) -> list[str]:
    """Every tap of any layer, in the order the layers first record them."""
    layers = next(iter(sqnr.values()))
    return list(dict.fromkeys(tap for layer in layers for tap in layer))


def sqnr_markdown(sqnr: dict, kinds: list[str]) -> str:
    """One table a tap, a row for each layer that has it, labelled with its kind."""
    lines = ["# Layer-wise SQNR against the unquantized model (dB; higher is better)", ""]
    modes = list(sqnr)
    layers = sqnr[modes[0]]
    for tap in _taps_in_order(sqnr):
        lines += [f"## {tap}", "", "| layer | " + " | ".join(modes) + " |",
                  "|---|" + "---|" * len(modes)]
        for index, layer in enumerate(layers):
            if tap in layer:
                lines.append(f"| {index} ({kinds[index]}) | "
                             + " | ".join(f"{sqnr[m][index][tap]:.1f}" for m in modes) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_sqnr(sqnr: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    taps = _taps_in_order(sqnr)
    cols = 3
    rows = math.ceil(len(taps) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, tap in zip(axes.flat, taps):
        for mode, layers in sqnr.items():
            points = [(i, min(layer[tap], 99.0)) for i, layer in enumerate(layers) if tap in layer]
            ax.plot(*zip(*points), marker="o", markersize=3, label=mode)
        ax.set_title(tap)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("SQNR (dB)")
    for ax in list(axes.flat)[len(taps):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Where does each SSM mode lose precision?")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_layer_report(qmodel, ids, out_dir) -> tuple[Path, Path]:
    sqnr = layerwise_sqnr(qmodel, ids)
    kinds = layer_kinds(qmodel._fp())
    out_dir = Path(out_dir)
    report = atomic_write_text(out_dir / "layer_sqnr.md", sqnr_markdown(sqnr, kinds))
    plot = out_dir / "layer_sqnr.png"
    plot_sqnr(sqnr, plot)
    atomic_write_text(out_dir / "layer_sqnr.json",
                      json.dumps({"layer_kinds": kinds, "sqnr": sqnr}, indent=2, default=str))
    return report, plot


def sample_ids(tokenizer, text_path, num_samples: int, seqlen: int) -> torch.Tensor:
    """The first ``num_samples × seqlen`` tokens of a .txt/.jsonl file as a batch."""
    from quamba.eval.perplexity import load_text
    text, _ = load_text(str(text_path))
    tokens = tokenizer.encode(text, add_special_tokens=False)[: num_samples * seqlen]
    if len(tokens) < num_samples * seqlen:
        raise QuambaError(f"{text_path} has {len(tokens)} tokens, fewer than {num_samples} x {seqlen}")
    return torch.tensor(tokens).view(num_samples, seqlen)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m quamba.eval.compare", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="task accuracy per mode with paired tests")
    report.add_argument("runs", nargs="+", help="run JSON files, one per mode")
    report.add_argument("--out", required=True, help="output directory")
    layers = sub.add_parser("layers", help="layer-wise SQNR of each mode against the FP model")
    layers.add_argument("model", help="quantized checkpoint directory (records its base model)")
    layers.add_argument("--text", required=True, help=".txt or .jsonl file to draw samples from")
    layers.add_argument("--num_samples", type=int, default=4)
    layers.add_argument("--seqlen", type=int, default=256)
    layers.add_argument("--device", default="cpu")
    layers.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    if args.command == "report":
        paths = write_mode_report(args.runs, args.out)
    else:
        from quamba.quantization.checkpoint import from_pretrained
        qmodel, tokenizer = from_pretrained(args.model, device=args.device)
        ids = sample_ids(tokenizer, args.text, args.num_samples, args.seqlen).to(args.device)
        paths = write_layer_report(qmodel, ids, args.out)
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
