"""SSM-side kernels against mamba-ssm's FP16 kernels: QSScan vs ``selective_scan_fn``, INT8 conv1d
vs ``causal_conv1d_fn`` (+SiLU), and the decode steps vs ``selective_state_update`` /
``causal_conv1d_update``; rmsnorm_quant and hadamard_quant are timed too (no baseline).

Shapes: d_inner 5120, d_state 16 (Mamba-2.8B); the scans at batch 1 and 8 over 1024 and 2048
tokens and at batch 1 over 4096 and 8192 (``--quick``: the first two), the other prefill ops at
batch 1, seqlen 1024 and 2048, the decode steps at batch 1, 8, 32 and 64 (``--quick``: 1), the
scan's step also per lanes-per-channel variant of its kernel, and with dt_proj before it (a W8A8
GEMV/GEMM) against dt_proj folded into it (the mixer's decode step up to batch 8; the pair is two
eager launches, so at small batch its row includes the host's gap between them). The int8 ops are timed in the module's layout (channel-last views of the
GEMM outputs, ``layout=module``) and channel-first (``layout=contiguous``, the layout mamba-ssm is
given). GB/s counts each input read once and each output written once (y, and the last state);
``floor_us`` is those bytes over the device's measured copy bandwidth. The baseline columns are left empty, with a note,
where mamba-ssm or causal-conv1d is not installed.

``--configs`` adds every launch configuration of the QSScan kernel at those shapes, and the
chunked one (config 2, the default) at several chunk lengths.

``--discretizations`` times instead QSScan's prefill (module layout, batch 1 and 8) and decode
step (batch 1 and 8) for every discretization of quamba.ops.scan.discretization, with each one's
time over zoh's (``vs_zoh``) on the same inputs.

``--decode`` times only the decode steps, at batch 1, 8, 16, 32, 64 and 128.

    python benchmarks/bench_ssm.py --out results_ssm.json [--configs | --discretizations | --decode]
"""
from __future__ import annotations

import functools
import math

import common
import torch

from quamba.ops import backend
from quamba.ops.conv.qconv1d import qconv1d, qconv1d_update
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.ops.norm.qhadamard import hadamard_quant
from quamba.ops.norm.qnorm import rmsnorm_quant
from quamba.ops.quant import requant_multiplier
from quamba.ops.scan.discretization import DEFAULT, METHODS
from quamba.ops.scan.qsscan import DtProjection, SSMParams, qsscan, qsscan_update

DEVICE = torch.device("cuda")
BATCH, D_INNER, D_STATE, D_CONV, D_MODEL = 1, 5120, 16, 4, 2560
DT_RANK = math.ceil(D_MODEL / 16)
SEQLENS = (1024, 2048)
SCAN_SHAPES = ((1, 1024), (1, 2048), (8, 1024), (8, 2048), (1, 4096), (1, 8192))  # batch, seqlen
COLUMNS = ("op", "layout", "batch", "seqlen", "us", "GB/s", "floor_us", "baseline_us", "speedup")
DISCRETIZATION_COLUMNS = ("op", "discretization", "batch", "seqlen", "us", "vs_zoh")
DISCRETIZATION_BATCHES = (1, 8)


def codes(*shape):
    return torch.randint(-127, 128, shape, dtype=torch.int8, device=DEVICE)


def load_baselines() -> dict:
    """mamba-ssm / causal-conv1d functions that are installed, and notes for the missing ones."""
    found, notes = {}, []
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        found.update(selective_scan_fn=selective_scan_fn,
                     selective_state_update=selective_state_update)
    except ImportError as exc:
        notes.append(f"mamba-ssm not installed ({exc}): no selective-scan baseline")
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        found.update(causal_conv1d_fn=causal_conv1d_fn, causal_conv1d_update=causal_conv1d_update)
    except ImportError as exc:
        notes.append(f"causal-conv1d not installed ({exc}): no conv1d baseline")
    return {"fns": found, "notes": notes}


class Timer:
    def __init__(self, quick: bool, bandwidth_gbs: float):
        self.rep_ms = 30 if quick else 200
        self.bandwidth_gbs = bandwidth_gbs

    def us(self, fn) -> float:
        return 1e3 * common.time_ms(fn, warmup_ms=25, rep_ms=self.rep_ms)

    def row(self, op, layout, seqlen, fn, nbytes, baseline_us=None, batch=BATCH) -> dict:
        us = self.us(fn)
        return {"op": op, "layout": layout, "batch": batch, "seqlen": seqlen, "us": us,
                "GB/s": nbytes / us / 1e3, "floor_us": nbytes / self.bandwidth_gbs / 1e3,
                "baseline_us": baseline_us,
                "speedup": None if baseline_us is None else baseline_us / us}


