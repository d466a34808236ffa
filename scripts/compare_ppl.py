"""Held-out perplexity of FP, W8A8 (Quamba recipe and naive), W4A8 and W4A16, side by side.

Naive W8A8 = absmax observers everywhere and no Hadamard rotation. W4A8 and W4A16 quantize
in_proj, x_proj and out_proj to 4-bit groups of --group_size with round-to-nearest, and with
GPTQ too when --gptq_data is given; --learn_scales compares W8A8 and W4A8 RTN with calibrated
and with learned activation scales (quamba.quantization.learn_scales), and W4A8 with its 4-bit
weights' clipping learned too, instead; --mixed_precision adds W4AX rows (that fraction of the layers
W4A16, chosen by measured sensitivity). Every recipe is calibrated on the same samples (W4A16
calibrates nothing). Mamba2 models take the same recipes (Quamba2's scales). Example (offline, test model, the README's table):

    python scripts/compare_ppl.py tests/fixtures/tiny-mamba \
        --calib_data ../shared/data/text/c4_sample.jsonl \
        --text ../shared/data/eval/wikitext2_test_docs.jsonl \
        --group_size 64 --gptq_data ../shared/data/text/c4_sample.jsonl
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess

import torch

import quamba
from quamba.calibrate import load_calibration_set
from quamba.eval.perplexity import evaluate_perplexity
from quamba.utils.io import atomic_write_text


def protocol_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the README's perplexity protocol's arguments (model, calibration set, held-out
    text), which scripts/compare_head_ppl.py and scripts/decode_state_ppl.py share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model", help="hub id or local model directory")
    parser.add_argument("--calib_data", required=True, help="calibration source (file or hub id)")
    parser.add_argument("--calib_data_num", type=int, default=512)
    parser.add_argument("--calib_seqlen", type=int, default=512)
    parser.add_argument("--text", default="wikitext2", help="'wikitext2' or a .txt/.jsonl file")
    return parser


def parse_args(argv=None):
    parser = protocol_parser(__doc__.splitlines()[0])
    parser.add_argument("--task_data", default=None, help="directory with wikitext2_test_docs.jsonl")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--percentile_alpha", type=float, default=0.9995)
    parser.add_argument("--group_size", type=int, default=128, help="4-bit weight group size")
    parser.add_argument("--gptq_data", default=None,
                        help="GPTQ Hessian text (file or hub id); adds the GPTQ rows")
    parser.add_argument("--gptq_data_num", type=int, default=128)
    parser.add_argument("--gptq_seqlen", type=int, default=1024)
    parser.add_argument("--act_order", action="store_true", help="GPTQ in act-order")
    parser.add_argument("--mixed_precision", type=float, default=None, metavar="FRACTION",
                        help="add per-layer mixed-precision rows: this fraction of the layers W4A16")
    parser.add_argument("--learn_scales", action="store_true",
                        help="compare calibrated and learned activation scales: rows W8A8 and W4A8 "
                             "RTN, each with and without --learn_scales, and W4A8 with its weight "
                             "clipping learned too (the other rows are left out)")
    parser.add_argument("--learn_steps", type=int, default=200)
    parser.add_argument("--learn_num_samples", type=int, default=128)
    parser.add_argument("--learn_lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    return parser.parse_args(argv)


def _recipes(args) -> dict:
    """Row name → QuantConfig, in the order of the table."""
    common = dict(seed=args.seed, percentile_alpha=args.percentile_alpha)
    four_bit = dict(common, w_bits=4, group_size=args.group_size)
    gptq = dict(apply_gptq=True, gptq_source=args.gptq_data, gptq_num_samples=args.gptq_data_num,
                gptq_seqlen=args.gptq_seqlen, gptq_act_order=args.act_order)
    recipes = {
        "W8A8 Quamba recipe": quamba.QuantConfig(**common),
        "W8A8 naive (absmax, no rotation)": quamba.QuantConfig(seed=args.seed, percentile_alpha=None,
                                                               hadamard=False),
    }
    if args.learn_scales:
        learn = dict(learn_scales=True, learn_steps=args.learn_steps, learn_lr=args.learn_lr,
                     learn_num_samples=args.learn_num_samples)
        return {"W4A8 RTN": quamba.QuantConfig(**four_bit),
                "W4A8 RTN + learned scales": quamba.QuantConfig(**four_bit, **learn),
                "W4A8 RTN + learned scales and weight clipping": quamba.QuantConfig(
                    **four_bit, **learn, learn_weight_clipping=True),
                "W8A8 Quamba recipe": recipes["W8A8 Quamba recipe"],
                "W8A8 Quamba recipe + learned scales": quamba.QuantConfig(**common, **learn)}
    for a_bits in (8, 16):
        recipes[f"W4A{a_bits} RTN"] = quamba.QuantConfig(**four_bit, a_bits=a_bits)
        if args.gptq_data:
            recipes[f"W4A{a_bits} GPTQ"] = quamba.QuantConfig(**four_bit, **gptq, a_bits=a_bits)
    if args.mixed_precision is not None:
        mixed = dict(four_bit, mixed_precision=args.mixed_precision)
        name = f"W4AX mixed ({args.mixed_precision:g} of layers W4A16)"
        recipes[f"{name} RTN"] = quamba.QuantConfig(**mixed)
        if args.gptq_data:
            recipes[f"{name} GPTQ"] = quamba.QuantConfig(**mixed, **gptq)
    return recipes


def _protocol(args, calib, fp_result) -> str:
    """One line saying how the numbers were measured."""
    line = (f"held-out perplexity ({fp_result['source']}, {fp_result['tokens']} tokens, window "
            f"{args.window}); calibration: {calib.num_samples} x {calib.seqlen} tokens of "
            f"{calib.source}, percentile alpha {args.percentile_alpha}; 4-bit groups of "
            f"{args.group_size}")
    if args.gptq_data:
        line += (f"; GPTQ Hessians from {args.gptq_data_num} x {args.gptq_seqlen} tokens of "
                 f"{args.gptq_data}{', act-order' if args.act_order else ''}")
    return line


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = quamba.load_model(args.model, dtype="fp32", device=args.device)
    calib = load_calibration_set(args.calib_data, tokenizer, args.calib_data_num, args.calib_seqlen,
                                 args.seed)
    recipes = _recipes(args)
    results = {}
    for name, config in {"FP32": None, **recipes}.items():  # one at a time: memory, partial results
        candidate = model if config is None else quamba.quantize(model, tokenizer, config,
                                                                 calib_data=calib)
        results[name] = evaluate_perplexity(candidate, tokenizer, args.text,
                                            task_data=args.task_data, window=args.window)
        if config is not None and config.learn_scales:
            results[name]["learned_scales"] = candidate.calibration["learned_scales"]
        if args.out:
            atomic_write_text(args.out, json.dumps({"args": vars(args), **_run_metadata(args),
                                                    "results": results}, indent=2))
    fp_ppl = results["FP32"]["perplexity"]
    print("\n" + _protocol(args, calib, results["FP32"]))
    print("| model | perplexity | vs FP |\n|---|---|---|")
    for name, ppl in results.items():
        print(f"| {name} | {ppl['perplexity']:.3f} | {100 * (ppl['perplexity'] / fp_ppl - 1):+.2f}% |")


def _run_metadata(args) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return {"commit": commit, "device": args.device, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


if __name__ == "__main__":
    main()
