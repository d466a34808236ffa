"""Train the tiny Mamba1 LM that quamba's tests and README example run on.

A 4-layer, d_model 192 model (d_inner 384: both are 12 times a power of two, so later code meets
non-power-of-two Hadamard sizes) with a 4096-token byte-level BPE tokenizer, trained with quamba's
own ``MambaLMHeadModel`` on ../shared/data/text (C4 sample + tiny-shakespeare) and written to
tests/fixtures/tiny-mamba in the transformers Hub layout with training_report.json beside it.
Nothing under ../shared/data/eval is trained on; wikitext-2 test is only scored at the end,
next to an add-one-smoothed unigram model over the same tokens.

    python scripts/train_tiny_mamba.py               # about 10 minutes of training on 2 cores
    python scripts/train_tiny_mamba.py --steps 500   # a fixed number of steps

Without ``--steps`` the step count is derived from ``--minutes`` by timing the first batch, so it
depends on the machine and its load; the report records it, and ``--steps`` with that number
repeats the run (same seed and thread count give the same weights).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import quamba.models.mamba as mamba_module  # noqa: E402
from quamba.models import MambaConfig, MambaLMHeadModel, save_model  # noqa: E402
from quamba.ops.scan.selective_scan import selective_scan  # noqa: E402

DATA_DIR = REPO_ROOT.parent / "shared" / "data"
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "tiny-mamba"
EOS = "<|endoftext|>"
PAD = "<|padding|>"
VOCAB_SIZE = 4096
MAX_FIXTURE_BYTES = 8_000_000
EVAL_WINDOW = 1024
SHAKESPEARE_DOC_CHARS = 2000  # tiny-shakespeare is one text: cut into documents of about this size


def tiny_config() -> MambaConfig:
    return MambaConfig(d_model=192, n_layer=4, vocab_size=VOCAB_SIZE, d_state=16, expand=2,
                       pad_vocab_size_multiple=8)


# --- data ---------------------------------------------------------------------------------------

def read_jsonl_field(path: Path, field: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[field] for line in f if line.strip()]


def shakespeare_documents(text: str) -> list[str]:
    """Consecutive speeches (blank-line separated) grouped into documents of ~2000 characters."""
    documents, current = [], []
    for speech in text.split("\n\n"):
        current.append(speech)
        if sum(len(s) for s in current) >= SHAKESPEARE_DOC_CHARS:
            documents.append("\n\n".join(current))
            current = []
    if current:
        documents.append("\n\n".join(current))
    return documents


def training_documents(data_dir: Path) -> list[str]:
    c4 = read_jsonl_field(data_dir / "text" / "c4_sample.jsonl", "text")
    shakespeare = (data_dir / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    return c4 + shakespeare_documents(shakespeare)


def split_train_val(documents: list[str], val_fraction: float, seed: int):
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(val_fraction * len(documents)))
    return [documents[i] for i in order[n_val:]], [documents[i] for i in order[:n_val]]


def split_documents(args) -> tuple[list[str], list[str]]:
    """The training and validation documents of ``args.data_dir``, split by ``args.seed``."""
    return split_train_val(training_documents(args.data_dir), args.val_fraction, args.seed)


# --- tokenizer ----------------------------------------------------------------------------------

def train_tokenizer(texts: list[str]):
    """A GPT-NeoX-style byte-level BPE: <|endoftext|> = 0 (bos/eos/unk), <|padding|> = 1."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS, PAD], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    if bpe.get_vocab_size() != VOCAB_SIZE or bpe.token_to_id(EOS) != 0 or bpe.token_to_id(PAD) != 1:
        raise RuntimeError(f"tokenizer came out with {bpe.get_vocab_size()} tokens or wrong special ids")
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS)


def token_stream(tokenizer, documents: list[str]) -> torch.Tensor:
    """All documents as one 1-D stream, each preceded by <|endoftext|>."""
    ids = []
    for doc_ids in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        ids.append(tokenizer.eos_token_id)
        ids.extend(doc_ids)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    """Non-overlapping windows [n, length] (the incomplete tail is dropped)."""
    n = stream.numel() // length
    return stream[:n * length].view(n, length)


