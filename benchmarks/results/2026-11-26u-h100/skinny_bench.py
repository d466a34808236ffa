"""GPU time (graph replays, cold copies) of the skinny GEMM's automatic plan and the dispatching
ops at Mamba-2.8B's shapes: argv out.json."""
import json, sys
import torch
import quamba._C  # noqa: F401
sys.path.insert(0, "benchmarks")
import common
G = 128
ops = torch.ops.quamba
rows = []
def w8(M, N, K, op):
    def make(_):
        x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
        w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
        pc = torch.full((N,), 1e-6, device="cuda"); out = torch.empty(M, N, dtype=torch.int8, device="cuda")
        return lambda: op(x, w, 0.0, pc, None, out)
    return 1e3 * common.time_graph_ms(make, N * K + M * K)
def w4(M, N, K, op):
    def make(_):
        x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
        w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
        gm = torch.randint(1, 19, (N, K // G), dtype=torch.int8, device="cuda")
        pc = torch.full((N,), 1e-6, device="cuda"); out = torch.empty(M, N, dtype=torch.int8, device="cuda")
        return lambda: op(x, w, gm, G, 0.0, pc, out)
    return 1e3 * common.time_graph_ms(make, N * K // 2 + M * K)
for M in (16, 32, 48, 64):
    for name, N, K in (("x_proj", 192, 5120), ("out_proj", 2560, 5120), ("in_proj", 10240, 2560)):
        r = {"layer": name, "M": M}
        r["w8a8_skinny_us"] = w8(M, N, K, ops.w8a8_gemm_skinny_out)
        r["w8a8_linear_us"] = w8(M, N, K, ops.w8a8_linear_out)
        r["w4a8_skinny_us"] = w4(M, N, K, ops.w4a8_skinny_out)
        r["w4a8_linear_us"] = w4(M, N, K, ops.w4a8_linear_out)
        r["w4a8_tiled_us"] = w4(M, N, K, ops.w4a8_tiled_out)
        r["w4a8_expand_cutlass7_us"] = w4(M, N, K, lambda *a: ops.w4a8_gemm_out(*a, 7))
        rows.append(r)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
