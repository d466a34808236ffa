"""quamba text generation: any model main.py accepts (Hub id, directory, saved quantized name, or
one quantized on the fly), a prompt or a random one of a given length, and timings.

    python generate.py state-spaces/mamba-130m --prompt "Mamba is" --genlen 50 --cache_graph
    python generate.py quamba-mamba-2.8b-w4a8 --pretrained_dir pretrained --promptlen 1024 \
        --genlen 128 --batch 8 --cache_graph

With ``--cache_graph`` each decode step is replayed from a CUDA graph (GPU only), and with
``--prefill_graph`` too the prefill, from a graph captured per prompt length. The model and
quantization flags are main.py's; errors print ``error: <message>`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from main import add_model_arguments, check_model_arguments, model_request
from quamba import QuambaError
from quamba.cli_support import prepare_model
from quamba.models.generation import graphed_decoder, graphed_prefill
from quamba.models.hub import check_token_ids
from quamba.ops import backend


def build_parser() -> tuple[argparse.ArgumentParser, object]:
    parser = argparse.ArgumentParser(
        prog="generate.py", allow_abbrev=False,
        description="Generate text with a Mamba LM, FP or quantized. Dashes and underscores are "
                    "interchangeable in flag names.")
    flags = add_model_arguments(parser)
    group = parser.add_argument_group("generation")
    prompt = group.add_mutually_exclusive_group()
    flags.add(prompt, "--prompt", help="the prompt text")
    flags.add(prompt, "--promptlen", type=int, help="a random prompt of this many tokens")
    flags.add(group, "--genlen", type=int, default=100, help="tokens to generate (default 100)")
    flags.add(group, "--batch", type=int, default=1, help="sequences generated together (default 1)")
    flags.add(group, "--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    flags.add(group, "--topk", type=int, default=1, help="top-k sampling; 1 is greedy (default 1)")
    flags.add(group, "--topp", type=float, default=1.0, help="nucleus sampling threshold (default 1)")
    flags.add(group, "--ignore_eos", action="store_true", help="always generate --genlen tokens")
    flags.add(group, "--cache_graph", action="store_true",
              help="replay each decode step from a CUDA graph (GPU only)")
    flags.add(group, "--prefill_graph", action="store_true",
              help="with --cache_graph: replay the prefill from a CUDA graph too. The first prompt "
                   "of each length pays the capture (here before the timed run); later prompts "
                   "of that length replay it")
    flags.add(group, "--streaming", action="store_true", help="print tokens as they come (batch 1)")
    return parser, flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser, flags = build_parser()
    args = parser.parse_args(flags.normalize(sys.argv[1:] if argv is None else list(argv)))
    check_model_arguments(parser, args)
    for name in ("genlen", "batch", "promptlen"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name} must be positive, got {value}")
    if args.streaming and args.batch != 1:
        parser.error("--streaming prints one sequence: use it with --batch 1")
    if args.prefill_graph and not args.cache_graph:
        parser.error("--prefill_graph replays the prefill into the decode graphs' cache: use it "
                     "with --cache_graph")
    if args.prompt is None and args.promptlen is None:
        args.prompt = "Mamba is"
    return args


def prompt_ids(args, tokenizer, vocab_size: int, device) -> torch.Tensor:
    if args.promptlen is not None:
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab_size, (1, args.promptlen), generator=gen)
    else:
        if tokenizer is None:
            raise QuambaError("this model has no tokenizer: give --tokenizer, or --promptlen for a "
                              "random prompt")
        ids = torch.tensor([tokenizer(args.prompt)["input_ids"]])
        check_token_ids(ids[0], vocab_size, "the prompt")
    if ids.shape[1] == 0:
        raise QuambaError("the prompt is empty")
    return ids.to(device).repeat(args.batch, 1)


class _Printer:
    """Streams row 0 as text: decodes all its tokens and prints what is new since the last call
    (a token can complete a character only together with the next one)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def __call__(self, next_ids: torch.Tensor) -> None:
        self.ids.append(int(next_ids[0]))
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            print(text[self.shown:], end="", flush=True)
            self.shown = len(text)


def generate(args) -> None:
    prepared = prepare_model(model_request(args))
    model, tokenizer = prepared.model, prepared.tokenizer
    print(prepared.summary(), file=sys.stderr)
    ids = prompt_ids(args, tokenizer, model.config.vocab_size, prepared.device)
    if args.streaming and tokenizer is None:
        raise QuambaError("--streaming needs a tokenizer")
    kwargs = dict(max_new_tokens=args.genlen, temperature=args.temperature, top_k=args.topk,
                  top_p=args.topp, cache_graph=args.cache_graph, prefill_graph=args.prefill_graph,
                  generator=torch.Generator(device=prepared.device).manual_seed(args.seed))
    if args.ignore_eos:
        kwargs["eos_token_id"] = -1
    if args.streaming:
        print(args.prompt if args.promptlen is None else "", end="", flush=True)
        kwargs["streamer"] = _Printer(tokenizer)
    with backend.recording() as ran:
        capture_seconds = _capture_graphs(model, ids, args.genlen, args.prefill_graph,
                                          prepared.device) if args.cache_graph else None
        # (outside the timed run)
        start = _now(prepared.device)
        output = model.generate(ids, **kwargs)
        seconds = _now(prepared.device) - start
    new_tokens = output.shape[1] - ids.shape[1]
    if args.streaming:
        print()
    elif tokenizer is not None:  # the prompt too, unless it is random tokens
        start = ids.shape[1] if args.promptlen is not None else 0
        for row in output:
            print(tokenizer.decode(row[start:].tolist()))
    print(f"{new_tokens} new tokens x batch {args.batch} after a {ids.shape[1]}-token prompt in "
          f"{seconds * 1e3:.1f} ms ({seconds * 1e3 / max(new_tokens, 1):.2f} ms per token, prefill "
          f"included; cache_graph {args.cache_graph}, prefill_graph {args.prefill_graph})",
          file=sys.stderr)
    if args.prefill_graph:
        print(f"the decode graph and the {ids.shape[1]}-token prefill graph were captured before the "
              f"timed run, in {capture_seconds * 1e3:.1f} ms; later prompts of this length replay "
              f"the prefill graph", file=sys.stderr)
    print(backends_line(ran, prepared.device), file=sys.stderr)


@torch.inference_mode()
def _capture_graphs(model, ids, genlen: int, prefill_graph: bool, device) -> float:
    """Captures the decode graph whose cache holds ``ids`` and ``genlen`` new tokens (a hybrid's
    KV caches; generate then reuses it) and with ``prefill_graph`` the prefill graph of ``ids``'
    length; returns the seconds it took."""
    start = _now(device)
    graphed_decoder(model, ids.shape[0], device, ids.shape[1] + genlen)
    if prefill_graph:
        graphed_prefill(model, ids, ids.shape[1] + genlen)
    return _now(device) - start


def backends_line(ran: dict, device) -> str:
    """The backend of every op that ran, and on a GPU which ran their slow torch references."""
    line = "backends: " + ", ".join(f"{op} {name}" for op, name in backend.summary(ran).items())
    slow = backend.on_reference(ran, list(ran)) if str(device).startswith("cuda") else []
    if slow:
        line += (f"\nwarning: on {device} these ops ran their torch references (slow): "
                 f"{', '.join(slow)}; {backend.ENV_HELP}")
    return line


def _now(device) -> float:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        generate(args)
    except QuambaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
