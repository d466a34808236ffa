"""One quantized Mamba1 layer's SSM side at decode: the four quamba kernels of the unfused step
(qconv1d_update, x_proj's GEMV, dt_proj's GEMV, qsscan_update) against qmixer_ssm_step's
(quamba.ops.fused_decode.mixer_step) two Triton kernels and its cluster kernel (csrc/fused_decode,
W8A8 x_proj only), at Mamba-2.8B's shapes (d_inner 5120, d_state 16, dt_rank 160, conv width 4),
batch 1 and 8, W8A8 and W4A8 x_proj, int8 and fp32 SSM state.

Each is timed as CUDA-graph replays of many layers' steps, each with its own weights and states
(common.time_graph_ms: together three times the L2 cache), as a graphed decode step runs them;
``us`` is per layer, ``floor_us`` the bytes a layer's step must move (weights, states read and
written) over the device's copy bandwidth, ``speedup`` the unfused time over the op's (the cluster
kernel where it runs, else the Triton kernels).

``--tiles`` also times the Triton kernels at other tile choices (channels per conv + x_proj
program, channels per scan program, warps), W8A8 x_proj and an int8 state.

    python benchmarks/bench_fused_decode.py [--out results.json] [--quick] [--tiles]
"""
from __future__ import annotations

import math
import sys

import common
import torch

from quamba.ops import backend
from quamba.ops.conv.qconv1d import qconv1d_update
from quamba.ops.fused_decode.mixer_step import project
from quamba.ops.fused_decode.weights import ConvWeights, StepScales, W4A8Weight, W8A8Weight
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.ops.scan.qsscan import SSMParams, qsscan_update

DEVICE = torch.device("cuda")
D_MODEL, D_INNER, D_STATE, D_CONV = 2560, 5120, 16, 4
DT_RANK = math.ceil(D_MODEL / 16)
N_OUT = DT_RANK + 2 * D_STATE
GROUP = 128
BATCHES = (1, 8)
COLUMNS = ("x_proj", "state", "batch", "unfused_us", "triton_us", "cluster_us", "speedup",
           "floor_us")
# (CONV_CHANNELS, SCAN_CHANNELS, NUM_WARPS) of quamba.ops.fused_decode.mixer_step_triton tried by
# --tiles
TILES = ((64, 64, 8), (128, 32, 4), (128, 64, 4), (256, 64, 8), (128, 128, 8), (64, 32, 4))
TILE_COLUMNS = ("batch", "conv_channels", "scan_channels", "warps", "fused_us")


def codes(*shape, low=-127):
    return torch.randint(low, 128, shape, dtype=torch.int8, device=DEVICE)


