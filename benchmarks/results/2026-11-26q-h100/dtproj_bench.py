"""GPU time (graph replays, cold copies) of dt_proj's W8A8 GEMM (N 5120, K 160) at 16-64 rows:
the dispatching op, the sm90 swapped configs 6 and 7, the skinny GEMM's automatic plan and its
x_rows 16/32/64: argv out.json."""
import json, sys
import torch
import quamba._C  # noqa: F401
sys.path.insert(0, "benchmarks")
import common
ops = torch.ops.quamba
N, K = 5120, 160
def time_us(M, call):
    def make(_):
        x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
        w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
        pc = torch.full((N,), 1e-3, device="cuda"); out = torch.empty(M, N, dtype=torch.int8, device="cuda")
        return lambda: call(x, w, pc, out)
    return 1e3 * common.time_graph_ms(make, N * K + M * K)
variants = {
    "linear": lambda x, w, pc, out: ops.w8a8_linear_out(x, w, 0.0, pc, None, out),
    "sm90_6": lambda x, w, pc, out: ops.w8a8_gemm_sm90_out(x, w, 0.0, pc, None, out, 6),
    "sm90_7": lambda x, w, pc, out: ops.w8a8_gemm_sm90_out(x, w, 0.0, pc, None, out, 7),
    "skinny": lambda x, w, pc, out: ops.w8a8_gemm_skinny_out(x, w, 0.0, pc, None, out),
}
for xr in (16, 32, 64):
    variants[f"skinny_x{xr}"] = (lambda r: lambda x, w, pc, out:
                                 ops.w8a8_gemm_skinny_out(x, w, 0.0, pc, None, out, 0, 0, r))(xr)
rows = []
for M in (16, 32, 48, 64):
    r = {"M": M}
    for name, call in variants.items():
        try:
            r[name] = time_us(M, call)
        except Exception as exc:  # a plan the shape does not allow
            r[name] = str(exc).splitlines()[0][:80]
    rows.append(r)
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
