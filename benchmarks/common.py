"""Helpers shared by the benchmarks/bench_*.py scripts: GPU timing, the device's copy bandwidth,
run metadata, a plain-text table and the JSON result file.

Timing is the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed before every
repetition, so weights are read from device memory as in a real model step), or of CUDA events
around each call with the same flush where Triton is missing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from typing import Callable, Iterable, Sequence

import torch

from quamba.utils.io import atomic_write_text

L2_FLUSH_BYTES = 256 << 20
# Cycles of the sleep kernel that keeps the GPU busy while host_ms times the host: ~0.5 s at an
# H100's clock, longer than the host's part of an eager prefill (the batch-1 TTFTs that it bounds
# are at most ~0.1 s in benchmarks/RESULTS.md) or of bench_host.py's runs of calls.
SLEEP_CYCLES = 1_000_000_000


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """Command line of a benchmark: --out (JSON path), --quick (fewer repetitions), and extras."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="shorter timing runs (a smoke test)")
    if extra:
        extra(parser)
    return parser.parse_args()


def decode_sizes(text: str) -> list[int]:
    sizes = [int(m) for m in text.split(",")]
    if not all(1 <= m <= 8 for m in sizes):
        raise argparse.ArgumentTypeError(f"decode batch sizes must be in 1..8, got {text}")
    return sizes


def gemm_options(default: list[int]) -> Callable[[argparse.ArgumentParser], None]:
    """--decode_m (the GEMV batch sizes), --no_prefill and --gemm_m of the GEMM benchmarks."""
    def add(parser):
        parser.add_argument("--decode_m", type=decode_sizes, default=default,
                            help="decode batch sizes, comma-separated (1..8)")
        parser.add_argument("--no_prefill", action="store_true", help="time the decode GEMVs only")
        parser.add_argument("--gemm_m", type=lambda text: [int(m) for m in text.split(",")],
                            help="row counts of the prefill table, comma-separated (default: 1024,2048)")
    return add


def row_counts(args, prefill_m: list[int]) -> tuple[list[int], list[int]]:
    """(prefill, decode) row counts of a GEMM benchmark from gemm_options' arguments: --quick keeps
    the largest prefill size and the first decode size, --gemm_m replaces the prefill sizes."""
    prefill_m, decode_m = (prefill_m[-1:], args.decode_m[:1]) if args.quick else (prefill_m, args.decode_m)
    if args.gemm_m:
        prefill_m = args.gemm_m
    return ([] if args.no_prefill else prefill_m), decode_m


SKINNY_MAX_M = 64


def skinny_gemm_runs(M: int) -> bool:
    """Whether quamba's skinny GEMM takes M rows here (compute capability 9.0: clusters)."""
    return M <= SKINNY_MAX_M and torch.cuda.get_device_capability() >= (9, 0)