class Corpus(NamedTuple):
    """The training and validation documents and their token streams."""

    train_docs: list[str]
    val_docs: list[str]
    train_stream: torch.Tensor
    val_stream: torch.Tensor


def tokenize_corpus(tokenizer, train_docs: list[str], val_docs: list[str]) -> Corpus:
    corpus = Corpus(train_docs, val_docs, token_stream(tokenizer, train_docs),
                    token_stream(tokenizer, val_docs))
    print(f"{len(train_docs)} training documents, {corpus.train_stream.numel()} tokens; "
          f"{len(val_docs)} validation documents, {corpus.val_stream.numel()} tokens", flush=True)
    return corpus


# --- a faster scan for backprop -----------------------------------------------------------------

@contextlib.contextmanager
def one_thread():
    """Run the loops over time on one thread: their [b, d, n] steps are too small to split, and
    on a busy machine waiting for a second thread at every step costs milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _SelectiveScanCore(torch.autograd.Function):
    """The recurrence of ``quamba.ops.scan.selective_scan``, time-major, with a hand-written
    backward.

    delta (after softplus), u: [t, b, d]; A: [d, n]; B, C: [t, b, n]. Returns y [t, b, d] with
    y[t] = C[t] · h[t], h[t] = exp(delta[t] A) * h[t-1] + delta[t] u[t] B[t], and h[last].
    Autograd through a Python loop over time records a graph node per step, and the library's
    writes into a [.., t, ..] buffer make every node's backward touch the whole buffer; this
    backward is the same loop run in reverse on [b, d, n] blocks.
    """

    @staticmethod
    def forward(ctx, delta, u, A, B, C):
        drive_scale = delta * u
        states = delta.new_empty(*delta.shape, A.shape[1])
        state = delta.new_zeros(*delta.shape[1:], A.shape[1])
        with one_thread():
            for t in range(len(delta)):
                decay = torch.exp(delta[t, :, :, None] * A)
                state = decay * state + drive_scale[t, :, :, None] * B[t, :, None, :]
                states[t] = state
        ctx.save_for_backward(delta, u, A, B, C, states)
        return (states * C[:, :, None, :]).sum(-1), state.clone()

    @staticmethod
    def backward(ctx, grad_y, grad_last_state):
        delta, u, A, B, C, states = ctx.saved_tensors
        grad_y, drive_scale = grad_y.contiguous(), delta * u
        grad_drive_scale, grad_B = torch.empty_like(delta), torch.empty_like(B)
        grad_log_decay = torch.empty_like(states)  # d loss / d (delta[t] A)
        grad_state = (torch.zeros_like(states[0]) if grad_last_state is None
                      else grad_last_state.clone())
        with one_thread():
            for t in range(len(delta) - 1, -1, -1):
                grad_state = grad_state + grad_y[t, :, :, None] * C[t, :, None, :]
                grad_drive_scale[t] = (grad_state * B[t, :, None, :]).sum(-1)
                grad_B[t] = (grad_state * drive_scale[t, :, :, None]).sum(1)
                decay = torch.exp(delta[t, :, :, None] * A)
                previous = states[t - 1] if t > 0 else torch.zeros_like(states[0])
                grad_log_decay[t] = grad_state * decay * previous
                grad_state = grad_state * decay
        grad_delta = (grad_log_decay * A).sum(-1) + grad_drive_scale * u
        grad_A = (grad_log_decay * delta[..., None]).sum((0, 1))
        grad_C = (states * grad_y[..., None]).sum(2)
        return grad_delta, grad_drive_scale * delta, grad_A, grad_B, grad_C


def training_selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                            delta_softplus=False):
    """``quamba.ops.scan.selective_scan`` (without initial_state) computed by
    ``_SelectiveScanCore``: the same arithmetic step for step with a far faster backward.
    ``check_training_scan`` compares the two before training starts."""
    out_dtype = u.dtype
    u, delta, A, B, C = u.float(), delta.float(), A.float(), B.float(), C.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[None, :, None]
    if delta_softplus:
        delta = F.softplus(delta)
    time_major = [x.permute(2, 0, 1).contiguous() for x in (delta, u, B, C)]
    y, last_state = _SelectiveScanCore.apply(time_major[0], time_major[1], A, *time_major[2:])
    y = y.permute(1, 2, 0)
    if D is not None:
        y = y + u * D.float()[None, :, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(out_dtype), last_state


def training_scan():
    """Context in which quamba's mixers run ``training_selective_scan``."""
    return mock.patch.object(mamba_module, "selective_scan", training_selective_scan)