# ---- prefill ---------------------------------------------------------------------------------

def ssm_params():
    a_log = torch.log(torch.arange(1, D_STATE + 1, device=DEVICE).float()).expand(D_INNER, D_STATE)
    scale = float(a_log.max()) / 127
    return SSMParams(torch.round(a_log / scale).to(torch.int8), scale, codes(D_INNER), 0.01,
                     torch.randint(-127, -30, (D_INNER,), dtype=torch.int8, device=DEVICE), 0.05)


def scan_inputs(seqlen, layout, batch=BATCH):
    """int8 u, dt, z [b, d, l] and B, C [b, n, l], laid out as the module passes them or
    channel-first."""
    if layout == "module":
        x_dbl = codes(batch, seqlen, DT_RANK + 2 * D_STATE)
        B, C = (t.transpose(1, 2) for t in x_dbl.split([DT_RANK, D_STATE, D_STATE], -1)[1:])
        return dict(u=codes(batch, seqlen, D_INNER).transpose(1, 2),
                    dt=codes(batch, seqlen, D_INNER).transpose(1, 2),
                    z=codes(batch, seqlen, 2 * D_INNER).transpose(1, 2)[:, D_INNER:], B=B, C=C)
    return dict(u=codes(batch, D_INNER, seqlen), dt=codes(batch, D_INNER, seqlen),
                z=codes(batch, D_INNER, seqlen), B=codes(batch, D_STATE, seqlen),
                C=codes(batch, D_STATE, seqlen))


def scan_bytes(seqlen, elem_in, elem_out, state_bytes, batch=BATCH):
    return ((3 * D_INNER + 2 * D_STATE) * seqlen * elem_in + D_INNER * seqlen * elem_out
            + D_INNER * D_STATE * state_bytes) * batch


def mamba_scan_fn(fns, seqlen, batch=BATCH):
    if "selective_scan_fn" not in fns:
        return None
    half = dict(dtype=torch.float16, device=DEVICE)
    u, dt, z = (torch.randn(batch, D_INNER, seqlen, **half) for _ in range(3))
    B, C = (torch.randn(batch, D_STATE, seqlen, **half) for _ in range(2))
    A = -torch.arange(1, D_STATE + 1, device=DEVICE).float().expand(D_INNER, D_STATE).contiguous()
    D, dt_bias = torch.ones(D_INNER, device=DEVICE), torch.full((D_INNER,), -4.0, device=DEVICE)
    return lambda: fns["selective_scan_fn"](u, dt, A, B, C, D, z=z, delta_bias=dt_bias,
                                            delta_softplus=True, return_last_state=True)


def bench_scan(timer, fns, batch, seqlen):
    baseline = mamba_scan_fn(fns, seqlen, batch)
    base_us = timer.us(baseline) if baseline else None
    rows = []
    params = ssm_params()
    for layout in ("module", "contiguous"):
        t = scan_inputs(seqlen, layout, batch)
        run = lambda: qsscan(t["u"], 0.03, t["dt"], 0.02, t["B"], 0.02, t["C"], 0.02, t["z"], 0.03,
                             params, state_scale=0.05, out_dtype=torch.float16,
                             backend_name="cuda")
        rows.append(timer.row("qsscan int8", layout, seqlen, run,
                              scan_bytes(seqlen, 1, 2, 1, batch), base_us, batch))
    if base_us is not None:
        rows.append({"op": "selective_scan_fn fp16", "layout": "contiguous", "batch": batch,
                     "seqlen": seqlen, "us": base_us,
                     "GB/s": scan_bytes(seqlen, 2, 2, 4, batch) / base_us / 1e3})
    return rows


SCAN_CONFIGS = 3  # the launch configurations of csrc/qsscan (kScanConfigs)
CHUNKED_CONFIG = 2
CHUNK_LENS = (32, 64, 128, 256)  # chunk lengths timed beside the launcher's own choice (0)


