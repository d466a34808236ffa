"""The full-A selective scan (quamba.ops.scan.full_scan) on the GPU: its Triton kernel against its
torch reference, d_state 16, L 1024, prefill and one decode step, every discretization.

A is dense and stable per channel; ``--regime mamba`` (default) takes Mamba's ranges (A near
S4D-real's -(n+1) plus a dense coupling, Δ in about [0.001, 0.1]), ``--regime stiff`` the tests'
(A = 0.3 N(0, 1) - 2 I, Δ = softplus(N(0, 1) - 1.5), up to ~2), where the kernel splits steps
into more sub-steps (Δ ||A||∞ ≤ 1.8 each).

    python benchmarks/bench_full_scan.py --out results_full_scan.json [--quick] [--regime stiff]
"""
from __future__ import annotations

import json
import math

import common
import torch

from quamba.ops import backend
from quamba.ops.scan.discretization import METHODS
from quamba.ops.scan.full_scan import full_selective_scan, full_selective_state_update

DEVICE = torch.device("cuda")
D_STATE, SEQLEN = 16, 1024
SHAPES = [(1, 1536), (1, 256), (8, 1536)]
COLUMNS = ["method", "batch", "d_inner", "kernel_us", "reference_us", "speedup", "step_kernel_us",
           "step_reference_us", "step_speedup"]


def add_regime(parser):
    parser.add_argument("--regime", choices=("mamba", "stiff"), default="mamba",
                        help="ranges of A and Δ (see the module docstring)")


def inputs(batch, d_inner, regime):
    def randn(*shape):
        return torch.randn(*shape, device=DEVICE)
    eye = torch.eye(D_STATE, device=DEVICE)
    if regime == "mamba":
        diagonal = -torch.arange(1, D_STATE + 1, device=DEVICE, dtype=torch.float32)
        A = torch.diag_embed(diagonal.expand(d_inner, -1)) + 0.5 * randn(d_inner, D_STATE, D_STATE)
        dt_bias = torch.log(torch.expm1(torch.exp(
            torch.empty(d_inner, device=DEVICE).uniform_(math.log(1e-3), math.log(0.1)))))
        delta = 0.1 * randn(batch, d_inner, SEQLEN)
    else:
        A = 0.3 * randn(d_inner, D_STATE, D_STATE) - 2 * eye
        dt_bias = torch.zeros(d_inner, device=DEVICE)
        delta = randn(batch, d_inner, SEQLEN) - 1.5
    half = dict(u=randn(batch, d_inner, SEQLEN), delta=delta, B=randn(batch, D_STATE, SEQLEN),
                C=randn(batch, D_STATE, SEQLEN), z=randn(batch, d_inner, SEQLEN))
    return dict({k: v.half() for k, v in half.items()}, A=A, D=torch.ones(d_inner, device=DEVICE),
                delta_bias=dt_bias)


def step_inputs(scan):
    return {k: (v[..., 0] if k in ("u", "delta", "B", "C", "z") else v) for k, v in scan.items()}


def timings(batch, d_inner, method, regime, rep_ms):
    scan = inputs(batch, d_inner, regime)
    step = step_inputs(scan)
    state = torch.zeros(batch, d_inner, D_STATE, device=DEVICE)
    drive = torch.zeros_like(state) if method == "foh" else None
    row = {"method": method, "batch": batch, "d_inner": d_inner, "backends": {}}
    for name, key in (("cuda", "kernel_us"), ("torch", "reference_us")):
        fast = name == "cuda"
        with backend.recording() as used:
            row[key] = 1e3 * common.time_ms(lambda: full_selective_scan(
                **scan, delta_softplus=True, discretization=method, backend_name=name),
                warmup_ms=25 if fast else 1, rep_ms=rep_ms if fast else 1)
            row["step_" + key] = 1e3 * common.time_ms(lambda: full_selective_state_update(
                state, **step, delta_softplus=True, discretization=method, drive=drive,
                backend_name=name), warmup_ms=25 if fast else 5, rep_ms=rep_ms if fast else 20)
        row["backends"][key[:-3]] = backend.summary(used)
    row["speedup"] = row["reference_us"] / row["kernel_us"]
    row["step_speedup"] = row["step_reference_us"] / row["step_kernel_us"]
    return row


def main():
    args = common.parse_args(__doc__.splitlines()[0], add_regime)
    torch.manual_seed(0)
    rep_ms = 30 if args.quick else 200
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = [timings(batch, d_inner, method, args.regime, rep_ms)
            for batch, d_inner in shapes for method in METHODS]
    meta = dict(common.run_metadata(), regime=args.regime)
    title = (f"Full-A selective scan on {meta['device']} (d_state {D_STATE}, L {SEQLEN}, fp16 "
             f"inputs, {args.regime} regime; speedup = torch reference / Triton kernel)")
    print(common.format_table(rows, COLUMNS, title))
    payload = {"meta": meta, "rows": rows}
    print(json.dumps(payload))
    common.write_json(args.out, payload)


if __name__ == "__main__":
    main()
