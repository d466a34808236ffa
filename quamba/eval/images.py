"""Labelled image sets for Vision Mamba classifiers (calibration and evaluation), and top-1 accuracy.

* ``digits``: scikit-learn's bundled 8 × 8 handwritten digits (1,797 grey images, 10 classes; no
  download), split once with a fixed seed into 1,437 ``train`` images (training, calibration)
  and 360 ``test`` images (evaluation).
* a directory in the ImageFolder layout: one subdirectory per class, whose sorted names are the
  labels 0, 1, ..., holding PNG or JPEG files; the whole directory is the set.

Images are float tensors in [0, 1], resized to the model's input size where it differs;
:func:`normalize` applies the model's mean and standard deviation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quamba.errors import QuambaError

DIGITS = "digits"
DIGITS_SPLIT_SEED, DIGITS_TRAIN = 0, 1437
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass
class ImageSet:
    name: str
    images: torch.Tensor  # float [n, C, H, W] in [0, 1]
    labels: torch.Tensor  # int64 [n]
    classes: list[str]


def load_image_set(source: str, split: str = "test", img_size: int | None = None,
                   channels: int | None = None) -> ImageSet:
    """``digits`` (``split`` train or test) or an ImageFolder directory, as ``channels`` channels of
    ``img_size`` × ``img_size`` pixels where given."""
    if source == DIGITS:
        image_set = _digits(split)
    elif Path(source).is_dir():
        image_set = _image_folder(Path(source), channels or 3)
    else:
        raise QuambaError(f"unknown image set {source!r}: use '{DIGITS}' or an ImageFolder directory "
                          "(one subdirectory of PNG/JPEG images per class)")
    return _fitted(image_set, img_size, channels)


def _digits(split: str) -> ImageSet:
    from sklearn.datasets import load_digits
    if split not in ("train", "test"):
        raise QuambaError(f"the digits set has the splits train and test, not {split!r}")
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
    part = order[:DIGITS_TRAIN] if split == "train" else order[DIGITS_TRAIN:]
    return ImageSet(f"{DIGITS}-{split}", images[part], labels[part], [str(d) for d in range(10)])


def _image_folder(root: Path, channels: int) -> ImageSet:
    import numpy as np
    from PIL import Image
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((root / name).iterdir()):
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                with Image.open(path) as image:
                    pixels = np.asarray(image.convert("L" if channels == 1 else "RGB"), dtype=np.float32)
            except OSError as exc:
                raise QuambaError(f"cannot read image {path}: {exc}") from None
            tensor = torch.from_numpy(pixels.copy()) / 255.0
            images.append(tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1))
            labels.append(label)
    if not images:
        raise QuambaError(f"{root} holds no PNG or JPEG images in class subdirectories")
    sizes = {tuple(t.shape[1:]) for t in images}
    if len(sizes) > 1:
        side = max(max(size) for size in sizes)
        images = [_resize(t.unsqueeze(0), side)[0] for t in images]
    return ImageSet(root.name, torch.stack(images), torch.tensor(labels), classes)


def _fitted(image_set: ImageSet, img_size: int | None, channels: int | None) -> ImageSet:
    images = image_set.images
    if channels is not None and images.shape[1] != channels:
        if images.shape[1] == 1:
            images = images.expand(-1, channels, -1, -1)
        else:
            raise QuambaError(f"image set {image_set.name} has {images.shape[1]} channels, the model "
                              f"takes {channels}")
    if img_size is not None and tuple(images.shape[2:]) != (img_size, img_size):
        images = _resize(images, img_size)
    return ImageSet(image_set.name, images.contiguous(), image_set.labels, image_set.classes)


def _resize(images: torch.Tensor, side: int) -> torch.Tensor:
    return F.interpolate(images, size=(side, side), mode="bilinear", antialias=True,
                         align_corners=False).clamp(0, 1)


def normalize(images: torch.Tensor, config) -> torch.Tensor:
    """(images - mean) / std with the model config's per-channel image_mean and image_std."""
    mean = torch.tensor(config.image_mean, dtype=images.dtype).view(1, -1, 1, 1)
    std = torch.tensor(config.image_std, dtype=images.dtype).view(1, -1, 1, 1)
    return (images - mean) / std


@torch.no_grad()
def predict(model, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """Predicted labels [n] for images in [0, 1] (normalized here), in batches."""
    parameter = next(model.parameters())
    normed = normalize(images, model.config)
    predictions = []
    for start in range(0, len(normed), batch_size):
        batch = normed[start:start + batch_size].to(parameter.device, parameter.dtype)
        predictions.append(model(batch).argmax(-1).cpu())
    return torch.cat(predictions)


def evaluate_images(model, image_set: ImageSet, batch_size: int = 64) -> dict:
    """Top-1 accuracy with its standard error, and each image's 0/1 correctness (in set order)."""
    if model.config.num_classes < len(image_set.classes):
        raise QuambaError(f"the model has {model.config.num_classes} classes, image set "
                          f"{image_set.name} has {len(image_set.classes)}")
    correct = (predict(model, image_set.images, batch_size) == image_set.labels).long()
    top1 = correct.float().mean().item()
    return {"dataset": image_set.name, "num_images": len(correct), "top1": top1,
            "top1_stderr": math.sqrt(top1 * (1 - top1) / len(correct)), "correct": correct.tolist()}
