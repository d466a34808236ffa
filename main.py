"""quamba command line: load or quantize a Mamba LM (or a Vision Mamba classifier), evaluate it,
record the run as JSON.

    python main.py state-spaces/mamba-130m --quantize --eval_zero_shot --pretrained_dir pretrained
    python main.py quamba-mamba-130m-w8a8 --pretrained_dir pretrained --ssm_mode fp32-ssm-input \
        --eval_zero_shot
    python main.py tests/fixtures/tiny-vim --quantize --eval_image digits

Everything happens in the library (quamba.cli_support, quamba.eval.run); this file only maps
flags onto it. Errors in the input print ``error: <message>`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from quamba import SSM_MODES, QuambaError
from quamba.cli_support import ModelRequest
from quamba.eval.run import DEFAULT_TASKS, TESTING_LIMIT, EvalPlan, execute_run, summary_lines
from quamba.layers.qhead import LM_HEAD_FORMATS
from quamba.quantization.config import STATE_CACHE_FORMATS

DEFAULT_FEWSHOT = 5


class _Flags:
    """Adds options to a parser and remembers their spellings: in every flag name dashes and
    underscores are interchangeable (``--batch-size`` = ``--batch_size``)."""

    def __init__(self):
        self.canonical: dict[str, str] = {}

    def add(self, container, *names, **kwargs):
        for name in names:
            self.canonical[_spelling_key(name)] = name
        return container.add_argument(*names, **kwargs)

    def normalize(self, argv: list[str]) -> list[str]:
        normalized = []
        for index, arg in enumerate(argv):
            if arg == "--":
                return normalized + argv[index:]
            name, equals, value = arg.partition("=")
            if name.startswith("--"):
                name = self.canonical.get(_spelling_key(name), name)
            normalized.append(name + equals + value)
        return normalized


def _spelling_key(flag: str) -> str:
    return flag.replace("-", "_")


def build_parser() -> tuple[argparse.ArgumentParser, _Flags]:
    parser = argparse.ArgumentParser(
        prog="main.py", allow_abbrev=False,
        description="Quantize Mamba language models (Quamba W8A8, W4A8, W4A16) and evaluate them "
                    "with lm-eval tasks and perplexity. Dashes and underscores are interchangeable "
                    "in flag names.")
    flags = add_model_arguments(parser)
    flags.add(parser.add_argument_group("export"), "--export", metavar="DIR",
              help="write the quantized model to DIR for the serving engines (compressed-tensors, "
                   "quamba.export; W8A8 or W4A16 quantized with --no_hadamard); single process")

    group = parser.add_argument_group("evaluation")
    flags.add(group, "--eval_zero_shot", action="store_true", help="run the lm-eval tasks zero-shot")
    flags.add(group, "--eval_few_shot", action="store_true", help="run the lm-eval tasks few-shot")
    flags.add(group, "--fewshot", type=int, metavar="N",
              help=f"examples per few-shot prompt (default {DEFAULT_FEWSHOT})")
    flags.add(group, "--task_list", default=",".join(DEFAULT_TASKS),
              help=f"comma-separated lm-eval tasks (default {','.join(DEFAULT_TASKS)})")
    flags.add(group, "--task_data", metavar="DIR", default=os.environ.get("QUAMBA_TASK_DATA"),
              help="read the tasks offline from this directory of JSONL files (laid out as "
                   "../shared/data/eval); default: the environment variable QUAMBA_TASK_DATA, "
                   "else the tasks come from the Hub")
    flags.add(group, "--testing", action="store_true",
              help=f"limit each task to {TESTING_LIMIT} documents (quick checks only: standard "
                   "errors are about 5 points)")
    flags.add(group, "--eval_ppl", action="store_true", help="measure perplexity")
    flags.add(group, "--ppl_dataset", default="wikitext2", metavar="wikitext2|FILE",
              help="perplexity text: wikitext2 (from --task_data when it holds "
                   "wikitext2_test_docs.jsonl, else the Hub) or a .txt/.jsonl file (default wikitext2)")
    flags.add(group, "--ppl_window", type=int, default=2048,
              help="tokens per perplexity window (default 2048)")
    flags.add(group, "--eval_image", metavar="digits|DIR",
              help="top-1 accuracy of a Vision Mamba classifier on scikit-learn's 8x8 digits (test "
                   "split) or an ImageFolder directory (one subdirectory of images per class)")
    flags.add(group, "--batch_size", type=int, default=16,
              help="sequences (or images) per forward pass (default 16)")
    flags.add(group, "--log_dir", default="logs", metavar="DIR",
              help="directory of the run's JSON record, one new file per run (default logs)")
    return parser, flags


def add_model_arguments(parser: argparse.ArgumentParser) -> _Flags:
    """MODEL and the model and quantization flags (shared with generate.py); returns the flag
    spellings for ``_Flags.normalize``."""
    flags = _Flags()
    parser.add_argument("model", metavar="MODEL",
                        help="model directory, Hub id, or the name of a saved quantized model under "
                             "--pretrained_dir (e.g. quamba-mamba-130m-w8a8)")

    group = parser.add_argument_group("model")
    flags.add(group, "--device", help="torch device (default: cuda when present, else cpu)")
    flags.add(group, "--dtype", choices=("fp16", "bf16", "fp32"),
              help="float dtype (default: fp16 on cuda, fp32 on cpu)")
    flags.add(group, "--tokenizer", help="tokenizer: Hub id, directory or tokenizer.json "
                                         "(default: the model's own, else GPT-NeoX-20B)")
    flags.add(group, "--backend", choices=("torch", "cuda", "auto"),
              help="kernels for quantized ops (default auto; the environment variable "
                   "QUAMBA_BACKEND takes precedence)")
    flags.add(group, "--pretrained_dir", metavar="DIR",
              help="where quantized models are saved (as quamba-<model>-w<W>a<A>) and looked up")
    flags.add(group, "--seed", type=int, default=0, help="seed of calibration and lm-eval (default 0)")

    group = parser.add_argument_group("quantization")
    flags.add(group, "--quantize", action="store_true",
              help="quantize MODEL; with --pretrained_dir the result is saved, and a saved model is "
                   "reused when its recorded recipe equals the requested one")
    flags.add(group, "--w_bits", type=int, default=8,
              help="weight bits: 8 (W8A8) or 4 (W4A8, W4A16) (default 8)")
    flags.add(group, "--a_bits", type=int, default=8,
              help="activation bits: 8, or 16 for weight-only W4A16 (fp16 activations, conv1d and "
                   "scan; no calibration, no Hadamard rotation, no SSM modes) (default 8)")
    flags.add(group, "--group_size", type=int, default=128,
              help="input channels per scale group of 4-bit weights (default 128)")
    flags.add(group, "--apply_gptq", action="store_true",
              help="GPTQ instead of round-to-nearest for the 4-bit weights (in_proj, out_proj; "
                   "a hybrid's attention, MLP and expert linears too; W4A8 and W4A16)")
    flags.add(group, "--gptq_data", metavar="SOURCE",
              help="text for GPTQ's Hessians (default: wikitext-2 train from the Hub)")
    flags.add(group, "--gptq_data_num", type=int, default=128, help="GPTQ samples (default 128)")
    flags.add(group, "--gptq_seqlen", type=int, default=1024,
              help="tokens per GPTQ sample (default 1024)")
    flags.add(group, "--act_order", action="store_true", help="GPTQ in decreasing Hessian-diagonal order")
    flags.add(group, "--mixed_precision", type=float, metavar="FRACTION",
              help="W4A8 only: per-layer mixed precision (Quamba2's W4AX), this fraction of the "
                   "layers (a hybrid's blocks of every kind), those whose quantization raises the "
                   "calibration loss most, run W4A16")
    flags.add(group, "--no_hadamard", action="store_true",
              help="do not rotate with Hadamard transforms (W8A8 and W4A8 rotate by default; "
                   "W4A16 does not rotate)")
    flags.add(group, "--lm_head", choices=LM_HEAD_FORMATS, default="fp16",
              help="lm_head format: fp16 (float, as today), int8 (W8A8, per-output-channel weight "
                   "scales, calibrated input scale; 8-bit activations only) or int4 (W4A16 in groups "
                   "of --group_size) (default fp16)")
    flags.add(group, "--quantize_embedding", action="store_true",
              help="store the embedding as int8 rows with one scale per row, dequantized on lookup")
    flags.add(group, "--state_cache", choices=STATE_CACHE_FORMATS,
              help="decode SSM state of the int8 mixers: int8 (Quamba, per-tensor calibrated scale) "
                   "or fp32 (default: the recorded one of a saved model, else int8)")
    flags.add(group, "--percentile_alpha", type=float, default=0.9995, metavar="A",
              help="percentile of the SSM input and state scales (default 0.9995)")
    flags.add(group, "--calib_data", metavar="SOURCE",
              help="calibration text: Hub dataset id or .txt/.jsonl file (default: QuantConfig's, "
                   "the Pile validation split); for a Vision Mamba classifier, images: digits (its "
                   "train split) or an ImageFolder directory (default: the train split of the "
                   "--eval_image set, i.e. digits' train split with --eval_image digits; an "
                   "ImageFolder --eval_image has none, so give --calib_data)")
    flags.add(group, "--calib_data_num", type=int, default=512, help="calibration samples (default 512)")
    flags.add(group, "--calib_seqlen", type=int, default=512,
              help="tokens per calibration sample (default 512)")
    flags.add(group, "--learn_scales", action="store_true",
              help="after calibration, learn each Mamba1 block's activation scales by minimizing "
                   "its output error against the FP block (8-bit activations only)")
    flags.add(group, "--learn_steps", type=int, default=200, metavar="N",
              help="Adam steps per block of --learn_scales (default 200)")
    flags.add(group, "--learn_weight_clipping", action="store_true",
              help="with --learn_scales on a W4A8 recipe (round-to-nearest weights), also learn a "
                   "clipping bound per output channel and group of the 4-bit weights")
    modes = group.add_mutually_exclusive_group()
    flags.add(modes, "--ssm_mode", choices=SSM_MODES, metavar="MODE",
              help=f"SSM dequantization mode, one of {', '.join(SSM_MODES)} (default: int8 for a "
                   "fresh quantization, the recorded mode of a saved model; fp16 runs the FP model). "
                   "A W4A16 model has no quantized SSM: fp16 is its only mode, any other is an error")
    flags.add(modes, "--fp32-ssm-input", dest="ssm_mode", action="store_const", const="fp32-ssm-input",
              help="same as --ssm_mode fp32-ssm-input")
    flags.add(modes, "--float-sim-asic-int8", dest="ssm_mode", action="store_const",
              const="float-sim-asic-int8", help="same as --ssm_mode float-sim-asic-int8")

    return flags


def check_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line parser errors for quantization flags that cannot apply (shared with generate.py)."""
    if not args.quantize and (args.lm_head != "fp16" or args.quantize_embedding):
        parser.error("--lm_head and --quantize_embedding choose what --quantize quantizes; give "
                     "--quantize (a saved quantized model keeps its own)")
    if args.lm_head == "int8" and args.a_bits == 16:
        parser.error("--lm_head int8 needs 8-bit activations (its input scale is calibrated); "
                     "use --lm_head int4 with --a_bits 16")
    if args.learn_scales and not args.quantize:
        parser.error("--learn_scales needs --quantize (it learns the scales of a fresh quantization)")
    if args.learn_scales and args.a_bits != 8:
        parser.error("--learn_scales learns activation scales; it needs --a_bits 8")
    if args.learn_weight_clipping and not (args.learn_scales and args.w_bits == 4):
        parser.error("--learn_weight_clipping needs --learn_scales and --w_bits 4 (it clips the "
                     "4-bit weights as the scales are learned)")
    if args.learn_weight_clipping and (args.apply_gptq or args.mixed_precision is not None):
        parser.error("--learn_weight_clipping clips round-to-nearest weights; it does not combine "
                     "with --apply_gptq or --mixed_precision")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser, flags = build_parser()
    args = parser.parse_args(flags.normalize(sys.argv[1:] if argv is None else list(argv)))
    check_model_arguments(parser, args)
    if args.fewshot is not None and not args.eval_few_shot:
        parser.error("--fewshot needs --eval_few_shot")
    if args.export and os.environ.get("WORLD_SIZE", "1") != "1":
        parser.error("--export runs in one process; start it without torchrun")
    if not evaluates(args) and not (args.export or (args.quantize and args.pretrained_dir)):
        parser.error("nothing to do: give --eval_zero_shot, --eval_few_shot, --eval_ppl or "
                     "--eval_image, --export DIR, or --quantize with --pretrained_dir to "
                     "quantize and save")
    return args


