"""W4A8 and W4A16 linears of quamba._C (csrc/gemm4) against fp16 F.linear (cuBLAS) at the linear
shapes of Mamba-2.8B that take 4-bit weights (in_proj, x_proj, out_proj; groups of 128), each
W4A8 layer with the output type Quamba gives it, W4A16 with fp16 activations and outputs.
Decode (GEMV, M = 1, 2, 4, 8) reports the packed weight bytes moved per second and their share
of the device's copy bandwidth, beside the share that a copy moving as many bytes reaches;
prefill (M = 1024, 2048) the speed-up over fp16 and where the time goes (the W4A8 int8 expansion
and the W8A8 GEMM timed alone). Also times every GEMV work split, which is how the dispatcher's
choices are checked. Every call reads its own copy of the operands (common.time_graph_ms):
weights come from device memory.

    python benchmarks/bench_gemm4.py [--out results.json] [--quick] [--decode_m 1,2,...,8] [--no_prefill]
                                     [--gemm_m 16,32,64,...]

--gemm_m replaces the prefill sizes: at 9 to 64 rows (decode at batch 9 to 64, compute capability
9.0) W4A8 takes the tiled GEMM on the packed weight (x_proj above 32 rows the skinny one); there
both kernels are timed on their own (w4a8_tiled_us, w4a8_skinny_us) beside the expansion and the
W8A8 GEMM that are the path above 64 rows.
"""
from __future__ import annotations

import sys

import torch
from common import (
    copy_bandwidth_gbs,
    format_table,
    fp16_linear_us,
    gemm_options,
    parse_args,
    row_counts,
    run_metadata,
    skinny_gemm_runs,
    time_graph_ms,
    write_json,
)

from quamba.ops.linear.qlinear4 import w4a16_linear

# name, N, K, W4A8 output dtype (Mamba-2.8B: d_model 2560, d_inner 5120, dt_rank 160, d_state 16)
LAYERS = [("in_proj", 10240, 2560, torch.int8), ("x_proj", 192, 5120, torch.int8),
          ("out_proj", 2560, 5120, torch.float16)]
GROUP = 128
PREFILL_M = [1024, 2048]
DECODE_M = [1, 2, 4, 8]
# (rows, splits, x_loads) of the GEMVs: x per lane (1) everywhere, through shared memory (2) on the
# tensor cores
GEMV_SHAPES = ([(rows, splits, 1) for rows in (4, 16) for splits in (1, 2, 4)]
               + [(16, splits, x_loads) for splits in (8, 16) for x_loads in (1, 2)]
               + [(16, splits, 2) for splits in (1, 2, 4)])
W4A16_CORE_MAX_M = 1  # rows 4 (CUDA cores) take M = 1
TRANSPOSED_BATCH = 8  # sequences of the transposed prefill activations (Layer.transposed_us)


