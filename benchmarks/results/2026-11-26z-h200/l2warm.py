"""GEMV time with its weight in L2 (2 copies, replayed back to back) against cold (copies > 3x L2)."""
import sys
import torch
import quamba._C  # noqa: F401
sys.path.insert(0, "benchmarks")
import common
ops = torch.ops.quamba
G = 128
for M in (1, 8):
    for name, N, K in (("in_proj", 10240, 2560), ("out_proj", 2560, 5120)):
        for kind in ("w8", "w4"):
            shared = {}
            def make(i, share=False):
                if share and "f" in shared:
                    return shared["f"]
                x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
                pc = torch.full((N,), 1e-6, device="cuda")
                out = torch.empty(M, N, dtype=torch.int8, device="cuda")
                if kind == "w8":
                    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
                    shared["f"] = lambda: ops.w8a8_gemv_out(x, w, 0.0, pc, None, out)
                    return shared["f"]
                w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
                gm = torch.randint(1, 19, (N, K // G), dtype=torch.int8, device="cuda")
                shared["f"] = lambda: ops.w4a8_gemv_out(x, w, gm, G, 0.0, pc, out)
                return shared["f"]
            nbytes = N * K // (1 if kind == "w8" else 2)
            cold = 1e3 * common.time_graph_ms(make, nbytes)
            shared.clear()
            warm = 1e3 * common.time_graph_ms(lambda i: make(i, True), nbytes)
            print(f"M={M} {name} {kind}: cold {cold:.2f} us ({nbytes/cold/1e3:.0f} GB/s)  warm {warm:.2f} us ({nbytes/warm/1e3:.0f} GB/s)", flush=True)