def evaluates(args: argparse.Namespace) -> bool:
    return bool(args.eval_zero_shot or args.eval_few_shot or args.eval_ppl or args.eval_image)


def export_model(args: argparse.Namespace) -> None:
    """--export: the (freshly quantized or saved) model written by quamba.export. With
    evaluation flags and no --pretrained_dir, the run then quantizes again (same seed: the same
    model)."""
    from quamba.cli_support import prepare_model
    from quamba.export import export
    prepared = prepare_model(model_request(args))
    export(prepared.model, args.export, tokenizer=prepared.tokenizer)


def model_request(args: argparse.Namespace) -> ModelRequest:
    return ModelRequest(
        model=args.model, quantize=args.quantize, w_bits=args.w_bits, a_bits=args.a_bits,
        group_size=args.group_size, apply_gptq=args.apply_gptq, gptq_source=args.gptq_data,
        gptq_num_samples=args.gptq_data_num, gptq_seqlen=args.gptq_seqlen, act_order=args.act_order,
        hadamard=False if args.no_hadamard else None, mixed_precision=args.mixed_precision,
        ssm_mode=args.ssm_mode, lm_head=args.lm_head, quantize_embedding=args.quantize_embedding,
        state_cache=args.state_cache, percentile_alpha=args.percentile_alpha,
        learn_scales=args.learn_scales, learn_steps=args.learn_steps,
        learn_weight_clipping=args.learn_weight_clipping, calib_source=args.calib_data,
        calib_num_samples=args.calib_data_num,
        calib_seqlen=args.calib_seqlen, seed=args.seed, pretrained_dir=args.pretrained_dir,
        device=args.device, dtype=args.dtype, tokenizer=args.tokenizer, backend=args.backend)


