"""Held-out perplexity of FP, W8A8 with the Quamba recipe, and a naive W8A8, side by side.

Naive W8A8 = absmax observers everywhere and no Hadamard rotation. Example (offline, test model):

    python scripts/compare_ppl.py tests/fixtures/tiny-mamba \
        --calib_data ../shared/data/text/c4_sample.jsonl \
        --text ../shared/data/eval/wikitext2_test_docs.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

import quamba
from quamba.calibrate import load_calibration_set
from quamba.eval.perplexity import evaluate_perplexity
from quamba.utils.io import atomic_write_text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="hub id or local model directory")
    parser.add_argument("--calib_data", required=True, help="calibration source (file or hub id)")
    parser.add_argument("--calib_data_num", type=int, default=512)
    parser.add_argument("--calib_seqlen", type=int, default=512)
    parser.add_argument("--text", default="wikitext2", help="'wikitext2' or a .txt/.jsonl file")
    parser.add_argument("--task_data", default=None, help="directory with wikitext2_test_docs.jsonl")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--percentile_alpha", type=float, default=0.9995)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = quamba.load_model(args.model, dtype="fp32", device=args.device)
    calib = load_calibration_set(args.calib_data, tokenizer, args.calib_data_num, args.calib_seqlen,
                                 args.seed)
    recipes = {
        "W8A8 Quamba recipe": quamba.QuantConfig(percentile_alpha=args.percentile_alpha, seed=args.seed),
        "W8A8 naive (absmax, no rotation)": quamba.QuantConfig(percentile_alpha=None,
                                                               hadamard=False, seed=args.seed),
    }
    rows = {"FP32": model}
    for name, config in recipes.items():
        rows[name] = quamba.quantize(model, tokenizer, config, calib_data=calib)
    results = {name: evaluate_perplexity(candidate, tokenizer, args.text, task_data=args.task_data,
                                         window=args.window)
               for name, candidate in rows.items()}
    fp_ppl = results["FP32"]["perplexity"]
    print(f"\nheld-out perplexity ({results['FP32']['source']}, {results['FP32']['tokens']} tokens, "
          f"window {args.window}); calibration: {calib.num_samples} x {calib.seqlen} tokens of "
          f"{calib.source}, percentile alpha {args.percentile_alpha}")
    print("| model | perplexity | vs FP |\n|---|---|---|")
    for name, ppl in results.items():
        print(f"| {name} | {ppl['perplexity']:.3f} | {100 * (ppl['perplexity'] / fp_ppl - 1):+.2f}% |")
    if args.out:
        atomic_write_text(args.out, json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
