"""Train the tiny Vision Mamba classifier that quamba's tests run on.

A 4-layer bidirectional (Vim "v2") classifier with a middle class token, d_model 48 and d_inner 96
(12 times a power of two: the Hadamard rotation meets a non-power-of-two size), on scikit-learn's
8 × 8 digits (patches of 2 × 2: 16 patches and the class token), trained with quamba's own
``VisionMamba`` on the digits train split (1,437 images) and scored on its test split (360). It is
written to tests/fixtures/tiny-vim in hustvl/Vim's layout: a config.json of Vim's model arguments
and a training checkpoint ``tiny_vim_digits.pth`` whose "model" entry is the state dict (with the
training arguments beside it, as Vim's own checkpoints), and training_report.json.

    python scripts/train_tiny_vim.py        # about 3 minutes on 2 cores

Same seed and thread count give the same weights.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from quamba.eval.images import evaluate_images, load_image_set, normalize  # noqa: E402
from quamba.models.vision import VisionMamba, VisionMambaConfig  # noqa: E402

OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "tiny-vim"
CHECKPOINT = "tiny_vim_digits.pth"
VIM_ARGS = {  # hustvl/Vim's VisionMamba arguments, plus the channel count and normalization
    "img_size": 8, "patch_size": 2, "stride": 2, "channels": 1, "embed_dim": 48, "depth": 4,
    "d_state": 16, "num_classes": 10, "rms_norm": True, "residual_in_fp32": True,
    "fused_add_norm": True, "final_pool_type": "mean", "if_abs_pos_embed": True, "if_rope": False,
    "bimamba_type": "v2", "if_cls_token": True, "use_middle_cls_token": True, "if_divide_out": True,
    "image_mean": [0.5], "image_std": [0.5],
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def shifted(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each image moved by up to one pixel in each direction (zero fill): the only augmentation."""
    padded = F.pad(images, (1, 1, 1, 1))
    dy, dx = torch.randint(0, 3, (2,), generator=gen).tolist()
    return padded[..., dy:dy + images.shape[2], dx:dx + images.shape[3]]


def train(model: VisionMamba, images, labels, args) -> list[float]:
    """AdamW with a cosine schedule; returns the mean loss of each epoch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = math.ceil(len(labels) / args.batch_size)
    total = args.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / steps_per_epoch) * 0.5 * (1 + math.cos(math.pi * step / total)))
    gen = torch.Generator().manual_seed(args.seed)
    losses = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(labels), generator=gen)
        epoch_loss = 0.0
        for start in range(0, len(labels), args.batch_size):
            batch = order[start:start + args.batch_size]
            logits = model(normalize(shifted(images[batch], gen), model.config))
            loss = F.cross_entropy(logits, labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            epoch_loss += loss.item() * len(batch)
        losses.append(epoch_loss / len(labels))
        print(f"epoch {epoch + 1}/{args.epochs}: loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = VisionMambaConfig.from_vim_args(VIM_ARGS)
    model = VisionMamba(config)
    train_set, test_set = load_image_set("digits", "train"), load_image_set("digits", "test")
    began = time.perf_counter()
    losses = train(model.train(), train_set.images, train_set.labels, args)
    seconds = time.perf_counter() - began
    model.eval()
    report = {
        "command": "python scripts/train_tiny_vim.py " + " ".join(argv or sys.argv[1:]),
        "config": config.to_dict(), "vim_args": VIM_ARGS,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_images": len(train_set.labels), "test_images": len(test_set.labels),
        "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
        "weight_decay": args.weight_decay, "seed": args.seed, "threads": args.threads,
        "train_seconds": round(seconds, 1), "epoch_losses": [round(x, 5) for x in losses],
        "train_top1": evaluate_images(model, train_set)["top1"],
        "test_top1": evaluate_images(model, test_set)["top1"], "chance": 0.1,
        "torch": torch.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    training_args = argparse.Namespace(**{k: str(v) if isinstance(v, Path) else v
                                          for k, v in vars(args).items()})
    torch.save({"model": state, "epoch": args.epochs - 1, "args": training_args},
               args.out / CHECKPOINT)
    (args.out / "config.json").write_text(json.dumps(VIM_ARGS, indent=2) + "\n")
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"test top-1 {report['test_top1']:.4f} (train {report['train_top1']:.4f}) after "
          f"{seconds:.0f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
