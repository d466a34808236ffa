"""Launches Mamba-2.8B's decode-step scan at one batch size, quamba's ``qsscan_update`` (int8
state; every lanes-per-channel variant, or one) and mamba-ssm's ``selective_state_update`` (fp16
state) where it is installed, twice each, for Nsight Compute to profile (nothing is timed here).

    ncu --clock-control none -k regex:"update_kernel" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        --section MemoryWorkloadAnalysis python benchmarks/ncu_decode_step.py [--batch 64] [--lanes 1]
"""
from __future__ import annotations

import argparse

import torch

from bench_ssm import (D_INNER, D_STATE, DT_RANK, _step_op_args, baseline_step, codes,
                       load_baselines, ssm_params)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lanes", type=int, default=0, help="0: every variant (16, 4, 1)")
    args = parser.parse_args()
    import quamba._C  # noqa: F401

    batch, params = args.batch, ssm_params()
    state = codes(batch, D_INNER, D_STATE)
    x_dbl = codes(batch, DT_RANK + 2 * D_STATE)  # B and C as x_proj's output holds them
    B, C = x_dbl[:, DT_RANK:DT_RANK + D_STATE], x_dbl[:, DT_RANK + D_STATE:]
    op_args = _step_op_args(state, codes(batch, D_INNER), codes(batch, D_INNER), B, C,
                            codes(batch, D_INNER), params)
    for lanes in ([args.lanes] if args.lanes else [16, 4, 1]):
        for _ in range(2):
            torch.ops.quamba.qsscan_update(*op_args, lanes=lanes)
    fn = load_baselines()["fns"].get("selective_state_update")
    if fn is not None:
        step = baseline_step(fn, batch)
        for _ in range(2):
            step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
