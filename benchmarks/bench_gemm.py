"""W8A8 GEMM (prefill) and GEMV (decode) of quamba._C against fp16 F.linear (cuBLAS) at the linear
shapes of Mamba-2.8B, each layer with the output type Quamba gives it. Prefill reports TOPS and
the speed-up over fp16; decode reports the bytes moved per second and their share of the device's
copy bandwidth. Also times every CUTLASS sm90 configuration, every plan of the skinny GEMM
(M <= 64), the mma.sync fallback and every GEMV work split (rows per warp x splits of K), which is
how the dispatcher's choices were made. Every call reads its own copy of the operands
(common.time_graph_ms): weights come from device memory.

    python benchmarks/bench_gemm.py [--out results.json] [--quick] [--decode_m 1,2,...,8] [--no_prefill]
                                    [--gemm_m 16,32,64,...]

--gemm_m replaces the prefill sizes (M = 1024, 2048) of the GEMM table: decode past the GEMV (M 9
to 64, batch 9 to 64) takes the skinny GEMM or, where N > 256, the sm90 GEMM computed
swapped (compute capability 9.0); the table sweeps the skinny GEMM's plans and every sm90
configuration.
The table's int_mm_us column times cuBLASLt's int8 GEMM (torch._int_mm, int32 out, no epilogue: a
lower bound for routing these sizes through cuBLAS; empty where torch refuses the shape).
"""
from __future__ import annotations

import sys

import torch

from common import (copy_bandwidth_gbs, format_table, fp16_linear_us, gemm_options, parse_args, row_counts,
                    run_metadata, skinny_gemm_runs, time_graph_ms, write_json)

# name, N, K, output dtype (Mamba-2.8B: d_model 2560, d_inner 5120, dt_rank 160, d_state 16)
LAYERS = [("in_proj", 10240, 2560, torch.int8), ("x_proj", 192, 5120, torch.int8),
          ("dt_proj", 5120, 160, torch.int8), ("out_proj", 2560, 5120, torch.float16)]
PREFILL_M = [1024, 2048]
DECODE_M = [1, 2, 4, 8]
GEMV_SHAPES = [(rows, splits) for rows in (1, 2, 4, 8) for splits in (1, 2, 4)]
SKINNY_PLANS = [(warp_tiles, splits) for warp_tiles in (1, 2) for splits in (1, 2, 4, 8, 16)]


class Layer:
    """One linear at one M: times fp16 F.linear and the W8A8 ops, each call on its own copy of
    the operands (common.time_graph_ms), so weights always come from device memory."""

    def __init__(self, name, N, K, out_dtype, M):
        self.name, self.M, self.N, self.K, self.out_dtype = name, M, N, K, out_dtype
        self.multiplier = 1e-5
        self.int8_bytes = N * K + M * K + M * N * torch.empty(0, dtype=out_dtype).element_size()
        self.fp16_bytes = 2 * (N * K + M * K + M * N)

    def fp16_us(self):
        return fp16_linear_us(self.M, self.N, self.K)

    def w8a8_us(self, op=None, *extra):
        op = op or torch.ops.quamba.w8a8_linear_out
        M, N, K = self.M, self.N, self.K

        def make(_):
            x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
            w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
            out = torch.empty(M, N, dtype=self.out_dtype, device="cuda")
            return lambda: op(x, w, self.multiplier, None, None, out, *extra)
        return 1e3 * time_graph_ms(make, self.int8_bytes)

    def int_mm_us(self):
        """torch._int_mm (cuBLASLt int8 x int8 -> int32) on the same operands, or None where torch
        refuses the shape."""
        M, N, K = self.M, self.N, self.K

        def make(_):
            x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
            w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
            return lambda: torch._int_mm(x, w.t())
        try:
            return 1e3 * time_graph_ms(make, N * K + M * K + 4 * M * N)
        except RuntimeError:
            return None

    def row(self):
        return {"layer": self.name, "M": self.M, "N": self.N, "K": self.K,
                "out": str(self.out_dtype).replace("torch.", "")}