def time_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median GPU time of one call of ``fn`` in milliseconds (L2 flushed before each call)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _time_with_events(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _time_with_events(fn, warmup_ms, rep_ms) -> float:
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    times = []
    for i in range(max(int((warmup_ms + rep_ms) / estimate), 10)):
        flush.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i * estimate >= warmup_ms:
            times.append(start.elapsed_time(end))
    return statistics.median(times or [start.elapsed_time(end)])


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median time in ms of ``fn`` waited on alone (CUDA events around each call), after
    ``warmup`` calls; no L2 flush: what a user's call of a whole model costs."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn: Callable[[], object], runs: int = 3, calls: int = 1) -> tuple[float, bool]:
    """Host time in ms of one call of ``fn``: the median over ``runs`` of ``calls`` calls issued
    while a sleep kernel queued first keeps the GPU busy, so that no launch waits for the GPU; and
    whether in any run the sleep had ended before the calls returned: they then waited for the GPU
    (a synchronization, a full launch queue) or outlasted the sleep, and the time is an upper
    bound."""
    fn()
    torch.cuda.synchronize()
    times, waited = [], False
    for _ in range(runs):
        torch.cuda._sleep(SLEEP_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e3 / calls)
        waited |= slept.query()
        torch.cuda.synchronize()
    return statistics.median(times), waited


def first_sync(fn: Callable[[], object]) -> str | None:
    """Where one call of ``fn`` first makes the host wait for the GPU, as torch's sync debug mode
    reports it ("file:line: message", the Python line whose torch call synchronized), or None.
    It sees torch's synchronizing calls (``.item()``, ``.tolist()``, nonzero, a copy to the
    host), not a synchronization inside another library's C++ code."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    for warning in caught:
        message = str(warning.message)
        if "synchroniz" in message:
            return f"{warning.filename}:{warning.lineno}: {message.splitlines()[0]}"
    return None


def time_graph_ms(make_call: Callable[[int], Callable[[], object]], bytes_per_call: int,
                  replays: int = 30, l2_multiple: int = 3, max_copies: int = 256) -> float:
    """Median GPU time in ms of one call. ``make_call(i)`` returns a call on the i-th copy of the
    operands (allocated by it); enough copies are made that together they exceed L2 ``l2_multiple``
    times."""
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copies = min(max(2, -(-l2_multiple * l2_bytes // max(bytes_per_call, 1))), max_copies)
    calls = [make_call(i) for i in range(copies)]
    for call in calls:  # warm-up outside the capture: handles, workspaces, kernel attributes
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / copies)
    return statistics.median(times)


def fp16_linear_us(M: int, N: int, K: int) -> float:
    """Median µs of fp16 ``F.linear`` (cuBLAS) with x [M, K] and W [N, K], the baseline of every
    linear-layer benchmark; each call reads its own operands (time_graph_ms)."""
    def make(_):
        x = torch.randn(M, K, dtype=torch.float16, device="cuda")
        w = torch.randn(N, K, dtype=torch.float16, device="cuda") / K ** 0.5
        return lambda: torch.nn.functional.linear(x, w)
    return 1e3 * time_graph_ms(make, 2 * (N * K + M * K + M * N))


def graph_launch_timing(step, replays: int = 20) -> dict:
    """How long ``step``, a call that replays CUDA graphs, keeps the GPU waiting for the host, in µs
    (medians over ``replays``): the call waited on alone (CUDA events around it, as a decode step's
    TPOT is timed) against calls queued back to back, which hide their launches behind the GPU's
    work, and the host's time in the call without waiting. Run it before any torch profiler
    session in the process (see bench_graph_launch.py)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    waited, host_calls = [], []
    for _ in range(replays):
        torch.cuda.synchronize()
        began = time.perf_counter()
        start.record()
        step()
        host_calls.append((time.perf_counter() - began) * 1e6)
        end.record()
        end.synchronize()
        waited.append(start.elapsed_time(end) * 1e3)
    start.record()
    for _ in range(replays):
        step()
    end.record()
    end.synchronize()
    return {"waited_us": statistics.median(waited), "queued_us": start.elapsed_time(end) * 1e3 / replays,
            "host_call_us": statistics.median(host_calls)}


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read plus the bytes written."""
    src = torch.empty(nbytes, dtype=torch.int8, device="cuda").random_(-128, 127)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup_ms=50, rep_ms=200)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def git_commit() -> str:
    """Short commit of the checkout; $QUAMBA_COMMIT where the copy has no .git (the GPU machine)."""
    if os.environ.get("QUAMBA_COMMIT"):
        return os.environ["QUAMBA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_metadata() -> dict:
    """Device, software and commit of this run."""
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def format_table(rows: Sequence[dict], columns: Iterable[str], title: str | None = None) -> str:
    """Rows of dicts as an aligned text table (floats to 3 significant digits, '-' where missing)."""
    columns = list(columns)
    cells = [[_format_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(col.rjust(w) for col, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_json(path: str | None, payload: dict) -> None:
    """Write the results atomically (a temporary file, then a rename)."""
    if path:
        atomic_write_text(path, json.dumps(payload, indent=2))


def check_backends(rows: list[dict], allow_reference_ops: bool = False,
                   allow_reference_fp_ops: bool = False,
                   flags: tuple = ("--allow_reference_ops", "--reference_fp_ops")) -> int:
    """1 (with the reasons printed) when a row ran a quantized op (``reference_ops``) or an FP op
    (``reference_fp_ops``) on its torch reference and that is not allowed, else 0. ``flags`` name
    the options that would allow each, for the message (None: none exists)."""
    failed = False
    for row in rows:
        for key, allowed, flag in (("reference_ops", allow_reference_ops, flags[0]),
                                   ("reference_fp_ops", allow_reference_fp_ops, flags[1])):
            if row.get(key) and not allowed:
                failed = True
                hint = f" ({flag} accepts that)" if flag else ""
                print(f"error: row {row['name']!r} ran ops on their torch references, so its times "
                      f"are not the kernels'{hint}: {why_reference(row[key])}", file=sys.stderr)
    return 1 if failed else 0


def why_reference(ops: list[str]) -> str:
    """'op, op: reason; ...' for ops that ran their torch reference on the GPU."""
    from quamba.ops import backend
    by_reason = defaultdict(list)
    for op in ops:
        reason = backend.cuda_missing(op, torch.device("cuda")) or "QUAMBA_BACKEND or --backend asked for it"
        by_reason[reason].append(op)
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())
