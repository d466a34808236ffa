"""A W4A16 Mamba1 layer's SSM side at decode, Mamba-2.8B's sizes (d_inner 5120, d_state 16, dt_rank
160, conv width 4, x_proj in groups of 128, float16): w4a16_ssm_step's cluster kernel against the
chain of CUDA ops it replaces (causal-conv1d's conv update, the 4-bit GEMV, cuBLAS, mamba-ssm's
Triton step; without mamba-ssm its FP ops run their torch references and the script says so), at
batch 1, 2, 4 and 8.

Each is the median over 20 replays of a CUDA graph of 256 steps on the same tensors, in µs a step
(common.time_graph_ms): the weights stay in L2, so this times the kernels' fixed costs, not their
reads of HBM.

    python benchmarks/bench_w4a16_step.py
"""
from __future__ import annotations

import os
import sys

import common
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests' cases

from quamba.ops import fp_kernels  # noqa: E402
from quamba.ops.fused_decode import w4a16_step_cuda  # noqa: E402
from quamba.ops.fused_decode.w4a16_step import chain_step  # noqa: E402
from tests.ops.w4a16_step_cases import cloned, step_case  # noqa: E402

BATCHES = (1, 2, 4, 8)


def l2_resident_us(call) -> float:
    """µs a call of ``call``, every call of the timed graph on the same tensors."""
    return 1e3 * common.time_graph_ms(lambda _: call, bytes_per_call=1, replays=20)


def main():
    print(torch.cuda.get_device_name(), "chain FP ops:", fp_kernels.missing() or "mamba-ssm")
    for batch in BATCHES:
        case = cloned(step_case(batch, 5120, 16, 160, 4, 128, device="cuda"))
        kernel_us = l2_resident_us(lambda: w4a16_step_cuda.ssm_step(**case))
        chain_us = l2_resident_us(lambda: chain_step(**case, backend_name="cuda"))
        print(f"batch {batch}: kernel {kernel_us:.2f} us, chain {chain_us:.2f} us", flush=True)


if __name__ == "__main__":
    main()