def bench_scan_configs(timer, batch, seqlen):
    """Every launch configuration of the QSScan kernel (the op's default is one of them), and
    the chunked one at several chunk lengths (module layout)."""
    backend.cuda_extension_error()  # loads quamba._C and registers the cuda backend
    from quamba.ops.scan.cuda import qsscan_op_args

    params, rows = ssm_params(), []
    nbytes = scan_bytes(seqlen, 1, 2, 1, batch)
    for layout in ("module", "contiguous"):
        t = scan_inputs(seqlen, layout, batch)
        args = qsscan_op_args(t["u"], 0.03, t["dt"], 0.02, t["B"], 0.02, t["C"], 0.02, t["z"],
                              0.03, params, 0.05, torch.float16)
        for config in range(SCAN_CONFIGS):
            run = lambda: torch.ops.quamba.qsscan(*args, config)
            rows.append(timer.row(f"qsscan config {config}", layout, seqlen, run, nbytes,
                                  batch=batch))
        if layout != "module":
            continue
        for chunk_len in CHUNK_LENS:
            run = lambda: torch.ops.quamba.qsscan(*args, CHUNKED_CONFIG, DEFAULT, chunk_len)
            rows.append(timer.row(f"qsscan config {CHUNKED_CONFIG}, chunks of {chunk_len}", layout,
                                  seqlen, run, nbytes, batch=batch))
    return rows


def bench_discretizations(timer):
    """QSScan's prefill (module layout) and decode step for every discretization, each at batch
    1 and 8, with its time over zoh's on the same inputs (the tests hold each method's accuracy;
    these random codes may overflow rk4's state, which does not change its time)."""
    params, rows = ssm_params(), []
    for batch in DISCRETIZATION_BATCHES:
        for seqlen in SEQLENS:
            t = scan_inputs(seqlen, "module", batch)
            rows += _method_rows(timer, "qsscan int8", batch, seqlen, lambda method: qsscan(
                t["u"], 0.03, t["dt"], 0.02, t["B"], 0.02, t["C"], 0.02, t["z"], 0.03, params,
                state_scale=0.05, out_dtype=torch.float16, backend_name="cuda",
                discretization=method))
        step = {name: x[:, :, 0] for name, x in scan_inputs(1, "module", batch).items()}
        state = codes(batch, D_INNER, D_STATE)
        drive = torch.zeros(batch, D_INNER, D_STATE, device=DEVICE)
        rows += _method_rows(timer, "qsscan_update int8", batch, 1, lambda method: qsscan_update(
            state, 0.05, step["u"], 0.03, step["dt"], 0.02, step["B"], 0.02, step["C"], 0.02,
            step["z"], 0.03, params, backend_name="cuda", discretization=method,
            drive=drive if method == "foh" else None))
    return rows


def _method_rows(timer, op, batch, seqlen, run_method) -> list[dict]:
    rows = [{"op": op, "discretization": method, "batch": batch, "seqlen": seqlen,
             "us": timer.us(lambda: run_method(method))} for method in METHODS]
    zoh_us = next(row["us"] for row in rows if row["discretization"] == DEFAULT)
    for row in rows:
        row["vs_zoh"] = row["us"] / zoh_us
    return rows


def bench_conv(timer, fns, seqlen):
    weight, bias = codes(D_INNER, D_CONV), codes(D_INNER)
    base_us = None
    if "causal_conv1d_fn" in fns:
        x16 = torch.randn(BATCH, D_INNER, seqlen, dtype=torch.float16, device=DEVICE)
        w16, b16 = weight.half() / 127, bias.half() / 127
        base_us = timer.us(lambda: fns["causal_conv1d_fn"](x16, w16, b16, activation="silu"))
    rows = []
    for layout in ("module", "contiguous"):
        x = (codes(BATCH, seqlen, 2 * D_INNER).transpose(1, 2)[:, :D_INNER] if layout == "module"
             else codes(BATCH, D_INNER, seqlen))
        run = lambda: qconv1d(x, 0.04, weight, 0.01, bias, 0.01, 0.05, backend_name="cuda")
        rows.append(timer.row("qconv1d int8", layout, seqlen, run, 2 * BATCH * D_INNER * seqlen,
                              base_us))
    if base_us is not None:
        rows.append({"op": "causal_conv1d_fn fp16", "layout": "contiguous", "seqlen": seqlen,
                     "us": base_us, "GB/s": 4 * BATCH * D_INNER * seqlen / base_us / 1e3})
    return rows


