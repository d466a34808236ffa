"""``python -m quamba.export SAVED_NAME_OR_DIR OUT_DIR [--pretrained_dir D]``: export a saved
quantized model for the serving engines (compressed-tensors; quamba.export). SAVED_NAME_OR_DIR is
a directory, or a model saved under --pretrained_dir by ``main.py --quantize``. The FP parts come
from the model it was quantized from (its recorded base_model, or --fp_model)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from quamba.errors import QuambaError
from quamba.export import FORMATS, export


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m quamba.export",
        description="Export a saved quantized model for the serving engines (compressed-tensors).")
    parser.add_argument("model", metavar="SAVED_NAME_OR_DIR")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--pretrained_dir", "--pretrained-dir", metavar="D",
                        help="where main.py --quantize saved the model")
    parser.add_argument("--fp_model", "--fp-model", metavar="NAME_OR_DIR",
                        help="the FP model it was quantized from (default: its base_model)")
    parser.add_argument("--format", choices=FORMATS, default=FORMATS[0])
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing non-empty OUT_DIR")
    return parser


def saved_model_dir(model: str, pretrained_dir: str | None) -> str:
    """``pretrained_dir/model`` when that directory exists, else ``model``."""
    if pretrained_dir and (Path(pretrained_dir) / model).is_dir():
        return str(Path(pretrained_dir) / model)
    return model


def main(argv: list[str] | None = None) -> int:
    from quamba.models.loading import load_model
    args = build_parser().parse_args(argv)
    try:
        qmodel, tokenizer = load_model(saved_model_dir(args.model, args.pretrained_dir),
                                       dtype="fp32")
        fp_model = (load_model(args.fp_model, dtype="fp16", tokenizer=False)[0]
                    if args.fp_model else None)
        export(qmodel, args.out_dir, args.format, fp_model=fp_model, overwrite=args.overwrite,
               tokenizer=tokenizer)
    except QuambaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