def layer_step(x_proj_kind: str, state_kind: str, batch: int) -> dict:
    """qmixer_ssm_step's arguments for one layer (random codes, scales in the working range)."""
    if x_proj_kind == "w4a8":
        x_proj = W4A8Weight(torch.randint(0, 256, (N_OUT, D_INNER // 2), dtype=torch.uint8,
                                          device=DEVICE),
                            torch.randint(1, 19, (N_OUT, D_INNER // GROUP), dtype=torch.int8,
                                          device=DEVICE),
                            torch.full((N_OUT,), 2e-3, device=DEVICE), GROUP, 0.03, 0.04)
    else:
        x_proj = W8A8Weight(codes(N_OUT, D_INNER), 3e-4, 0.03, 0.04)
    state = codes(batch, D_INNER, D_STATE)
    xz = codes(batch, 2 * D_INNER)
    return dict(x=xz[:, :D_INNER], z=xz[:, D_INNER:], conv_state=codes(batch, D_INNER, D_CONV - 1),
                ssm_state=state if state_kind == "int8" else state.float() * 0.05,
                conv=ConvWeights(codes(D_INNER, D_CONV), 2e-4, codes(D_INNER), 4e-3),
                x_proj=x_proj, dt_proj=W8A8Weight(codes(D_INNER, DT_RANK), 1e-3, 0.04, 0.02),
                params=SSMParams(codes(D_INNER, D_STATE, low=0), 0.022, codes(D_INNER), 0.01,
                                 codes(D_INNER), 0.03),
                scales=StepScales(0.05, 0.03, 0.04, 0.02, 0.05))


def unfused_step(x, z, conv_state, ssm_state, conv, x_proj, dt_proj, params, scales):
    """The mixer's unfused decode step on the cuda kernels (QMambaMixer._ssm_step, int8 mode)."""
    u = qconv1d_update(x, conv_state, scales.xz, conv.weight, conv.weight_scale, conv.bias,
                       conv.bias_scale, out_scale=scales.u, backend_name="cuda")
    dt_low, B, C = torch.split(project(x_proj, u, backend_name="cuda"), [DT_RANK, D_STATE, D_STATE],
                               dim=-1)
    dt = w8a8_linear(dt_low, dt_proj.in_scale, dt_proj.weight, dt_proj.weight_scale,
                     dt_proj.out_scale, backend_name="cuda")
    return qsscan_update(ssm_state, scales.state, u, scales.u, dt, scales.dt, B, scales.xdbl, C,
                         scales.xdbl, z, scales.xz, params, backend_name="cuda")


def triton_step(**step):
    from quamba.ops.fused_decode import mixer_step_triton
    return mixer_step_triton.ssm_step(**step, out_dtype=torch.float16)


def cluster_step(**step):
    from quamba.ops.fused_decode import mixer_step_cuda
    return mixer_step_cuda.ssm_step(**step, out_dtype=torch.float16)


def cluster_runs(step: dict) -> bool:
    from quamba.ops.fused_decode import mixer_step_cuda
    return mixer_step_cuda.lacks(step["x"], step["conv"], step["x_proj"], step["dt_proj"],
                            step["ssm_state"]) is None


def layer_bytes(x_proj_kind: str, state_kind: str, batch: int) -> int:
    """What one layer's step must move: weights and SSM parameters read, states read and written,
    x and z read, y written."""
    x_proj = N_OUT * D_INNER
    if x_proj_kind == "w4a8":  # packed codes and group multipliers
        x_proj = N_OUT * D_INNER // 2 + N_OUT * D_INNER // GROUP
    weights = x_proj + D_INNER * DT_RANK + D_INNER * (D_CONV + 1) + D_INNER * (D_STATE + 2)
    state = batch * D_INNER * (D_STATE * (1 if state_kind == "int8" else 4) + D_CONV - 1)
    return weights + 2 * state + batch * D_INNER * (2 + 2)


def bench(x_proj_kind, state_kind, batch, bandwidth, replays) -> dict:
    nbytes = layer_bytes(x_proj_kind, state_kind, batch)
    steps = {"unfused": unfused_step, "triton": triton_step}
    if cluster_runs(layer_step(x_proj_kind, state_kind, batch)):
        steps["cluster"] = cluster_step
    times = {}
    for name, step in steps.items():
        def make(_, step=step):
            arguments = layer_step(x_proj_kind, state_kind, batch)
            return lambda: step(**arguments)
        times[name] = 1e3 * common.time_graph_ms(make, nbytes, replays=replays)
    fused = times.get("cluster", times["triton"])
    return {"x_proj": x_proj_kind, "state": state_kind, "batch": batch,
            "unfused_us": times["unfused"], "triton_us": times["triton"],
            "cluster_us": times.get("cluster"), "speedup": times["unfused"] / fused,
            "floor_us": nbytes / bandwidth / 1e3}


def bench_tiles(replays) -> list[dict]:
    """The fused step (W8A8 x_proj, int8 state) at each of TILES, batch 1 and 8."""
    from quamba.ops.fused_decode import mixer_step_triton as kernel
    chosen = (kernel.CONV_CHANNELS, kernel.SCAN_CHANNELS, kernel.NUM_WARPS)
    rows = []
    try:
        for batch in BATCHES:
            for tiles in TILES:
                kernel.CONV_CHANNELS, kernel.SCAN_CHANNELS, kernel.NUM_WARPS = tiles

                def make(_, batch=batch):
                    arguments = layer_step("w8a8", "int8", batch)
                    return lambda: triton_step(**arguments)
                nbytes = layer_bytes("w8a8", "int8", batch)
                rows.append(dict(zip(TILE_COLUMNS, (batch, *tiles, 1e3 * common.time_graph_ms(
                    make, nbytes, replays=replays)))))
    finally:
        kernel.CONV_CHANNELS, kernel.SCAN_CHANNELS, kernel.NUM_WARPS = chosen
    return rows


def main():
    args = common.parse_args(__doc__.split("\n\n")[0], lambda parser: parser.add_argument(
        "--tiles", action="store_true", help="also time the fused kernels at other tile choices"))
    torch.manual_seed(0)
    bandwidth = common.copy_bandwidth_gbs()
    with backend.recording() as ran:
        rows = [bench(x_proj, state, batch, bandwidth, 10 if args.quick else 30)
                for x_proj in ("w8a8", "w4a8") for state in ("int8", "fp32") for batch in BATCHES]
    meta = common.run_metadata()
    title = (f"a Mamba-2.8B layer's SSM side at decode on {meta['device']}, per layer (copy "
             f"bandwidth {bandwidth:.0f} GB/s; speedup = unfused / fused)")
    print(common.format_table(rows, COLUMNS, title))
    tile_rows = bench_tiles(10 if args.quick else 30) if args.tiles else []
    if tile_rows:
        print(common.format_table(tile_rows, TILE_COLUMNS, "fused step at other tiles, µs per layer"))
    backends = backend.summary(ran)
    common.write_json(args.out, {"meta": meta, "copy_bandwidth_gbs": bandwidth, "rows": rows,
                                 "tile_rows": tile_rows, "backends": backends})
    on_reference = backend.on_reference(ran)
    if on_reference:
        print(f"error: these ops ran their torch references, so the times are not the kernels': "
              f"{common.why_reference(on_reference)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
