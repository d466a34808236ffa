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

from bench_ssm import D_INNER, D_STATE, DEVICE, DT_RANK, _step_op_args, codes, load_baselines, ssm_params


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
    baseline = load_baselines()["fns"].get("selective_state_update")
    if baseline is not None:
        half = dict(dtype=torch.float16, device=DEVICE)
        state16 = torch.randn(batch, D_INNER, D_STATE, **half)
        x16, dt16, z16 = (torch.randn(batch, D_INNER, **half) for _ in range(3))
        B16, C16 = (torch.randn(batch, D_STATE, **half) for _ in range(2))
        A = -torch.arange(1, D_STATE + 1, device=DEVICE).float().expand(D_INNER, D_STATE)
        D, dt_bias = torch.ones(D_INNER, device=DEVICE), torch.full((D_INNER,), -4.0, device=DEVICE)
        for _ in range(2):
            baseline(state16, x16, dt16, A, B16, C16, D, z=z16, dt_bias=dt_bias, dt_softplus=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