def eval_plan(args: argparse.Namespace) -> EvalPlan:
    few_shot = None
    if args.eval_few_shot:
        few_shot = DEFAULT_FEWSHOT if args.fewshot is None else args.fewshot
    return EvalPlan(
        zero_shot=args.eval_zero_shot, few_shot=few_shot,
        tasks=tuple(name.strip() for name in args.task_list.split(",") if name.strip()),
        limit=TESTING_LIMIT if args.testing else None, perplexity=args.eval_ppl,
        ppl_dataset=args.ppl_dataset, ppl_window=args.ppl_window, batch_size=args.batch_size,
        task_data=args.task_data, log_dir=args.log_dir, seed=args.seed, image_set=args.eval_image)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.export:
            export_model(args)
            if not evaluates(args):
                return 0
        record, path = execute_run(model_request(args), eval_plan(args),
                                   {"argv": sys.argv if argv is None else argv})
    except QuambaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if record is None:  # a rank other than 0 of a data-parallel run: rank 0 reports
        return 0
    for key in ("zero_shot", "few_shot"):
        if key in record:
            print("\n".join(summary_lines(record[key]["results"])))
    if "perplexity" in record:
        ppl = record["perplexity"]
        print(f"perplexity {ppl['dataset']}: {ppl['perplexity']:.4f} ({ppl['bits_per_byte']:.4f} bits "
              f"per byte, {ppl['tokens']} tokens, {ppl['windows']} windows of {ppl['window']})")
    if "image_classification" in record:
        acc = record["image_classification"]
        print(f"top-1 {acc['dataset']}: {acc['top1']:.4f} ± {acc['top1_stderr']:.4f} "
              f"({acc['num_images']} images)")
    if path is not None:
        print(f"run record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
