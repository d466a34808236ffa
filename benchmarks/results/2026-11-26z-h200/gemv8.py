"""W8A8 GEMV at 1-8 rows: dp4a (auto) against the tensor-core ring (rows=8, splits 1/2/4) and CUTLASS's
swapped GEMM (config 7); cold graph replays, and the int8 outputs compared for equality."""
import json, sys
import torch
import quamba._C  # noqa: F401
sys.path.insert(0, "benchmarks")
import common
ops = torch.ops.quamba
dev = "cuda"
rows_out = []
for name, N, K in (("in_proj", 10240, 2560), ("out_proj", 2560, 5120), ("x_proj", 192, 5120), ("dt_proj", 5120, 160)):
    for M in (1, 2, 4, 6, 8):
        x0 = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=dev)
        w0 = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)
        pc0 = torch.rand(N, device=dev) * 1e-5 + 1e-6
        ref = torch.empty(M, N, dtype=torch.int8, device=dev)
        ops.w8a8_gemv_out(x0, w0, 0.0, pc0, None, ref, 0, 0)
        variants = [("dp4a", 0, 0)] + [(f"ring_s{s}", 8, s) for s in (1, 2, 4)]
        for vname, rows, splits in variants:
            out = torch.empty_like(ref)
            ops.w8a8_gemv_out(x0, w0, 0.0, pc0, None, out, rows, splits)
            same = bool(torch.equal(out, ref))

            def make(_, rows=rows, splits=splits):
                x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=dev)
                w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)
                pc = torch.full((N,), 1e-6, device=dev)
                o = torch.empty(M, N, dtype=torch.int8, device=dev)
                return lambda: ops.w8a8_gemv_out(x, w, 0.0, pc, None, o, rows, splits)
            us = 1e3 * common.time_graph_ms(make, N * K)
            rows_out.append({"layer": name, "M": M, "variant": vname, "us": us, "same": same})
            print(f"{name:8s} M={M} {vname:8s} {us:7.2f} us same={same}", flush=True)
        if M == 8 and N > 256:
            def make7(_):
                x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=dev)
                w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)
                pc = torch.full((N,), 1e-6, device=dev)
                o = torch.empty(M, N, dtype=torch.int8, device=dev)
                return lambda: ops.w8a8_gemm_sm90_out(x, w, 0.0, pc, None, o, 7)
            us = 1e3 * common.time_graph_ms(make7, N * K)
            rows_out.append({"layer": name, "M": M, "variant": "cutlass_cfg7", "us": us})
            print(f"{name:8s} M={M} cfg7     {us:7.2f} us", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, open(sys.argv[1], "w"), indent=1)
