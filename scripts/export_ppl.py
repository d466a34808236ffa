"""Held-out perplexity of a W8A8 export (quamba.export, loaded by transformers with
compressed-tensors) beside quamba's W8A8 modes, with the protocol of scripts/compare_ppl.py
(docs/export.md's table):

    python scripts/export_ppl.py tests/fixtures/tiny-mamba \
        --calib_data ../shared/data/text/c4_sample.jsonl \
        --text ../shared/data/eval/wikitext2_test_docs.jsonl --out_dir /tmp/tiny-mamba-w8a8
"""
from __future__ import annotations

import torch

import quamba
from quamba.calibrate import load_calibration_set
from quamba.eval.perplexity import evaluate_perplexity
from quamba.export import export, reference_model
from compare_ppl import protocol_parser  # scripts/ (the running script's folder)

MODES = ("int8", "fp32-ssm-input", "fp32-conv")


class TransformersLM(torch.nn.Module):
    """A transformers causal LM with the call quamba's scoring makes."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, ids, num_last_tokens=0):
        logits = self.model(ids).logits
        return logits[:, -num_last_tokens:] if num_last_tokens else logits


def rows(args, model, tokenizer, calib):
    """(row name, model) pairs, built one at a time."""
    from transformers import AutoModelForCausalLM
    yield "FP32", model
    yield "W8A8 Quamba recipe (Hadamard), int8", quamba.quantize(model, tokenizer, calib_data=calib)
    qmodel = quamba.quantize(model, tokenizer, quamba.QuantConfig(hadamard=False), calib_data=calib)
    for mode in MODES:
        qmodel.set_ssm_mode(mode)
        yield f"W8A8 no rotation, {mode}", qmodel
    yield "quamba.export.reference_model (the export's configuration)", reference_model(qmodel)
    export(qmodel, args.out_dir, overwrite=True)
    exported = AutoModelForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32).eval()
    yield "the export in transformers + compressed-tensors", TransformersLM(exported)


@torch.no_grad()
def main(argv=None):
    parser = protocol_parser(__doc__.splitlines()[0])
    parser.add_argument("--out_dir", required=True, help="where the export is written")
    args = parser.parse_args(argv)
    model, tokenizer = quamba.load_model(args.model, dtype="fp32")
    calib = load_calibration_set(args.calib_data, tokenizer, args.calib_data_num, args.calib_seqlen,
                                 0)
    fp_ppl = None
    for name, candidate in rows(args, model, tokenizer, calib):
        ppl = evaluate_perplexity(candidate, tokenizer, args.text, window=2048,
                                  progress=False)["perplexity"]
        fp_ppl = fp_ppl or ppl
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / fp_ppl - 1):+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
