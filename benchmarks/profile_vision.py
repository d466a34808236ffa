"""Forward time of a Vision Mamba classifier per precision: FP16 (quamba's VisionMamba on mamba-ssm's
and causal-conv1d's kernels) against W8A8 and W4A8 (quamba's kernels), random weights at a
published Vim shape, one batch of images.

    python benchmarks/profile_vision.py [--config vim-small] [--batch 64] [--precisions fp16,w8a8,w4a8]
        [--repeats 20] [--out result.json]

Each row: the median of --repeats forwards timed with CUDA events after warm-up, run eagerly and
replayed from a CUDA graph (the same forward captured once), its weight bytes, and the backend of
every op that ran. Ratios are to the FP16 row. A quantized row that ran a quantized op on its
torch reference, or any row that ran an FP op on its reference (mamba-ssm not installed), makes
the script exit with status 1: those numbers would be the references', not the kernels'.
Quantized models are calibrated on random images: their scales are meaningless, their speed is not.
"""
from __future__ import annotations

import argparse
import sys

import torch

from common import check_backends, format_table, median_ms, run_metadata, write_json

from quamba import QuantConfig, quantize
from quamba.models.mamba import randomize_
from quamba.models.vision import VISION_PRESETS, VisionMamba, vision_preset
from quamba.ops import backend

PRECISIONS = {"fp16": None, "w8a8": (8, 8), "w4a8": (4, 8)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=list(VISION_PRESETS), default="vim-small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--group_size", type=int,
                        help="W4A8 group size (default 128, or 64 where d_model is no multiple of 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    args.precisions = [p for p in args.precisions.split(",") if p]
    unknown = set(args.precisions) - set(PRECISIONS)
    if unknown:
        parser.error(f"unknown precision {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        parser.error("profiling needs a CUDA GPU")
    return args


def graphed(fn):
    """``fn`` (reading only static tensors) captured once in a CUDA graph; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def weight_bytes(model) -> int:
    return sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))


def measure(name: str, model, images, repeats: int) -> dict:
    with torch.inference_mode(), backend.recording() as ran:
        def forward():
            return model(images)
        eager = median_ms(forward, repeats, warmup=3)
        replay = graphed(forward)
        graph = median_ms(replay, repeats, warmup=3)
    return {"name": name, "eager_ms": eager, "graph_ms": graph, "weights_mb": weight_bytes(model) / 1e6,
            "backends": backend.summary(ran), "reference_ops": backend.on_reference(ran),
            "reference_fp_ops": backend.on_reference(ran, backend.fp_ops())}


def run(args) -> dict:
    config = vision_preset(args.config)
    fp_model = randomize_(VisionMamba(config, device="cuda", dtype=torch.float16).eval(), seed=args.seed)
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    shape = (args.batch, config.channels, config.img_size, config.img_size)
    images = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    calib = torch.randn((16, *shape[1:]), device="cuda", dtype=torch.float16, generator=gen)
    group_size = args.group_size or (128 if config.d_model % 128 == 0 else 64)
    rows = []
    for precision in args.precisions:
        print(f"profiling {precision} ...", file=sys.stderr, flush=True)
        if precision == "fp16":
            rows.append(measure("quamba fp16", fp_model, images, args.repeats))
            continue
        w_bits, a_bits = PRECISIONS[precision]
        quant_config = QuantConfig(w_bits=w_bits, a_bits=a_bits, group_size=group_size,
                                   calib_num_samples=16)
        qmodel = quantize(fp_model, config=quant_config, calib_data=calib, progress=False)
        rows.append(measure(f"quamba {precision}", qmodel, images, args.repeats))
        del qmodel
        torch.cuda.empty_cache()
    anchor = next((row for row in rows if row["name"] == "quamba fp16"), None)
    for row in rows:
        if anchor is not None:
            row["eager_speedup"] = anchor["eager_ms"] / row["eager_ms"]
            row["graph_speedup"] = anchor["graph_ms"] / row["graph_ms"]
    return {"meta": run_metadata(), "model": args.config, "config": config.to_dict(),
            "batch": args.batch, "tokens": config.seqlen, "repeats": args.repeats, "rows": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    meta = result["meta"]
    title = (f"{args.config} batch {args.batch} ({result['tokens']} tokens) on {meta['device']} "
             f"({meta['date']}, commit {meta['commit']})")
    columns = ["name", "eager_ms", "graph_ms", "eager_speedup", "graph_speedup", "weights_mb"]
    print(format_table(result["rows"], columns, title))
    for row in result["rows"]:
        print(f"{row['name']}: backends: " + ", ".join(f"{op} {n}" for op, n in row["backends"].items()))
    write_json(args.out, result)
    return check_backends(result["rows"], flags=(None, None))


if __name__ == "__main__":
    sys.exit(main())
