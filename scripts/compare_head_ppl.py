"""Held-out perplexity of W8A8 and W4A8 with each lm_head format (fp16, int8, int4) and with the
int8 embedding, against FP: the accuracy cost of quantizing the ends of the model.

The protocol of scripts/compare_ppl.py (README): one calibration set, the Quamba recipe's
observers (percentile α for the SSM input and state), 4-bit groups of --group_size, held-out
perplexity over --window-token windows. The model is calibrated once (the final norm's output
included) and every row is built from those ranges, so rows differ only in what they quantize.

    python scripts/compare_head_ppl.py tests/fixtures/tiny-mamba \
        --calib_data ../shared/data/text/c4_sample.jsonl \
        --text ../shared/data/eval/wikitext2_test_docs.jsonl --group_size 64
"""
from __future__ import annotations

import copy
import json

import torch

import quamba
from quamba.calibrate import calibrate, load_calibration_set
from quamba.eval.perplexity import evaluate_perplexity
from quamba.quantization.quantize import build_quantized_model
from quamba.quantization.rotation import quantization_basis_
from quamba.utils.io import atomic_write_text

from compare_ppl import protocol_parser  # scripts/ (the running script's folder)


def parse_args(argv=None):
    parser = protocol_parser(__doc__.splitlines()[0])
    parser.add_argument("--task_data", default=None, help="directory with wikitext2_test_docs.jsonl")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--percentile_alpha", type=float, default=0.9995)
    parser.add_argument("--group_size", type=int, default=128, help="4-bit weight group size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    return parser.parse_args(argv)


def _recipes(args) -> dict:
    """Row name → QuantConfig: W8A8 and W4A8 with each head, then each with the int8 embedding
    added to its int8 / int4 head."""
    common = dict(seed=args.seed, percentile_alpha=args.percentile_alpha, group_size=args.group_size)
    recipes = {}
    for w_bits in (8, 4):
        for head in ("fp16", "int8", "int4"):
            recipes[f"W{w_bits}A8, lm_head {head}"] = quamba.QuantConfig(w_bits=w_bits, lm_head=head,
                                                                       **common)
        head = "int8" if w_bits == 8 else "int4"
        recipes[f"W{w_bits}A8, lm_head {head}, int8 embedding"] = quamba.QuantConfig(
            w_bits=w_bits, lm_head=head, quantize_embedding=True, **common)
    return recipes


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = quamba.load_model(args.model, dtype="fp32", device=args.device)
    calib = load_calibration_set(args.calib_data, tokenizer, args.calib_data_num, args.calib_seqlen,
                                 args.seed)
    recipes = _recipes(args)
    basis = quantization_basis_(copy.deepcopy(model), hadamard=True)
    observers = next(iter(recipes.values())).observer_specs()
    ranges = calibrate(basis, calib, observers=observers, observe_head=True)
    rows = {"FP32": model}
    for name, config in recipes.items():
        rows[name] = build_quantized_model(basis, ranges, config).set_ssm_mode("int8")
    results = {name: evaluate_perplexity(candidate, tokenizer, args.text, task_data=args.task_data,
                                         window=args.window)
               for name, candidate in rows.items()}
    fp_ppl = results["FP32"]["perplexity"]
    print(f"\nheld-out perplexity ({results['FP32']['source']}, {results['FP32']['tokens']} tokens, "
          f"window {args.window}); calibration {calib.num_samples} x {calib.seqlen} tokens of "
          f"{calib.source}; 4-bit groups of {args.group_size}")
    print("| model | perplexity | vs FP |\n|---|---|---|")
    for name, ppl in results.items():
        print(f"| {name} | {ppl['perplexity']:.3f} | {100 * (ppl['perplexity'] / fp_ppl - 1):+.2f}% |")
    if args.out:
        atomic_write_text(args.out, json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