def check_training_scan(seed: int = 0, rtol: float = 1e-5) -> None:
    """Raise unless the training scan matches the library op in outputs, last state and gradients
    (sequence longer than the library's time chunk, so its chunk boundary is covered)."""
    gen = torch.Generator().manual_seed(seed)
    batch, d_inner, d_state, seqlen = 2, 12, 4, 300
    shapes = {"u": (batch, d_inner, seqlen), "delta": (batch, d_inner, seqlen),
              "B": (batch, d_state, seqlen), "C": (batch, d_state, seqlen), "D": (d_inner,),
              "z": (batch, d_inner, seqlen), "delta_bias": (d_inner,)}
    inputs = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    inputs["A"] = -torch.rand(d_inner, d_state, generator=gen) * 8 - 0.5
    results = []
    for scan in (selective_scan, training_selective_scan):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        y, last = scan(leaves["u"], leaves["delta"], leaves["A"], leaves["B"], leaves["C"], leaves["D"],
                       z=leaves["z"], delta_bias=leaves["delta_bias"], delta_softplus=True)
        ((y * torch.linspace(-1, 1, seqlen)).sum() + last.sum()).backward()
        results.append({"y": y, "last_state": last, **{f"grad {k}": v.grad for k, v in leaves.items()}})
    for name, expected in results[0].items():
        got = results[1][name]
        error = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()
        if error > rtol:
            raise RuntimeError(f"training scan differs from quamba's selective_scan in {name}: "
                               f"relative error {error:.2e}")


# --- model and training -------------------------------------------------------------------------

def new_model(config: MambaConfig, seed: int) -> MambaLMHeadModel:
    """mamba_ssm's training initialisation of what Mamba1 and Mamba2 models share: embedding
    N(0, 0.02), zero linear biases, out_proj scaled down by sqrt(n_layer); the SSM parameters as
    the mixers initialise them."""
    torch.manual_seed(seed)
    model = MambaLMHeadModel(config)
    with torch.no_grad():
        torch.nn.init.normal_(model.backbone.embedding.weight, std=0.02)
        for mixer in model.mixers():
            for linear in (mixer.in_proj, mixer.out_proj):
                if linear.bias is not None:
                    linear.bias.zero_()
            mixer.out_proj.weight.div_(math.sqrt(config.n_layer))
    return model


def build_model(config: MambaConfig, seed: int) -> MambaLMHeadModel:
    """``new_model``, with mamba_ssm's dt_proj weight: uniform in ±dt_rank^-0.5."""
    model = new_model(config, seed)
    bound = config.dt_rank ** -0.5
    with torch.no_grad():
        for mixer in model.mixers():
            torch.nn.init.uniform_(mixer.dt_proj.weight, -bound, bound)
    return model


def make_optimizer(model, lr: float, weight_decay: float):
    """AdamW; weight decay on matrices only (never on A_log, as in mamba_ssm)."""
    decayed, plain = [], []
    for name, param in model.named_parameters():
        (decayed if param.dim() >= 2 and not name.endswith("A_log") else plain).append(param)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, total: int, peak: float, warmup: int, floor_ratio: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to ``floor_ratio * peak`` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - 1 - warmup)
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def training_batches(stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
    """Endless [batch, seq_len + 1] batches of non-overlapping chunks, reshuffled every epoch."""
    chunks = windows(stream, seq_len + 1)
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(chunks), generator=gen)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield chunks[order[start:start + batch_size]]


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def steps_for_budget(model, stream: torch.Tensor, args) -> int:
    """How many steps fit in ``args.minutes``, from the time of a forward and backward pass on
    one batch (after a warm-up pass; no update, gradients discarded)."""
    batch = windows(stream, args.seq_len + 1)[:args.batch_size]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        lm_loss(model, batch).backward()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    steps = max(1, int(args.minutes * 60 / (1.1 * min(times[1:]))))
    print(f"{min(times[1:]):.2f} s per step: {steps} steps in {args.minutes:g} minutes", flush=True)
    return steps


