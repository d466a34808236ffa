"""Does initcheck count cuBLAS's fp16 GEMM output as written? A linear's output read by a copy."""
import sys
import torch

torch.manual_seed(0)
n = int(sys.argv[1])
x = torch.randn(n, 2560, device="cuda", dtype=torch.float16)
w = torch.randn(5120, 2560, device="cuda", dtype=torch.float16)
y = torch.nn.functional.linear(x, w)
print("rows", n, "sum", float(y.float().sum()))
