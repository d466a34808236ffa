"""What the Triton SSD's fp16 products cost a quantized Mamba2, measured on CPU: the torch
reference's chunk step with the kernel's roundings emulated (C·Bᵀ from tf32 operands; the masked
weights (C Bᵀ ∘ decay ∘ Δ), the carried state and the B side of the chunk state rounded to fp16, as
quamba.ops.ssd.ssd_triton rounds them for int8 inputs) against the plain reference.

Two numbers: how far the logits of the random-weight 3-layer model of
tests/models/test_cuda_mamba2.py move (W8A8, W4A8 and FP), and the trained tiny-mamba2's W8A8
held-out perplexity (calibration: 32 × 512 tokens of the first 20 wikitext2 test documents;
text: documents 40-51) with and without the roundings.

    python benchmarks/ssd_product_precision.py --out results.json
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import common
import torch

import quamba
import quamba.ops.ssd.ssd as ssd
from quamba.eval.perplexity import perplexity
from quamba.models.config import MambaConfig
from quamba.models.mamba import MambaLMHeadModel, randomize_

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "eval" / "wikitext2_test_docs.jsonl"
RANDOM_MODEL = dict(d_model=768, n_layer=3, vocab_size=1000, layer="Mamba2", headdim=64, ngroups=1,
                    d_state=128, chunk_size=256)


def tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 values with tf32's 10-bit mantissa (truncated)."""
    return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)


def fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def kernel_rounded_chunk(x, dt, decay, B, C, state):
    """quamba.ops.ssd.ssd._ssd_chunk with the kernel's product operands rounded."""
    cumulative = decay.cumsum(dim=1)
    log_decay = cumulative.transpose(1, 2)
    between = log_decay[..., :, None] - log_decay[..., None, :]
    causal = torch.ones(between.shape[-2:], dtype=torch.bool).tril()
    scores = torch.einsum("bthn,bshn->bhts", tf32(C), tf32(B))
    weights = (scores * torch.exp(between.masked_fill(~causal, float("-inf")))
               * dt.transpose(1, 2)[:, :, None, :])
    y = torch.einsum("bhts,bshp->bthp", fp16(weights), x)
    y = y + torch.einsum("bthn,bhpn->bthp", fp16(C), fp16(state)) * torch.exp(cumulative)[..., None]
    to_end = torch.exp(cumulative[:, -1:] - cumulative) * dt
    state = (state * torch.exp(cumulative[:, -1])[:, :, None, None]
             + torch.einsum("bshp,bshn->bhpn", x, fp16(to_end[..., None] * B)))
    return y, state


def run(model, fn, rounded: bool):
    plain = ssd._ssd_chunk
    ssd._ssd_chunk = kernel_rounded_chunk if rounded else plain
    try:
        with torch.no_grad():
            return fn(model)
    finally:
        ssd._ssd_chunk = plain


def logits_shift(model, ids) -> float:
    exact, rounded = (run(model, lambda m: m(ids).float(), flag) for flag in (False, True))
    return float((rounded - exact).norm() / exact.norm())


def random_model_rows() -> list[dict]:
    fp_model = randomize_(MambaLMHeadModel(MambaConfig(**RANDOM_MODEL)).eval(), seed=0)
    calib = torch.randint(0, 1000, (8, 256), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 1000, (3, 200), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        fp_logits = fp_model(ids).float()
    rows = [{"model": "random 3-layer", "recipe": "fp", "logits_shift": logits_shift(fp_model, ids)}]
    for recipe, bits in (("w8a8", {}), ("w4a8", {"w_bits": 4})):
        qmodel = quamba.quantize(fp_model, config=quamba.QuantConfig(**bits), calib_data=calib,
                                 progress=False)
        with torch.no_grad():
            quantization_error = float((qmodel(ids).float() - fp_logits).norm() / fp_logits.norm())
        rows.append({"model": "random 3-layer", "recipe": recipe,
                     "logits_shift": logits_shift(qmodel, ids),
                     "quantization_error": quantization_error})
    return rows


def fixture_row() -> dict:
    docs = [json.loads(line)["page"] for line in WIKITEXT.read_text().splitlines() if line.strip()]
    model, tokenizer = quamba.load_model(REPO / "tests" / "fixtures" / "tiny-mamba2", dtype="fp32",
                                         device="cpu")
    calib = torch.tensor(tokenizer("\n\n".join(docs[:20]))["input_ids"][:32 * 512]).view(32, 512)
    qmodel = quamba.quantize(model, config=quamba.QuantConfig(), calib_data=calib, progress=False)
    text = "\n\n".join(docs[40:52])
    exact, rounded = (run(qmodel, lambda m: perplexity(m, tokenizer, text, progress=False), flag)
                      for flag in (False, True))
    return {"model": "tiny-mamba2", "recipe": "w8a8", "tokens": exact["tokens"],
            "perplexity": exact["perplexity"], "perplexity_kernel_rounded": rounded["perplexity"],
            "fp_perplexity": perplexity(model, tokenizer, text, progress=False)["perplexity"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = random_model_rows() + [fixture_row()]
    for row in rows:
        print(json.dumps(row))
    meta = {"device": "cpu", "torch": torch.__version__, "commit": common.git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    common.write_json(args.out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
