"""Decode-path perplexity with the int8 SSM state cache against the fp32 one, and the state
cache's memory per sequence.

Every window is teacher-forced through the decode path: a one-token prefill, then one decode
step per token (the int8 state is requantized with its per-tensor scale at every step), scored
as quamba.eval.perplexity scores a prefill (same windows, same tokens). The prefill row is the
same quantized model on its prefill path, which keeps the scan state in fp32. The memory of the
decode cache (SSM state, and conv state) per sequence is measured from the caches the model
allocates, for the test model and for the Mamba-2.8B shapes (64 layers, d_inner 5120, d_state 16).

    python scripts/decode_state_ppl.py tests/fixtures/tiny-mamba \
        --calib_data ../shared/data/text/c4_sample.jsonl \
        --text ../shared/data/eval/wikitext2_test_docs.jsonl --window 2048
"""
from __future__ import annotations

import json

import torch
import torch.nn as nn

import quamba
from quamba.calibrate import load_calibration_set
from quamba.eval.perplexity import evaluate_perplexity
from quamba.models.config import preset_config
from quamba.models.quantized import QuantizedMambaLM
from quamba.utils.io import atomic_write_text

from compare_ppl import protocol_parser  # scripts/ (the running script's folder)


class DecodePath(nn.Module):
    """``model`` called as a plain forward, but run token by token through its decode path."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    @torch.inference_mode()
    def forward(self, input_ids, num_last_tokens: int = 0):
        cache = self.model.allocate_cache(input_ids.shape[0], input_ids.device, input_ids.shape[1])
        logits = torch.cat([self.model(input_ids[:, :1], cache=cache),
                            self.model(input_ids[:, 1:], cache=cache)], dim=1)
        return logits[:, -num_last_tokens:] if num_last_tokens > 0 else logits


def cache_bytes(model, batch_size: int = 1) -> dict:
    """Bytes of the decode cache ``model`` allocates per sequence: SSM state and conv state."""
    cache = model.allocate_cache(batch_size, "meta")
    ssm = sum(s.ssm.numel() * s.ssm.element_size() for s in cache.states) // batch_size
    conv = sum(s.conv.numel() * s.conv.element_size() for s in cache.states) // batch_size
    return {"ssm_state": ssm, "conv_state": conv}


def mamba_2_8b_cache_bytes() -> dict:
    """The W8A8 Mamba-2.8B's decode cache per sequence with each state format (built on the meta
    device: no weights are allocated)."""
    config = preset_config("2.8b")
    model = QuantizedMambaLM(config, quamba.QuantConfig(), device="meta")
    shapes = {"n_layer": config.n_layer, "d_inner": config.d_inner, "d_state": config.d_state}
    return {"shapes": shapes, **{fmt: cache_bytes(model.set_state_cache(fmt))
                                 for fmt in ("int8", "fp32")}}


def parse_args(argv=None):
    parser = protocol_parser(__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8, help="windows decoded together")
    parser.add_argument("--w_bits", type=int, default=8)
    parser.add_argument("--group_size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model, tokenizer = quamba.load_model(args.model, dtype="fp32")
    calib = load_calibration_set(args.calib_data, tokenizer, args.calib_data_num, args.calib_seqlen,
                                 args.seed)
    config = quamba.QuantConfig(w_bits=args.w_bits, group_size=args.group_size, seed=args.seed)
    qmodel = quamba.quantize(model, tokenizer, config, calib_data=calib)

    def ppl(candidate):
        return evaluate_perplexity(candidate, tokenizer, args.text, window=args.window,
                                   batch_size=args.batch_size)

    results = {"prefill (fp32 scan state)": ppl(qmodel)}
    memory = {}
    for fmt in ("int8", "fp32"):
        qmodel.set_state_cache(fmt)
        results[f"decode, {fmt} state cache"] = ppl(DecodePath(qmodel))
        memory[fmt] = cache_bytes(qmodel)
    record = {"args": vars(args), "quant_config": config.to_dict(), "results": results,
              "cache_bytes_per_sequence": {"this model": memory,
                                           "mamba-2.8b W8A8": mamba_2_8b_cache_bytes()}}
    for name, result in results.items():
        print(f"{name}: perplexity {result['perplexity']:.4f}")
    print(json.dumps(record["cache_bytes_per_sequence"], indent=1))
    if args.out:
        atomic_write_text(args.out, json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