def gemv_operands(M: int, N: int, K: int) -> dict:
    """Random operands of one W4A8 and one W4A16 call at [M, K] x [N, K] (groups of GROUP)."""
    return {
        "x8": torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda"),
        "x16": torch.randn(M, K, dtype=torch.float16, device="cuda"),
        "packed": torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda"),
        "multipliers": torch.randint(1, 19, (N, K // GROUP), dtype=torch.int8, device="cuda"),
        "per_channel": torch.full((N,), 1e-6, device="cuda"),
        "scales": (torch.rand(N, K // GROUP, device="cuda") * 0.01).half(),
    }


def elem(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class Layer:
    def __init__(self, name, N, K, out_dtype, M):
        self.name, self.M, self.N, self.K, self.out_dtype = name, M, N, K, out_dtype
        self.weight_bytes = N * K // 2  # the packed 4-bit weight
        groups = N * K // GROUP
        self.w4a8_bytes = self.weight_bytes + groups + M * K + M * N * elem(out_dtype)
        self.w4a16_bytes = self.weight_bytes + 2 * groups + 2 * (M * K + M * N)
        self.fp16_bytes = 2 * (N * K + M * K + M * N)

    def fp16_us(self):
        return fp16_linear_us(self.M, self.N, self.K)

    def _packed(self):
        return torch.randint(0, 256, (self.N, self.K // 2), dtype=torch.uint8, device="cuda")

    def w4a8_us(self, op=None, *extra):
        op = op or torch.ops.quamba.w4a8_linear_out
        M, N, K = self.M, self.N, self.K

        def make(_):
            x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
            w = self._packed()
            gm = torch.randint(1, 19, (N, K // GROUP), dtype=torch.int8, device="cuda")
            per_channel = torch.full((N,), 1e-6, device="cuda")
            out = torch.empty(M, N, dtype=self.out_dtype, device="cuda")
            return lambda: op(x, w, gm, GROUP, 0.0, per_channel, out, *extra)
        return 1e3 * time_graph_ms(make, self.w4a8_bytes)

    def w4a16_us(self, op=None, *extra):
        op = op or torch.ops.quamba.w4a16_linear_out
        M, N, K = self.M, self.N, self.K

        def make(_):
            x = torch.randn(M, K, dtype=torch.float16, device="cuda")
            w = self._packed()
            scales = (torch.rand(N, K // GROUP, device="cuda") * 0.01).half()
            out = torch.empty(M, N, dtype=torch.float16, device="cuda")
            return lambda: op(x, w, scales, GROUP, out, *extra)
        return 1e3 * time_graph_ms(make, self.w4a16_bytes)

    def transposed_us(self, kind):
        """A prefill call on x as the FP mixer hands x_proj and out_proj their input: [batch, M /
        batch, K], a transposed view of a channel-major [batch, K, M / batch] tensor. ``kind``:
        fp16 F.linear, the library's W4A16 linear (cuda backend), or that linear on a contiguous
        copy of x (what it did before it read strided activations)."""
        M, N, K, batch = self.M, self.N, self.K, TRANSPOSED_BATCH

        def make(_):
            x = torch.randn(batch, K, M // batch, dtype=torch.float16, device="cuda").transpose(1, 2)
            if kind == "fp16":
                w = torch.randn(N, K, dtype=torch.float16, device="cuda") / K ** 0.5
                return lambda: torch.nn.functional.linear(x, w)
            w, scales = self._packed(), (torch.rand(N, K // GROUP, device="cuda") * 0.01).half()
            if kind == "w4a16":
                return lambda: w4a16_linear(x, w, scales, GROUP)
            return lambda: w4a16_linear(x.contiguous(), w, scales, GROUP)
        return 1e3 * time_graph_ms(make, self.fp16_bytes if kind == "fp16" else self.w4a16_bytes)

    def copy_us(self):
        """A device-to-device copy moving as many bytes as the packed weight (half of them read,
        half written): the share of the copy bandwidth that one stream of this size reaches, ramp-up
        and tail included."""
        def make(_):
            src = torch.empty(self.weight_bytes // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            return lambda: dst.copy_(src)
        return 1e3 * time_graph_ms(make, self.weight_bytes)

    def expand_us(self):
        N, K = self.N, self.K

        def make(_):
            w = self._packed()
            gm = torch.randint(1, 19, (N, K // GROUP), dtype=torch.int8, device="cuda")
            out = torch.empty(N, K, dtype=torch.int8, device="cuda")
            return lambda: torch.ops.quamba.w4a8_expand_out(w, gm, GROUP, out)
        return 1e3 * time_graph_ms(make, self.weight_bytes + N * K)

    def w8a8_us(self):
        M, N, K = self.M, self.N, self.K

        def make(_):
            x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
            w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
            per_channel = torch.full((N,), 1e-6, device="cuda")
            out = torch.empty(M, N, dtype=self.out_dtype, device="cuda")
            return lambda: torch.ops.quamba.w8a8_linear_out(x, w, 0.0, per_channel, None, out)
        return 1e3 * time_graph_ms(make, N * K + M * K + M * N * elem(self.out_dtype))

    def dequantize_us(self):
        N, K = self.N, self.K

        def make(_):
            w = self._packed()
            scales = (torch.rand(N, K // GROUP, device="cuda") * 0.01).half()
            out = torch.empty(N, K, dtype=torch.float16, device="cuda")
            return lambda: torch.ops.quamba.w4a16_dequantize_out(w, scales, GROUP, out)
        return 1e3 * time_graph_ms(make, self.weight_bytes + 2 * N * K)

    def row(self):
        return {"layer": self.name, "M": self.M, "N": self.N, "K": self.K,
                "out": str(self.out_dtype).replace("torch.", "")}


def bench_prefill(layer):
    fp16, w4a8, w4a16 = layer.fp16_us(), layer.w4a8_us(), layer.w4a16_us()
    fp16_t, w4a16_t = layer.transposed_us("fp16"), layer.transposed_us("w4a16")
    return {**layer.row(), "fp16_us": fp16, "w4a8_us": w4a8, "w4a8_speedup": fp16 / w4a8,
            "w4a16_us": w4a16, "w4a16_speedup": fp16 / w4a16, "expand_us": layer.expand_us(),
            "w8a8_gemm_us": layer.w8a8_us(), "dequant_us": layer.dequantize_us(),
            "w4a8_skinny_us": (layer.w4a8_us(torch.ops.quamba.w4a8_skinny_out)
                               if skinny_gemm_runs(layer.M) else None),
            "w4a8_tiled_us": (layer.w4a8_us(torch.ops.quamba.w4a8_tiled_out)
                              if skinny_gemm_runs(layer.M) else None),
            "fp16_transposed_us": fp16_t, "w4a16_transposed_us": w4a16_t,
            "w4a16_transposed_speedup": fp16_t / w4a16_t, "w4a16_copied_us": layer.transposed_us("copied")}


def gemv_name(rows, splits, x_loads):
    """r16s4: 16 rows per warp, 4 splits, x loaded per lane; r16s4x: x through shared memory."""
    return f"r{rows}s{splits}" + ("x" if x_loads == 2 else "")


def bench_decode(layer, copy_gbs):
    fp16, w4a8, w4a16 = layer.fp16_us(), layer.w4a8_us(), layer.w4a16_us()
    w4a8_gbs, w4a16_gbs = layer.weight_bytes / w4a8 / 1e3, layer.weight_bytes / w4a16 / 1e3
    sweep8 = {gemv_name(*shape): layer.w4a8_us(torch.ops.quamba.w4a8_gemv_out, *shape) for shape in GEMV_SHAPES}
    sweep16 = {gemv_name(*shape): layer.w4a16_us(torch.ops.quamba.w4a16_gemv_out, *shape)
               for shape in GEMV_SHAPES if shape[0] == 16 or layer.M <= W4A16_CORE_MAX_M}
    best8, best16 = min(sweep8, key=sweep8.get), min(sweep16, key=sweep16.get)
    floor_us, copy_us = layer.weight_bytes / copy_gbs / 1e3, layer.copy_us()
    return {**layer.row(), "fp16_us": fp16, "w4a8_us": w4a8, "w4a8_speedup": fp16 / w4a8,
            "w4a8_weight_GBps": w4a8_gbs, "w4a8_of_copy_bw": w4a8_gbs / copy_gbs,
            "w4a16_us": w4a16, "w4a16_speedup": fp16 / w4a16, "w4a16_weight_GBps": w4a16_gbs,
            "w4a16_of_copy_bw": w4a16_gbs / copy_gbs, "floor_us": floor_us, "copy_same_bytes_us": copy_us,
            "copy_same_bytes_of_copy_bw": floor_us / copy_us,
            "fp16_GBps": layer.fp16_bytes / fp16 / 1e3,
            "best_w4a8_gemv": best8, "best_w4a8_gemv_us": sweep8[best8], "w4a8_gemv_sweep_us": sweep8,
            "best_w4a16_gemv": best16, "best_w4a16_gemv_us": sweep16[best16], "w4a16_gemv_sweep_us": sweep16}


def totals(rows, stage):
    """The three 4-bit linears of one block added up, per M."""
    out = []
    for M in sorted({r["M"] for r in rows}):
        at_m = [r for r in rows if r["M"] == M]
        fp16 = sum(r["fp16_us"] for r in at_m)
        w4a8, w4a16 = sum(r["w4a8_us"] for r in at_m), sum(r["w4a16_us"] for r in at_m)
        out.append({"stage": stage, "M": M, "fp16_us": fp16, "w4a8_us": w4a8, "w4a8_speedup": fp16 / w4a8,
                    "w4a16_us": w4a16, "w4a16_speedup": fp16 / w4a16})
    return out


def main():
    args = parse_args(__doc__.splitlines()[0], gemm_options(DECODE_M))
    try:
        import quamba._C  # noqa: F401
    except ImportError as exc:
        sys.exit(f"bench_gemm4: quamba._C is not built ({exc})")
    if not hasattr(torch.ops.quamba, "w4a8_linear_out"):
        sys.exit("bench_gemm4: quamba._C was built without the gemm4 kernel family")
    meta = run_metadata()
    copy_gbs = copy_bandwidth_gbs()
    prefill_m, decode_m = row_counts(args, PREFILL_M)
    decode = [bench_decode(Layer(name, N, K, dt, M), copy_gbs) for M in decode_m for name, N, K, dt in LAYERS]
    prefill = [bench_prefill(Layer(name, N, K, dt, M)) for M in prefill_m for name, N, K, dt in LAYERS]
    summary = totals(prefill, "prefill") + totals(decode, "decode")

    print(f"{meta['device']} (sm {meta['capability']}), torch {meta['torch']}, commit {meta['commit']}, "
          f"{meta['date']}; copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    print(format_table(decode, ["layer", "M", "N", "K", "fp16_us", "w4a8_us", "w4a8_speedup", "w4a8_weight_GBps",
                                "w4a8_of_copy_bw", "w4a16_us", "w4a16_speedup", "w4a16_weight_GBps",
                                "w4a16_of_copy_bw", "floor_us", "copy_same_bytes_us",
                                "copy_same_bytes_of_copy_bw", "best_w4a8_gemv", "best_w4a8_gemv_us",
                                "best_w4a16_gemv", "best_w4a16_gemv_us"],
                       "\nW4A8 / W4A16 GEMV (decode) vs fp16 F.linear (GB/s: packed weight bytes only)"))
    print(format_table(prefill, ["layer", "M", "N", "K", "out", "fp16_us", "w4a8_us", "w4a8_speedup", "expand_us",
                                 "w8a8_gemm_us", "w4a8_skinny_us", "w4a8_tiled_us", "w4a16_us", "w4a16_speedup", "dequant_us"],
                       "\nW4A8 / W4A16 prefill vs fp16 F.linear"))
    print(format_table(prefill, ["layer", "M", "fp16_transposed_us", "w4a16_transposed_us",
                                 "w4a16_transposed_speedup", "w4a16_copied_us"],
                       f"\nW4A16 prefill on transposed activations ({TRANSPOSED_BATCH} sequences, the FP mixer's "
                       "layout) vs fp16 F.linear; copied: the W4A16 linear on a contiguous copy"))
    print(format_table(summary, ["stage", "M", "fp16_us", "w4a8_us", "w4a8_speedup", "w4a16_us", "w4a16_speedup"],
                       "\nOne Mamba-2.8B block's in_proj + x_proj + out_proj"))
    write_json(args.out, {"meta": meta, "copy_bandwidth_gbs": copy_gbs, "group_size": GROUP, "decode": decode,
                          "prefill": prefill, "block_totals": summary})


if __name__ == "__main__":
    main()