def bench_norm_hadamard(timer, seqlen):
    if not hasattr(torch.ops.quamba, "rmsnorm_quant"):
        return []  # quamba._C built without the norm family (QUAMBA_CUDA_FAMILIES)
    x = torch.randn(BATCH * seqlen, D_MODEL, dtype=torch.float16, device=DEVICE)
    residual = torch.randn(BATCH * seqlen, D_MODEL, device=DEVICE)
    y = torch.randn(BATCH * seqlen, D_INNER, dtype=torch.float16, device=DEVICE)
    norm = lambda: rmsnorm_quant(x, residual, None, 1e-5, 0.03, backend_name="cuda")
    hadamard = lambda: hadamard_quant(y, 0.03, backend_name="cuda")
    rows_norm = BATCH * seqlen * D_MODEL * (2 + 4 + 4 + 1)
    return [timer.row("rmsnorm_quant", "rows", seqlen, norm, rows_norm),
            timer.row("hadamard_quant", "rows", seqlen, hadamard, BATCH * seqlen * D_INNER * 3)]


# ---- decode ----------------------------------------------------------------------------------

DECODE_BATCHES = (1, 8, 32, 64)
DECODE_ONLY_BATCHES = (1, 8, 16, 32, 64, 128)  # --decode


def bench_decode(timer, fns, batch):
    """One decode step of the scan and the conv at ``batch`` rows, against mamba-ssm's (fp16); the
    scan also per lanes-per-channel variant of its kernel (qsscan_update_lanes<N> rows)."""
    params = ssm_params()
    xz, x_dbl = codes(batch, 2 * D_INNER), codes(batch, DT_RANK + 2 * D_STATE)
    x, z = xz[:, :D_INNER], xz[:, D_INNER:]
    B, C = x_dbl[:, DT_RANK:DT_RANK + D_STATE], x_dbl[:, DT_RANK + D_STATE:]
    u, dt = codes(batch, D_INNER), codes(batch, D_INNER)
    ssm_state = codes(batch, D_INNER, D_STATE)
    conv_state = codes(batch, D_INNER, D_CONV - 1)
    weight, bias = codes(D_INNER, D_CONV), codes(D_INNER)
    scan_step = lambda: qsscan_update(ssm_state, 0.05, u, 0.03, dt, 0.02, B, 0.02, C, 0.02, z, 0.03,
                                      params, backend_name="cuda")
    conv_step = lambda: qconv1d_update(x, conv_state, 0.04, weight, 0.01, bias, 0.01, 0.05,
                                       backend_name="cuda")
    base_scan = base_conv = None
    if "selective_state_update" in fns:
        base_scan = timer.us(baseline_step(fns["selective_state_update"], batch))
    if "causal_conv1d_update" in fns:
        xc = torch.randn(batch, D_INNER, dtype=torch.float16, device=DEVICE)
        state16 = torch.randn(batch, D_INNER, D_CONV - 1, dtype=torch.float16, device=DEVICE)
        w16, b16 = weight.half() / 127, bias.half() / 127
        base_conv = timer.us(lambda: fns["causal_conv1d_update"](xc, state16, w16, b16, "silu"))
    scan_step_bytes = batch * (D_INNER * (4 + 2 * D_STATE) + 2 * D_STATE)
    conv_step_bytes = batch * D_INNER * (1 + 2 * (D_CONV - 1) + 1)
    rows = [timer.row("qsscan_update int8", "decode", 1, scan_step, scan_step_bytes, base_scan,
                      batch=batch),
            timer.row("qconv1d_update int8", "decode", 1, conv_step, conv_step_bytes, base_conv,
                      batch=batch)]
    rows += bench_folded_dt_proj(timer, ssm_state, u, x_dbl, B, C, z, params, base_scan, batch,
                                 scan_step_bytes)
    op_args = _step_op_args(ssm_state, u, dt, B, C, z, params)
    for lanes in (16, 4, 1):
        step = lambda: torch.ops.quamba.qsscan_update(*op_args, lanes=lanes)
        rows.append(timer.row(f"qsscan_update_lanes{lanes}", "decode", 1, step, scan_step_bytes,
                              base_scan, batch=batch))
    return rows


