"""Host (CPU) time per call of the linear ops at Mamba-2.8B's in_proj shape (N 10240, K 2560),
for a prefill (M = 1024) and a decode row (M = 1): fp16 F.linear, the W8A8, W4A8 and W4A16 ops of
quamba._C, W4A16 through the library's backend selection, and the two halves of the W4A16 prefill
(the dequantization alone, torch.mm alone).

Why: batch-1 prefill is bound by the host's Python on the lent H100 machine, for every
precision (benchmarks/RESULTS.md, 2026-11-23); this shows what each linear call costs the host
there. Each number is the wall time of a run of calls issued while a long sleep kernel queued
first keeps the GPU busy, so that no call waits for it (common.host_ms); a run that outlasted the
sleep, as a call that synchronizes with the GPU would, is reported as such. A torch profiler pass over the W4A16 prefill call
lists the CPU-side events (ATen ops and CUDA runtime calls) that take its time.

    python benchmarks/bench_host.py [--out results.json] [--quick]
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from bench_gemm4 import GROUP, gemv_operands
from common import format_table, host_ms, parse_args, run_metadata, write_json
from torch.profiler import ProfilerActivity, profile

from quamba.ops.linear.qlinear4 import w4a16_linear

N, K = 10240, 2560


def operands(M: int) -> dict:
    """The 4-bit calls' operands and the fp16 and int8 weights of the others."""
    return {
        **gemv_operands(M, N, K),
        "w16": torch.randn(N, K, dtype=torch.float16, device="cuda") / K ** 0.5,
        "w8": torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
        "dequantized": torch.empty(N, K, dtype=torch.float16, device="cuda"),
    }


def calls(o: dict) -> dict:
    ops = torch.ops.quamba
    return {
        "fp16 F.linear": lambda: F.linear(o["x16"], o["w16"]),
        "w8a8_linear op": lambda: ops.w8a8_linear(o["x8"], o["w8"], 0.0, o["per_channel"], None, torch.float16),
        "w4a8_linear op": lambda: ops.w4a8_linear(o["x8"], o["packed"], o["multipliers"], GROUP, 0.0,
                                                  o["per_channel"], torch.float16),
        "w4a16_linear op": lambda: ops.w4a16_linear(o["x16"], o["packed"], o["scales"], GROUP, torch.float16),
        "w4a16_linear (library)": lambda: w4a16_linear(o["x16"], o["packed"], o["scales"], GROUP),
        "w4a16_dequantize_out op": lambda: ops.w4a16_dequantize_out(o["packed"], o["scales"], GROUP,
                                                                    o["dequantized"]),
        "torch.mm(x, w.t()) fp16": lambda: torch.mm(o["x16"], o["dequantized"].t()),
    }


def profiler_events(fn, repeats: int, top: int = 15) -> list[dict]:
    """CPU-side events (ATen ops, CUDA runtime calls) of ``repeats`` calls, by self CPU time."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"event": e.key[:80], "calls": e.count, "self_cpu_us_per_call": e.self_cpu_time_total / repeats}
            for e in events]


def main():
    args = parse_args(__doc__.split("\n\n")[0])
    try:
        import quamba._C  # noqa: F401  loads torch.ops.quamba.*
    except ImportError as exc:
        sys.exit(f"bench_host: quamba._C is not built ({exc})")
    if not hasattr(torch.ops.quamba, "w4a16_linear") or not hasattr(torch.ops.quamba, "w8a8_linear"):
        sys.exit("bench_host: quamba._C was built without the gemm and gemm4 kernel families")
    repeats = 10 if args.quick else 50
    rows, events = [], {}
    with torch.inference_mode():
        for M in (1024, 1):
            for name, fn in calls(operands(M)).items():
                ms, waited = host_ms(fn, runs=1, calls=repeats)
                rows.append({"M": M, "call": name, "host_us": 1e3 * ms, "waits_for_gpu": waited})
            events[f"w4a16_linear op, M={M}"] = profiler_events(calls(operands(M))["w4a16_linear op"], repeats)
    print(format_table(rows, ["M", "call", "host_us", "waits_for_gpu"], "host time per call"))
    for title, table in events.items():
        print(format_table(table, ["event", "calls", "self_cpu_us_per_call"], f"\nprofiler: {title}"))
    write_json(args.out, {"meta": run_metadata(), "shape": {"N": N, "K": K, "group_size": GROUP},
                          "repeats": repeats, "rows": rows, "profiler_events": events})


if __name__ == "__main__":
    main()
