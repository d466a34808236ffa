"""Mamba2's SSD prefill on the GPU: quamba's Triton kernel on int8 inputs (``qssd_scan``, the
int8 path of a Quamba2 layer) and on fp16 inputs (the FP model's ``ssd_scan``), against
mamba-ssm's fp16 SSD (``mamba_chunk_scan_combined``, Triton) where it is installed, and the torch
reference for scale. GPU time per call from CUDA-graph replays (no host time: mamba-ssm's
Python wrapper alone outlasts its kernels at batch 1). Shapes: Mamba2-2.7B's heads (80 heads of
64, one group, d_state 128), batch 1 and 8, L 1024 and 2048.

    python benchmarks/bench_ssd.py --out results_ssd.json [--quick] [--step]

--step adds the decode step (``qssd_state_update``, int8 state) at batch 1 to 64 for each number of
a head's channels per program (STEP_BLOCK_P of quamba.ops.ssd.ssd_triton), against mamba-ssm's
``selective_state_update`` (Triton) on an fp32 state, the layout its Mamba2 step passes.
--state_tiles adds the int8 prefill for each tile of its pass 1 (the chunks' own states:
STATE_BLOCK_T steps, STATE_BLOCK_N states, STATE_WARPS warps a program).
"""
from __future__ import annotations

import common
import torch

from quamba.ops.quant import quantize_weight
from quamba.ops.scan.qsscan import SSMParams
from quamba.ops.ssd.qssd import qssd_scan
from quamba.ops.ssd.ssd import ssd_scan

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


STEP_BATCHES = [1, 8, 32, 64]
STEP_BLOCKS = [8, 16, 32, 64]


def step_inputs(batch):
    """A decode step's int8 inputs and state as the Quamba2 mixer passes them, and the fp32 ones
    of mamba-ssm's step (its Mamba2 layout: per-head values repeated over channels and states)."""
    int8, fp16 = inputs(batch, 1)
    step = {k: v[:, 0] if k in ("x", "dt", "B", "C") else v for k, v in int8.items()
            if k != "chunk_size"}
    state = torch.randint(-127, 128, (batch, NHEADS, HEADDIM, D_STATE), dtype=torch.int8,
                          device=DEVICE)
    A, D, dt_bias = fp16["A"], fp16["D"], fp16["dt_bias"]
    baseline = dict(state=torch.randn(batch, NHEADS, HEADDIM, D_STATE, device=DEVICE),
                    x=fp16["x"][:, 0], dt=fp16["dt"][:, 0, :, None].expand(-1, -1, HEADDIM),
                    A=A[:, None, None].expand(-1, HEADDIM, D_STATE), B=fp16["B"][:, 0],
                    C=fp16["C"][:, 0], D=D[:, None].expand(-1, HEADDIM),
                    dt_bias=dt_bias[:, None].expand(-1, HEADDIM), dt_softplus=True)
    return step, state, baseline


STATE_TILES = [(t, n, w) for t in (32, 64) for n in (64, 128) for w in (4, 8)]


def state_tile_rows(replays: int) -> list[dict]:
    """The int8 prefill's time per pass-1 tile (STATE_TILES), at each of SHAPES."""
    from quamba.ops.ssd import ssd_triton
    default = ssd_triton.STATE_BLOCK_T, ssd_triton.STATE_BLOCK_N, ssd_triton.STATE_WARPS
    rows = []
    for batch, seqlen in SHAPES:
        int8, fp16 = inputs(batch, seqlen)
        row = {"batch": batch, "seqlen": seqlen}
        for tile in STATE_TILES:
            ssd_triton.STATE_BLOCK_T, ssd_triton.STATE_BLOCK_N, ssd_triton.STATE_WARPS = tile
            row["t{}_n{}_w{}_us".format(*tile)] = 1e3 * common.time_graph_ms(
                lambda _: lambda: qssd_scan(**int8, backend_name="cuda"), 4 * fp16["x"].numel(),
                replays=replays)
        ssd_triton.STATE_BLOCK_T, ssd_triton.STATE_BLOCK_N, ssd_triton.STATE_WARPS = default
        rows.append(row)
    return rows


def step_rows(replays: int) -> list[dict]:
    from quamba.ops.ssd import ssd_triton
    from quamba.ops.ssd.qssd import qssd_state_update
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except ImportError:
        selective_state_update = None
    rows, default = [], ssd_triton.STEP_BLOCK_P
    for batch in STEP_BATCHES:
        step, state, baseline = step_inputs(batch)
        state_bytes = 2 * state.numel()
        row = {"batch": batch}
        def int8_step(_):  # each call its own state, as each layer has
            own = state.clone()
            return lambda: qssd_state_update(own, 0.05, **step, out_dtype=torch.float16,
                                             backend_name="cuda")

        def baseline_step(_):
            own = dict(baseline, state=baseline["state"].clone())
            return lambda: selective_state_update(**own)
        for block_p in STEP_BLOCKS:
            ssd_triton.STEP_BLOCK_P = block_p
            row[f"int8_p{block_p}_us"] = 1e3 * common.time_graph_ms(int8_step, state_bytes,
                                                                    replays=replays)
        ssd_triton.STEP_BLOCK_P = default
        if selective_state_update is not None:
            row["mamba_ssm_us"] = 1e3 * common.time_graph_ms(baseline_step, 8 * state.numel(),
                                                             replays=replays)
        rows.append(row)
    return rows


def main():
    def options(parser):
        parser.add_argument("--step", action="store_true", help="also time the decode step")
        parser.add_argument("--state_tiles", action="store_true",
                            help="also time the int8 prefill for each tile of its pass 1")
    args = common.parse_args(__doc__.splitlines()[0], options)
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
    steps = step_rows(5 if args.quick else 30) if args.step else []
    if steps:
        print(common.format_table(steps, ["batch"] + [f"int8_p{p}_us" for p in STEP_BLOCKS]
                                  + ["mamba_ssm_us"], "\nMamba2 decode step, µs per call"))
    tiles = state_tile_rows(5 if args.quick else 30) if args.state_tiles else []
    if tiles:
        print(common.format_table(tiles, list(tiles[0]), "\nint8 prefill per pass-1 tile, µs per call"))
    common.write_json(args.out, {"meta": meta, "rows": rows, "step_rows": steps,
                                 "state_tile_rows": tiles, "notes": [note] if note else []})


if __name__ == "__main__":
    main()