def bench_folded_dt_proj(timer, ssm_state, u, x_dbl, B, C, z, params, base_scan, batch,
                         scan_step_bytes):
    """dt_proj (W8A8, int8 out) then the step, against the step with dt_proj folded in (what the
    mixer's decode step runs); the baseline is mamba-ssm's step alone, its dt_proj not counted."""
    dt_low = x_dbl[:, :DT_RANK]
    weight = codes(D_INNER, DT_RANK)
    projection = DtProjection(weight, requant_multiplier(0.02, 0.01, 0.02))
    step = functools.partial(qsscan_update, ssm_state, 0.05, u, 0.03, B=B, B_scale=0.02, C=C,
                             C_scale=0.02, z=z, z_scale=0.03, params=params, backend_name="cuda")
    chain = lambda: step(dt=w8a8_linear(dt_low, 0.02, weight, 0.01, 0.02, backend_name="cuda"),
                         dt_scale=0.02)
    folded = lambda: step(dt=dt_low, dt_scale=0.02, dt_proj=projection)
    return [timer.row(name, "decode", 1, fn, scan_step_bytes + D_INNER * DT_RANK, base_scan,
                      batch=batch)
            for name, fn in (("dt_proj + qsscan_update int8", chain),
                             ("qsscan_update int8, dt_proj folded", folded))]


def baseline_step(selective_state_update, batch: int):
    """mamba-ssm's decode step on fp16 inputs of bench_decode's shape (fp16 state), as a call."""
    half = dict(dtype=torch.float16, device=DEVICE)
    state16 = torch.randn(batch, D_INNER, D_STATE, **half)
    x16, dt16, z16 = (torch.randn(batch, D_INNER, **half) for _ in range(3))
    B16, C16 = (torch.randn(batch, D_STATE, **half) for _ in range(2))
    A = -torch.arange(1, D_STATE + 1, device=DEVICE).float().expand(D_INNER, D_STATE)
    D, dt_bias = torch.ones(D_INNER, device=DEVICE), torch.full((D_INNER,), -4.0, device=DEVICE)
    return lambda: selective_state_update(state16, x16, dt16, A, B16, C16, D, z=z16,
                                          dt_bias=dt_bias, dt_softplus=True)


def _step_op_args(state, u, dt, B, C, z, params):
    """torch.ops.quamba.qsscan_update's arguments for bench_decode's step (its scales)."""
    return (state, 0.05, u, 0.03, dt, 0.02, B, 0.02, C, 0.02, z, 0.03, params.A_log,
            params.A_log_scale, params.D, params.D_scale, params.dt_bias, params.dt_bias_scale,
            torch.float16)


def add_options(parser):
    parser.add_argument("--configs", action="store_true",
                        help="also time every launch configuration of the QSScan kernel")
    parser.add_argument("--discretizations", action="store_true",
                        help="time QSScan for every discretization instead (ratio to zoh)")
    parser.add_argument("--decode", action="store_true",
                        help="time only the decode steps, at batch 1, 8, 16, 32, 64 and 128")


def main():
    args = common.parse_args(__doc__.splitlines()[0], add_options)
    torch.manual_seed(0)
    baselines = load_baselines()
    bandwidth = common.copy_bandwidth_gbs()
    timer = Timer(args.quick, bandwidth)
    if args.discretizations:
        return report_discretizations(timer, args.out, bandwidth)
    rows = []
    if not args.decode:
        for batch, seqlen in SCAN_SHAPES[:2] if args.quick else SCAN_SHAPES:
            rows += bench_scan(timer, baselines["fns"], batch, seqlen)
            if args.configs:
                rows += bench_scan_configs(timer, batch, seqlen)
        for seqlen in SEQLENS:
            rows += bench_conv(timer, baselines["fns"], seqlen)
            rows += bench_norm_hadamard(timer, seqlen)
    if args.decode:
        decode_batches = DECODE_ONLY_BATCHES
    else:
        decode_batches = DECODE_BATCHES[:1] if args.quick else DECODE_BATCHES
    for batch in decode_batches:
        rows += bench_decode(timer, baselines["fns"], batch)
    meta = common.run_metadata()
    title = (f"SSM kernels on {meta['device']} (d_inner {D_INNER}, d_state "
             f"{D_STATE}; copy bandwidth {bandwidth:.0f} GB/s; speedup = mamba-ssm fp16 / ours)")
    print(common.format_table(rows, COLUMNS, title))
    for note in baselines["notes"]:
        print("note:", note)
    common.write_json(args.out, {"meta": meta, "copy_bandwidth_gbs": bandwidth, "rows": rows,
                                 "notes": baselines["notes"]})


def report_discretizations(timer, out, bandwidth):
    rows = bench_discretizations(timer)
    meta = common.run_metadata()
    title = (f"QSScan per discretization on {meta['device']} (d_inner {D_INNER}, d_state "
             f"{D_STATE}, module layout; vs_zoh = time / zoh's time)")
    print(common.format_table(rows, DISCRETIZATION_COLUMNS, title))
    common.write_json(out, {"meta": meta, "copy_bandwidth_gbs": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
