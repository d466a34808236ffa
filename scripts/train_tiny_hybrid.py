"""Train the tiny Nemotron-H-style hybrid LM that quamba's hybrid tests run on.

The hybrid sibling of scripts/train_tiny_mamba2.py, whose data, split, training loop, optimizer,
learning-rate schedule, evaluation, report and tokenizer (that of tests/fixtures/tiny-mamba) it
reuses: a Nemotron-H (transformers NemotronHForCausalLM) with pattern "M*M-M-", i.e. three Mamba2
layers (8 heads of 32 in 2 groups of B and C, d_state 32, chunks of 64 tokens), one attention
layer (4 heads of 32 over 2 KV heads, no positional encoding) and two relu² MLPs (512 wide),
d_model 128, untied lm_head. It writes tests/fixtures/tiny-hybrid as NemotronHForCausalLM's
save_pretrained writes it (config.json and model.safetensors), with the tokenizer and
training_report.json beside it, and checks that quamba and transformers read it alike.

    python scripts/train_tiny_hybrid.py --threads 1   # about 10 minutes of training
    python scripts/train_tiny_hybrid.py --steps 1200  # a fixed number of steps

On two cores that another process shares, one thread trains about ten times faster than two (0.4
against 5 s a step here: two threads wait on each other); the fixture was trained with one.
"""
from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_tiny_mamba as base  # noqa: E402  (it puts the repository root on sys.path)
import train_tiny_mamba2 as mamba2  # noqa: E402

from quamba.models import load_model  # noqa: E402
from quamba.models.loading import to_transformers_names  # noqa: E402
from quamba.models.nemotron_h import NemotronHConfig, NemotronHLM  # noqa: E402

OUT_DIR = base.REPO_ROOT / "tests" / "fixtures" / "tiny-hybrid"
FIRST_WINDOWS = mamba2.FIRST_WINDOWS  # held-out windows the fixture test scores again
HF_CONFIG = dict(vocab_size=base.VOCAB_SIZE, hidden_size=128, hybrid_override_pattern="M*M-M-",
                 mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=32,
                 chunk_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=512, tie_word_embeddings=False, bos_token_id=0,
                 eos_token_id=0, pad_token_id=1)
OUTPUT_LINEARS = ("out_proj", "o_proj", "down_proj")  # each layer's linear into the residual


def transformers_config():
    from transformers import NemotronHConfig as HFNemotronHConfig
    return HFNemotronHConfig(**HF_CONFIG)


def new_model(config: NemotronHConfig, seed: int) -> NemotronHLM:
    """base.new_model's initialisation for the hybrid: embedding N(0, 0.02), every layer's output
    linear scaled down by sqrt(n_layer); the Mamba2 parameters as the mixer initialises them."""
    torch.manual_seed(seed)
    model = NemotronHLM(config)
    with torch.no_grad():
        torch.nn.init.normal_(model.backbone.embedding.weight, std=0.02)
        for layer in model.mixers():
            for name in OUTPUT_LINEARS:
                if hasattr(layer, name):
                    getattr(layer, name).weight.div_(math.sqrt(config.n_layer))
    return model


def save_fixture(model: NemotronHLM, tokenizer, out_dir: Path):
    """Write ``model`` through transformers' NemotronHForCausalLM.save_pretrained (its tensor
    names checked by a strict load) and the tokenizer; returns the transformers model."""
    from transformers import NemotronHForCausalLM
    reference = NemotronHForCausalLM(transformers_config()).eval()
    state = to_transformers_names(model.state_dict())  # the checkpoint's names: backbone.*
    reference.load_state_dict({re.sub(r"^backbone\.", "model.", k): v.detach().clone()
                               for k, v in state.items()}, strict=True)  # its modules': model.*
    reference.save_pretrained(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    if base.directory_bytes(out_dir) > base.MAX_FIXTURE_BYTES:
        raise RuntimeError(f"{out_dir} holds {base.directory_bytes(out_dir)} bytes, more than "
                           f"{base.MAX_FIXTURE_BYTES}")
    return reference


@torch.inference_mode()
def check_saved(model_dir: Path, reference, eval_windows: torch.Tensor) -> dict:
    """Perplexity of the saved fixture, as ``quamba.load_model`` reads it, on the first
    FIRST_WINDOWS held-out windows (the number tests/models/test_fixture_hybrid.py recomputes),
    and the relative error of its logits against transformers' model on the first 256 tokens."""
    model, _ = load_model(model_dir, tokenizer=False)
    nll, _ = base.mean_nll(model, eval_windows[:FIRST_WINDOWS], batch_size=FIRST_WINDOWS)
    tokens = eval_windows[:1, :256]
    ours, theirs = model(tokens).float(), reference(tokens).logits.float()
    return {"windows": FIRST_WINDOWS, "perplexity": round(math.exp(nll), 3),
            "transformers_logits_rel_error": float((ours - theirs).norm() / theirs.norm())}


def main(argv=None) -> None:
    args = base.parse_args(argv, doc=__doc__, out_dir=OUT_DIR)
    started = time.perf_counter()
    base.set_up_torch(args)
    mamba2.check_ssd_gradients()

    tokenizer = mamba2.shared_tokenizer()
    corpus = base.tokenize_corpus(tokenizer, *base.split_documents(args))

    config = NemotronHConfig.from_transformers(transformers_config().to_dict())
    model = new_model(config, args.seed)
    losses, train_seconds = base.train_for_budget(model, corpus.train_stream, args)
    eval_windows = base.heldout_windows(tokenizer, args.data_dir)
    results = base.score(model.eval(), eval_windows, corpus, args)
    reference = save_fixture(model, tokenizer, args.out)
    results["heldout"]["first_windows"] = check_saved(args.out, reference, eval_windows)

    report = {"config": config.to_dict(),
              "tokenizer": base.tokenizer_report(
                  trained_on="the training documents",
                  loaded_from=base.relative_to_repo(mamba2.TOKENIZER_DIR)),
              "data": base.data_report(corpus, args),
              **base.training_report(losses, train_seconds, args), **results}
    base.write_report(report, args.out, "fp32", started)


if __name__ == "__main__":
    main()
