"""Mamba2's SSD prefill on the GPU: quamba's Triton kernel on int8 inputs (``qssd_scan``, the
int8 path of a Quamba2 layer) and on fp16 inputs (the FP model's ``ssd_scan``), against
mamba-ssm's fp16 SSD (``mamba_chunk_scan_combined``, Triton) where it is installed, and the torch
reference for scale. GPU time per call from CUDA-graph replays (no host time: mamba-ssm's
Python wrapper alone outlasts its kernels at batch 1). Shapes: Mamba2-2.7B's heads (80 heads of
64, one group, d_state 128), batch 1 and 8, L 1024 and 2048.

    python benchmarks/bench_ssd.py --out results_ssd.json [--quick]
"""
from __future__ import annotations

import torch

import common
from quamba.ops.qsscan import SSMParams
from quamba.ops.qssd import qssd_scan
from quamba.ops.quant import quantize_weight
from quamba.ops.ssd import ssd_scan

DEVICE = torch.device("cuda")
NHEADS, HEADDIM, NGROUPS, D_STATE, CHUNK = 80, 64, 1, 128, 256
SHAPES = [(1, 1024), (1, 2048), (8, 2048)]
COLUMNS = ["batch", "seqlen", "int8_us", "fp16_us", "mamba_ssm_us", "reference_us", "int8_speedup"]


def inputs(batch, seqlen):
    def codes(*shape):
        return torch.randint(-127, 128, shape, dtype=torch.int8, device=DEVICE)
    x, dt = codes(batch, seqlen, NHEADS, HEADDIM), codes(batch, seqlen, NHEADS)
    B, C = codes(batch, seqlen, NGROUPS, D_STATE), codes(batch, seqlen, NGROUPS, D_STATE)
    x_scale = torch.full((NHEADS, HEADDIM), 0.02, device=DEVICE)
    group_scale = torch.full((NGROUPS, 1), 0.01, device=DEVICE)
    A_log = torch.log(torch.rand(NHEADS, device=DEVICE) * 15 + 1)
    D, dt_bias = torch.ones(NHEADS, device=DEVICE), torch.full((NHEADS,), -3.0, device=DEVICE)
    params = SSMParams(*quantize_weight(A_log), *quantize_weight(D), *quantize_weight(dt_bias))
    int8 = dict(x=x, x_scale=x_scale, dt=dt, dt_scale=0.01, B=B, B_scale=group_scale, C=C,
                C_scale=group_scale, params=params, chunk_size=CHUNK)
    A, D, dt_bias = params.dequantized()
    fp16 = dict(x=(x.float() * 0.02).half(), dt=(dt.float() * 0.01).half(),
                B=(B.float() * 0.01).half(), C=(C.float() * 0.01).half(), A=A, D=D, dt_bias=dt_bias)
    return int8, fp16


def mamba_ssm_scan():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as exc:
        return None, f"mamba-ssm not installed ({exc}): no fp16 SSD baseline"
    return mamba_chunk_scan_combined, None


def main():
    args = common.parse_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    baseline, note = mamba_ssm_scan()
    rows = []
    for batch, seqlen in SHAPES:
        int8, fp16 = inputs(batch, seqlen)
        io_bytes = 4 * fp16["x"].numel()  # x in, y out, in fp16: what the copies must exceed L2 by
        row = {"batch": batch, "seqlen": seqlen}
        fp_args = [fp16[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")]
        calls = {"int8_us": lambda: qssd_scan(**int8, backend_name="cuda"),
                 "fp16_us": lambda: ssd_scan(*fp_args, CHUNK, backend_name="cuda")}
        if baseline is not None:
            calls["mamba_ssm_us"] = lambda: baseline(
                fp16["x"], fp16["dt"], fp16["A"], fp16["B"], fp16["C"], CHUNK, D=fp16["D"],
                dt_bias=fp16["dt_bias"], dt_softplus=True)
        for column, call in calls.items():
            row[column] = 1e3 * common.time_graph_ms(lambda _, call=call: call, io_bytes,
                                                     replays=5 if args.quick else 30)
        row["reference_us"] = 1e3 * common.time_ms(
            lambda: qssd_scan(**int8, backend_name="torch"), warmup_ms=1, rep_ms=1)
        if baseline is not None:
            row["int8_speedup"] = row["mamba_ssm_us"] / row["int8_us"]
        rows.append(row)
    meta = common.run_metadata()
    title = (f"Mamba2 SSD prefill on {meta['device']} ({NHEADS} heads of {HEADDIM}, {NGROUPS} group, "
             f"d_state {D_STATE}; speedup = mamba-ssm fp16 / quamba int8)")
    print(common.format_table(rows, COLUMNS, title))
    if note:
        print("note:", note)
    common.write_json(args.out, {"meta": meta, "rows": rows, "notes": [note] if note else []})


if __name__ == "__main__":
    main()