def train_for_budget(model, train_stream: torch.Tensor, args) -> tuple[list[float], float]:
    """``train`` for ``args.steps`` steps, or as many as fit in ``args.minutes``: the loss of every
    step and the seconds the steps took."""
    steps = args.steps or steps_for_budget(model, train_stream, args)
    started = time.perf_counter()
    batches = training_batches(train_stream, args.seq_len, args.batch_size, args.seed)
    losses = train(model.train(), batches, steps, args)
    return losses, time.perf_counter() - started


def train(model, batches, steps: int, args) -> list[float]:
    """Run ``steps`` AdamW updates; returns the loss of every step."""
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    warmup = min(args.warmup, steps // 10 + 1)
    losses, started = [], time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, warmup)
        loss = lm_loss(model, next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == steps:
            recent = losses[-args.log_every:]
            print(f"step {step + 1}/{steps}  loss {sum(recent) / len(recent):.3f}  "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    return losses


# --- evaluation ---------------------------------------------------------------------------------

@torch.inference_mode()
def mean_nll(model, sequences: torch.Tensor, batch_size: int) -> tuple[float, int]:
    """Mean next-token negative log-likelihood (nats) over every position after the first of each
    sequence, and the number of tokens scored."""
    total, count = 0.0, 0
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start:start + batch_size]
        logits = model(batch[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count, count


def unigram_nll(train_stream: torch.Tensor, sequences: torch.Tensor, vocab_size: int) -> float:
    """Mean NLL of the same positions as ``mean_nll`` under an add-one-smoothed unigram model
    fitted on the training tokens."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    log_probs = counts.log() - counts.sum().log()
    return -log_probs[sequences[:, 1:].flatten()].mean().item()


@torch.inference_mode()
def library_logit_error(model, sequences: torch.Tensor) -> float:
    """Largest |logit| difference between the library's selective_scan and the training scan.

    The evaluation runs on the training scan, whose time loop runs on one thread (the library's
    is several times slower on a busy 2-core machine); this shows both compute the same model."""
    library = model(sequences)
    with training_scan():
        fast = model(sequences)
    return (library - fast).abs().max().item()


def wikitext_path(data_dir: Path) -> Path:
    return data_dir / "eval" / "wikitext2_test_docs.jsonl"


def heldout_windows(tokenizer, data_dir: Path) -> torch.Tensor:
    """wikitext-2 test as EVAL_WINDOW-token windows, every document preceded by <|endoftext|>."""
    documents = read_jsonl_field(wikitext_path(data_dir), "page")
    return windows(token_stream(tokenizer, documents), EVAL_WINDOW)


def score(model, eval_windows: torch.Tensor, corpus: Corpus, args) -> dict:
    """Validation loss, and wikitext-2 test perplexity of the model and of the unigram baseline."""
    val_loss, _ = mean_nll(model, windows(corpus.val_stream, args.seq_len + 1), args.batch_size)
    model_nll, scored = mean_nll(model, eval_windows, batch_size=4)
    unigram = unigram_nll(corpus.train_stream, eval_windows, VOCAB_SIZE)
    return {
        "val_loss": round(val_loss, 4),
        "heldout": {"file": relative_to_repo(wikitext_path(args.data_dir)), "field": "page",
                    "documents_joined_with": EOS, "window": EVAL_WINDOW, "windows": len(eval_windows),
                    "tokens_scored": scored, "perplexity": round(math.exp(model_nll), 3),
                    "unigram_add_one_perplexity": round(math.exp(unigram), 3)},
    }


def evaluate(model, tokenizer, corpus: Corpus, args) -> dict:
    """``score`` on the training scan, once it is shown to agree with the library's on the
    trained model."""
    eval_windows = heldout_windows(tokenizer, args.data_dir)
    logit_error = library_logit_error(model, eval_windows[:1])
    if logit_error > 1e-3:
        raise RuntimeError(f"training scan and library disagree on the trained model ({logit_error:.2e})")
    with training_scan():
        results = score(model, eval_windows, corpus, args)
    results["heldout"]["library_scan_max_abs_logit_diff"] = logit_error
    return results


# --- output -------------------------------------------------------------------------------------

def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_fixture(model, tokenizer, out_dir: Path, layout: str = "transformers") -> str:
    """Save in fp32 if the directory stays within MAX_FIXTURE_BYTES, else in fp16."""
    save_model(model, out_dir, layout=layout, tokenizer=tokenizer)
    if directory_bytes(out_dir) <= MAX_FIXTURE_BYTES:
        return "fp32"
    from quamba.models.loading import cast_model
    save_model(cast_model(model, torch.float16), out_dir, layout=layout, tokenizer=tokenizer)
    return "fp16"


def relative_to_repo(path: Path) -> str:
    """``path`` as the repository sees it (../shared/data/... for the shared data)."""
    return Path(os.path.relpath(path.resolve(), REPO_ROOT)).as_posix()


def tokenizer_report(**origin) -> dict:
    """The tokenizer section of the report; ``origin`` says where it came from."""
    return {"kind": "byte-level BPE (tokenizers)", "vocab_size": VOCAB_SIZE,
            "special_tokens": {EOS: 0, PAD: 1}, **origin}


def data_report(corpus: Corpus, args) -> dict:
    return {"sources": [relative_to_repo(args.data_dir / "text" / name)
                        for name in ("c4_sample.jsonl", "tinyshakespeare.txt")],
            "train_documents": len(corpus.train_docs), "val_documents": len(corpus.val_docs),
            "train_tokens": corpus.train_stream.numel(), "val_tokens": corpus.val_stream.numel()}


def training_report(losses: list[float], train_seconds: float, args) -> dict:
    """The training section of the report and the mean loss of the last ``args.log_every`` steps."""
    steps, final_losses = len(losses), losses[-args.log_every:]
    return {
        "training": {"seed": args.seed, "steps": steps, "batch_size": args.batch_size,
                     "seq_len": args.seq_len, "tokens_seen": steps * args.batch_size * args.seq_len,
                     "seconds": round(train_seconds, 1), "optimizer": "AdamW, betas (0.9, 0.95)",
                     "peak_lr": args.lr, "schedule": "linear warm-up, cosine to 10%",
                     "weight_decay": args.weight_decay, "grad_clip": 1.0,
                     "torch_threads": args.threads},
        "train_loss": round(sum(final_losses) / len(final_losses), 4),
    }


def write_report(report: dict, out_dir: Path, saved_dtype: str, started: float) -> None:
    """Complete ``report`` with the fixture's dtype, size and the run's time, write it to
    out_dir/training_report.json and print a summary."""
    report.update({"saved_dtype": saved_dtype, "fixture_bytes": directory_bytes(out_dir),
                   "total_seconds": round(time.perf_counter() - started, 1)})
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    training, heldout = report["training"], report["heldout"]
    print(f"{training['steps']} steps, {training['seconds'] / 60:.1f} min of training; fixture "
          f"{report['fixture_bytes'] / 1e6:.2f} MB ({saved_dtype})")
    print(f"wikitext-2 test perplexity: model {heldout['perplexity']:.2f}, "
          f"unigram {heldout['unigram_add_one_perplexity']:.2f}")


def set_up_torch(args) -> None:
    """``args.threads`` threads and deterministic kernels, so ``--steps`` repeats a run."""
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)


def parse_args(argv=None, doc: str = __doc__, out_dir: Path = OUT_DIR):
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    parser.add_argument("--steps", type=int, default=None, help="fixed step count (overrides --minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--val-fraction", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--out", type=Path, default=out_dir)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    set_up_torch(args)
    check_training_scan()

    train_docs, val_docs = split_documents(args)
    tokenizer = train_tokenizer(train_docs)
    corpus = tokenize_corpus(tokenizer, train_docs, val_docs)

    config = tiny_config()
    model = build_model(config, args.seed)
    with training_scan():
        losses, train_seconds = train_for_budget(model, corpus.train_stream, args)
    results = evaluate(model.eval(), tokenizer, corpus, args)
    saved_dtype = save_fixture(model, tokenizer, args.out)

    report = {"config": config.to_dict(),
              "tokenizer": tokenizer_report(trained_on="the training documents"),
              "data": data_report(corpus, args), **training_report(losses, train_seconds, args),
              **results}
    write_report(report, args.out, saved_dtype, started)


if __name__ == "__main__":
    main()
