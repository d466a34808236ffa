"""What launching a CUDA graph costs as its kernel count grows, and how a torch profiler session
changes it: graphs of k tiny kernels (torch's in-place add on one value, and quamba's W8A8 GEMV on
a 1 × 16 × 16 problem, launched with programmatic dependence) timed as a decode step is
(common.graph_launch_timing: one replay waited on alone, replays queued back to back, the host's
time in the call), then timed again after the torch profiler has recorded a few replays.

Why: graphed Mamba-2.8B decode steps measured after a profile in the same process waited 0.3-0.4
ms longer for their launch than those measured before (benchmarks/RESULTS.md); profile_mamba.py
now profiles in a child process. This shows the launch's own cost per kernel, and the profiler's.

    python benchmarks/bench_graph_launch.py [--out results.json] [--quick]
"""
from __future__ import annotations

import sys

import torch

from common import format_table, graph_launch_timing, parse_args, run_metadata, write_json

KERNEL_COUNTS = (16, 128, 512, 1024)


def tiny_kernels() -> dict:
    """name -> a call that launches one tiny kernel."""
    ops = torch.ops.quamba
    value = torch.zeros(1, device="cuda")
    x = torch.ones(1, 16, dtype=torch.int8, device="cuda")
    weight = torch.ones(16, 16, dtype=torch.int8, device="cuda")
    out = torch.empty(1, 16, dtype=torch.float16, device="cuda")
    return {"torch add_": lambda: value.add_(1),
            "quamba GEMV (PDL)": lambda: ops.w8a8_gemv_out(x, weight, 1e-3, None, None, out, 0, 0)}


def graph_of(kernel, count: int) -> torch.cuda.CUDAGraph:
    kernel()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            kernel()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def profile_once(graph: torch.cuda.CUDAGraph) -> None:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()


def main():
    args = parse_args(__doc__.split("\n\n")[0])
    try:
        import quamba._C  # noqa: F401  loads torch.ops.quamba.*
    except ImportError as exc:
        sys.exit(f"bench_graph_launch: quamba._C is not built ({exc})")
    replays = 10 if args.quick else 50
    graphs = {(name, count): graph_of(kernel, count)
              for name, kernel in tiny_kernels().items() for count in KERNEL_COUNTS}
    rows = []
    for when in ("before any profile", "after a profile"):
        if rows:
            profile_once(next(iter(graphs.values())))
        for (name, count), graph in graphs.items():
            rows.append({"when": when, "kernels": name, "count": count,
                         **graph_launch_timing(graph.replay, replays)})
    columns = ["when", "kernels", "count", "waited_us", "queued_us", "host_call_us"]
    print(format_table(rows, columns, "a CUDA graph of `count` tiny kernels, per replay (µs)"))
    write_json(args.out, {"meta": run_metadata(), "replays": replays, "rows": rows})


if __name__ == "__main__":
    main()