def bench_prefill(layer):
    fp16, w8a8 = layer.fp16_us(), layer.w8a8_us()
    ops = 2 * layer.M * layer.N * layer.K
    row = {**layer.row(), "fp16_us": fp16, "w8a8_us": w8a8, "speedup": fp16 / w8a8,
           "fp16_TFLOPS": ops / fp16 / 1e6, "w8a8_TOPS": ops / w8a8 / 1e6}
    for config in range(torch.ops.quamba.w8a8_gemm_sm90_configs()):
        row[f"sm90_c{config}_us"] = layer.w8a8_us(torch.ops.quamba.w8a8_gemm_sm90_out, config)
    if skinny_gemm_runs(layer.M):
        row["skinny_us"] = layer.w8a8_us(torch.ops.quamba.w8a8_gemm_skinny_out)
        for warp_tiles, splits in SKINNY_PLANS:
            try:
                row[f"skinny_w{warp_tiles}s{splits}_us"] = layer.w8a8_us(torch.ops.quamba.w8a8_gemm_skinny_out,
                                                                        warp_tiles, splits)
            except RuntimeError:  # x's range under too few splits does not fit in shared memory
                row[f"skinny_w{warp_tiles}s{splits}_us"] = None
    row["mma_us"] = layer.w8a8_us(torch.ops.quamba.w8a8_gemm_mma_out)
    row["int_mm_us"] = layer.int_mm_us()
    return row


def bench_decode(layer, copy_gbs):
    fp16, w8a8 = layer.fp16_us(), layer.w8a8_us()
    gbs = layer.int8_bytes / w8a8 / 1e3
    sweep = {f"r{rows}s{splits}": layer.w8a8_us(torch.ops.quamba.w8a8_gemv_out, rows, splits)
             for rows, splits in GEMV_SHAPES}
    best = min(sweep, key=sweep.get)
    return {**layer.row(), "fp16_us": fp16, "w8a8_us": w8a8, "speedup": fp16 / w8a8,
            "fp16_GBps": layer.fp16_bytes / fp16 / 1e3, "w8a8_GBps": gbs, "of_copy_bw": gbs / copy_gbs,
            "best_gemv": best, "best_gemv_us": sweep[best], "gemv_sweep_us": sweep}


def totals(rows, stage):
    """The four linears of one block added up, per M: what a model step spends in them."""
    out = []
    for M in sorted({r["M"] for r in rows}):
        at_m = [r for r in rows if r["M"] == M]
        fp16, w8a8 = sum(r["fp16_us"] for r in at_m), sum(r["w8a8_us"] for r in at_m)
        out.append({"stage": stage, "M": M, "fp16_us": fp16, "w8a8_us": w8a8, "speedup": fp16 / w8a8})
    return out


def main():
    args = parse_args(__doc__.splitlines()[0], gemm_options(DECODE_M))
    try:
        import quamba._C  # noqa: F401
    except ImportError as exc:
        sys.exit(f"bench_gemm: quamba._C is not built ({exc})")
    meta = run_metadata()
    copy_gbs = copy_bandwidth_gbs()
    prefill_m, decode_m = row_counts(args, PREFILL_M)
    prefill = [bench_prefill(Layer(name, N, K, dt, M)) for M in prefill_m for name, N, K, dt in LAYERS]
    decode = [bench_decode(Layer(name, N, K, dt, M), copy_gbs) for M in decode_m for name, N, K, dt in LAYERS]
    summary = totals(prefill, "prefill") + totals(decode, "decode")

    print(f"{meta['device']} (sm {meta['capability']}), torch {meta['torch']}, commit {meta['commit']}, "
          f"{meta['date']}; copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    sweep_cols = ([f"sm90_c{c}_us" for c in range(torch.ops.quamba.w8a8_gemm_sm90_configs())]
                  + ["skinny_us", "mma_us", "int_mm_us"])
    print(format_table(prefill, ["layer", "M", "N", "K", "out", "fp16_us", "w8a8_us", "speedup", "w8a8_TOPS",
                                 "fp16_TFLOPS"] + sweep_cols, "\nW8A8 GEMM (prefill) vs fp16 F.linear"))
    skinny_cols = [f"skinny_w{w}s{s}_us" for w, s in SKINNY_PLANS]
    skinny_rows = [row for row in prefill if "skinny_us" in row]
    if skinny_rows:
        print(format_table(skinny_rows, ["layer", "M", "skinny_us"] + skinny_cols,
                           "\nSkinny W8A8 GEMM (M <= 64) by plan: warp tiles w, splits of K s"))
    print(format_table(decode, ["layer", "M", "N", "K", "fp16_us", "w8a8_us", "speedup", "w8a8_GBps", "of_copy_bw",
                                "fp16_GBps", "best_gemv", "best_gemv_us"],
                       "\nW8A8 GEMV (decode) vs fp16 F.linear"))
    print(format_table(summary, ["stage", "M", "fp16_us", "w8a8_us", "speedup"], "\nOne Mamba-2.8B block's linears"))
    write_json(args.out, {"meta": meta, "copy_bandwidth_gbs": copy_gbs, "prefill": prefill, "decode": decode,
                          "block_totals": summary})


if __name__ == "__main__":
    main()
