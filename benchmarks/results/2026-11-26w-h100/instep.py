"""In-step GEMM timing: a GEMM alone against the GEMM inside its neighbours of the decode step
(Hadamard -> out_proj -> residual RMSNorm; RMSNorm -> in_proj), graph replays on cold copies;
and the W8A8 / W4A8 linears at 1-16 rows on every kernel. argv: out.json."""
import json, sys
import torch
import quamba._C  # noqa: F401
from quamba.ops.qhadamard import hadamard_quant
from quamba.ops.qnorm import rmsnorm_quant
sys.path.insert(0, "benchmarks")
import common

ops = torch.ops.quamba
G = 128
dev = "cuda"
rows = []


def w8_operands(M, N, K, out_dtype=torch.int8):
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)
    pc = torch.full((N,), 1e-6, device=dev)
    out = torch.empty(M, N, dtype=out_dtype, device=dev)
    return w, pc, out


def w4_operands(M, N, K, out_dtype=torch.int8):
    w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=dev)
    gm = torch.randint(1, 19, (N, K // G), dtype=torch.int8, device=dev)
    pc = torch.full((N,), 1e-6, device=dev)
    out = torch.empty(M, N, dtype=out_dtype, device=dev)
    return w, gm, pc, out


def gemm_call(kind, M, N, K, out_dtype):
    """(bytes, f(x) -> out) for one copy."""
    if kind.startswith("w8"):
        w, pc, out = w8_operands(M, N, K, out_dtype)
        if kind == "w8_linear":
            return N * K, lambda x: (ops.w8a8_linear_out(x, w, 0.0, pc, None, out), out)[1]
        if kind == "w8_skinny":
            return N * K, lambda x: (ops.w8a8_gemm_skinny_out(x, w, 0.0, pc, None, out), out)[1]
        if kind == "w8_gemv":
            return N * K, lambda x: (ops.w8a8_gemv_out(x, w, 0.0, pc, None, out), out)[1]
        cfg = int(kind.split("cfg")[1])
        return N * K, lambda x: (ops.w8a8_gemm_sm90_out(x, w, 0.0, pc, None, out, cfg), out)[1]
    w, gm, pc, out = w4_operands(M, N, K, out_dtype)
    if kind == "w4_linear":
        return N * K // 2, lambda x: (ops.w4a8_linear_out(x, w, gm, G, 0.0, pc, out), out)[1]
    if kind == "w4_gemv":
        return N * K // 2, lambda x: (ops.w4a8_gemv_out(x, w, gm, G, 0.0, pc, out), out)[1]
    if kind == "w4_skinny":
        return N * K // 2, lambda x: (ops.w4a8_skinny_out(x, w, gm, G, 0.0, pc, out), out)[1]
    splits = int(kind.split("tiled")[1] or 0)
    return N * K // 2, lambda x: (ops.w4a8_tiled_out(x, w, gm, G, 0.0, pc, out, splits), out)[1]


def us(make, nbytes):
    return 1e3 * common.time_graph_ms(make, nbytes)


def out_proj_chain(kind, M, parts):
    """parts: subset of 'had', 'break', 'gemm', 'norm' in order; out_proj N 2560, K 5120."""
    N, K = 2560, 5120
    def make(_):
        y = torch.randn(M, K, dtype=torch.float16, device=dev)
        xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=dev)
        res = torch.randn(M, N, dtype=torch.float32, device=dev)
        hidden = torch.randn(M, N, dtype=torch.float16, device=dev)
        nw = torch.rand(N, device=dev) + 0.5
        flag = torch.zeros(16, dtype=torch.int32, device=dev)
        nbytes, gemm = gemm_call(kind, M, N, K, torch.float16)
        def call():
            x = xq
            h = hidden
            if "had" in parts:
                x = hadamard_quant(y, 0.05, "cuda")
            if "break" in parts:
                flag.zero_()
            if "gemm" in parts:
                h = gemm(x)
            if "norm" in parts:
                rmsnorm_quant(h, res, nw, 1e-5, 0.05, True, "cuda")
        return call
    return us(make, 2560 * 5120)


def in_proj_chain(kind, M, parts):
    N, K = 10240, 2560
    def make(_):
        res = torch.randn(M, K, dtype=torch.float32, device=dev)
        hidden = torch.randn(M, K, dtype=torch.float16, device=dev)
        nw = torch.rand(K, device=dev) + 0.5
        xq = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=dev)
        nbytes, gemm = gemm_call(kind, M, N, K, torch.int8)
        def call():
            x = xq
            if "norm" in parts:
                x, _ = rmsnorm_quant(hidden, res, nw, 1e-5, 0.05, True, "cuda")
            if "gemm" in parts:
                gemm(x)
        return call
    return us(make, N * K)


def record(r):
    rows.append(r)
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    M = 64
    for parts in (("had",), ("norm",), ("had", "norm")):
        record({"chain": "out_proj", "M": M, "kind": "-", "parts": "+".join(parts), "us": out_proj_chain("w8_linear", M, parts)})
    for kind in ("w4_tiled", "w4_tiled4", "w4_tiled16", "w8_linear"):
        for parts in (("gemm",), ("had", "gemm"), ("had", "break", "gemm"), ("gemm", "norm"), ("had", "gemm", "norm"),
                      ("had", "break", "gemm", "norm")):
            record({"chain": "out_proj", "M": M, "kind": kind, "parts": "+".join(parts),
                    "us": out_proj_chain(kind, M, parts)})
    record({"chain": "in_proj", "M": M, "kind": "-", "parts": "norm", "us": in_proj_chain("w8_linear", M, ("norm",))})
    for kind in ("w4_tiled", "w8_linear"):
        for parts in (("gemm",), ("norm", "gemm")):
            record({"chain": "in_proj", "M": M, "kind": kind, "parts": "+".join(parts), "us": in_proj_chain(kind, M, parts)})

    # The linears alone at 1-16 rows.
    shapes = (("in_proj", 10240, 2560), ("out_proj", 2560, 5120), ("x_proj", 192, 5120), ("dt_proj", 5120, 160))
    for M in (1, 4, 8, 9, 12, 16):
        for name, N, K in shapes:
            kinds = ["w8_linear", "w8_cfg7", "w8_cfg6"]
            kinds += ["w8_gemv"] if M <= 8 else ["w8_skinny"]
            if name != "dt_proj":
                kinds += ["w4_linear", "w4_tiled"] + (["w4_gemv"] if M <= 8 else ["w4_skinny"])
            for kind in kinds:
                def make(_, kind=kind, N=N, K=K, M=M):
                    x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=dev)
                    _, f = gemm_call(kind, M, N, K, torch.int8)
                    return lambda: f(x)
                try:
                    t = us(make, N * K)
                except Exception as e:  # a kernel that refuses the shape
                    t = float("nan")
                    print(f"{name} M={M} {kind}: {str(e).splitlines()[0][:120]}", flush=True)
                record({"layer": name, "M": M, "kind": kind, "us": t})
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
