"""Launches the W4A8 and W4A16 decode GEMVs at one Mamba-2.8B layer shape, twice each, for
Nsight Compute to profile (nothing is timed here: ncu measures each launch on its own, with cold
caches and without the overlap that programmatic dependent launch gives in a stream).

    ncu --clock-control none -k regex:mma_gemv_kernel --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        python benchmarks/ncu_gemv4.py [--layer out_proj] [--rows 16] [--splits 8]
"""
from __future__ import annotations

import argparse

import torch

from bench_gemm4 import GROUP, LAYERS, gemv_operands


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", choices=[name for name, *_ in LAYERS], default="out_proj")
    parser.add_argument("--M", type=int, default=1)
    parser.add_argument("--rows", type=int, default=0, help="0: the dispatcher's choice")
    parser.add_argument("--splits", type=int, default=0, help="0: the dispatcher's choice")
    args = parser.parse_args()
    import quamba._C  # noqa: F401

    ops = torch.ops.quamba
    _, N, K, _ = next(layer for layer in LAYERS if layer[0] == args.layer)
    o = gemv_operands(args.M, N, K)
    out = torch.empty(args.M, N, dtype=torch.float16, device="cuda")
    for _ in range(2):
        ops.w4a8_gemv_out(o["x8"], o["packed"], o["multipliers"], GROUP, 0.0, o["per_channel"], out, args.rows,
                          args.splits)
    for _ in range(2):
        ops.w4a16_gemv_out(o["x16"], o["packed"], o["scales"], GROUP, out, args.rows, args.splits)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
