"""Train the tiny Mamba2 LM that quamba's Mamba2 tests run on.

The Mamba2 sibling of scripts/train_tiny_mamba.py, whose data, split, training loop, optimizer,
learning-rate schedule, evaluation and report it reuses: 4 layers, d_model 192 (d_inner 384),
8 heads of headdim 48 in 2 groups of B and C (neither headdim 64 nor one group, so the general
code paths are exercised), d_state 32, chunks of 64 tokens. It reads the 4096-token tokenizer of
tests/fixtures/tiny-mamba rather than training one, so both test models share a vocabulary, and
writes tests/fixtures/tiny-mamba2 in mamba_ssm's Hub layout (config.json with ssm_cfg.layer
"Mamba2" and pytorch_model.bin, as state-spaces/mamba2-130m) with the tokenizer and
training_report.json beside it.

    python scripts/train_tiny_mamba2.py               # about 10 minutes of training on 2 cores
    python scripts/train_tiny_mamba2.py --steps 1200  # a fixed number of steps

The model trains on quamba's own chunked SSD (quamba.ops.ssd.ssd), which is plain differentiable
torch code: unlike Mamba1's scan it loops over chunks, not over time steps, so autograd through
it is fast enough and no training substitute is patched in.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_tiny_mamba as base  # noqa: E402  (it puts the repository root on sys.path)

from quamba.models import MambaConfig, load_model  # noqa: E402
from quamba.models.loading import load_tokenizer  # noqa: E402
from quamba.ops.ssd.ssd import ssd_scan  # noqa: E402

TOKENIZER_DIR = base.REPO_ROOT / "tests" / "fixtures" / "tiny-mamba"
OUT_DIR = base.REPO_ROOT / "tests" / "fixtures" / "tiny-mamba2"
FIRST_WINDOWS = 2  # held-out windows the fixture test scores again


def tiny_config() -> MambaConfig:
    return MambaConfig(d_model=192, n_layer=4, vocab_size=base.VOCAB_SIZE, d_state=32, d_conv=4,
                       expand=2, conv_bias=True, bias=False, pad_vocab_size_multiple=16,
                       layer="Mamba2", headdim=48, ngroups=2, chunk_size=64)


def shared_tokenizer():
    """The tokenizer of the Mamba1 test model (from its tokenizer.json, as the Mamba1 script builds
    it), checked to be the vocabulary the config expects."""
    tokenizer = load_tokenizer(None, TOKENIZER_DIR / "tokenizer.json")
    special_ids = tokenizer.convert_tokens_to_ids([base.EOS, base.PAD])
    if len(tokenizer) != base.VOCAB_SIZE or special_ids != [0, 1]:
        raise RuntimeError(f"{TOKENIZER_DIR} holds a {len(tokenizer)}-token tokenizer with special "
                           f"ids {special_ids}, not the expected {base.VOCAB_SIZE} and [0, 1]")
    return tokenizer


def check_ssd_gradients(seed: int = 0) -> None:
    """Raise unless autograd's gradients of ``ssd_scan`` match finite differences (several chunks,
    the last partial, two heads per group, an initial state). The op computes in fp32 whatever its
    inputs, hence the large step and tolerances for fp64 inputs."""
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen, nheads, headdim, ngroups, d_state, chunk_size = 1, 7, 4, 2, 2, 3, 3

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    inputs = (randn(batch, seqlen, nheads, headdim), randn(batch, seqlen, nheads),
              (-torch.rand(nheads, generator=gen, dtype=torch.float64) * 2).requires_grad_(),
              randn(batch, seqlen, ngroups, d_state), randn(batch, seqlen, ngroups, d_state),
              randn(nheads), randn(nheads), randn(batch, nheads, headdim, d_state))

    def scan(x, dt, A, B, C, D, dt_bias, initial_state):
        return ssd_scan(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state=initial_state)

    if not torch.autograd.gradcheck(scan, inputs, eps=1e-3, atol=1e-3, rtol=1e-3,
                                    raise_exception=False):
        raise RuntimeError("autograd's gradients of quamba's ssd_scan differ from finite "
                           "differences")


@torch.inference_mode()
def first_windows_perplexity(model_dir: Path, eval_windows: torch.Tensor) -> float:
    """Perplexity of the saved fixture, as ``quamba.load_model`` reads it, on the first
    FIRST_WINDOWS held-out windows: the number tests/models/test_fixture_mamba2.py recomputes."""
    model, _ = load_model(model_dir, tokenizer=False)
    nll, _ = base.mean_nll(model, eval_windows[:FIRST_WINDOWS], batch_size=FIRST_WINDOWS)
    return math.exp(nll)


def main(argv=None) -> None:
    args = base.parse_args(argv, doc=__doc__, out_dir=OUT_DIR)
    started = time.perf_counter()
    base.set_up_torch(args)
    check_ssd_gradients()

    tokenizer = shared_tokenizer()
    corpus = base.tokenize_corpus(tokenizer, *base.split_documents(args))

    config = tiny_config()
    model = base.new_model(config, args.seed)
    losses, train_seconds = base.train_for_budget(model, corpus.train_stream, args)
    eval_windows = base.heldout_windows(tokenizer, args.data_dir)
    results = base.score(model.eval(), eval_windows, corpus, args)
    saved_dtype = base.save_fixture(model, tokenizer, args.out, layout="mamba_ssm")
    results["heldout"]["first_windows"] = {
        "windows": FIRST_WINDOWS,
        "perplexity": round(first_windows_perplexity(args.out, eval_windows), 3)}

    report = {"config": config.to_dict(),
              "tokenizer": base.tokenizer_report(trained_on="the training documents",
                                                 loaded_from=base.relative_to_repo(TOKENIZER_DIR)),
              "data": base.data_report(corpus, args),
              **base.training_report(losses, train_seconds, args), **results}
    base.write_report(report, args.out, saved_dtype, started)


if __name__ == "__main__":
    main()
