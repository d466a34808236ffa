"""compute-sanitizer harness for qmamba_layer_step (the W8A8 / W4A8 layer kernel): a 1-block W8A8 or
W4A8 model of Mamba-2.8B's block, quantized on the CPU so that no other custom kernel runs on the
GPU, moved to the GPU, and two layer-kernel steps.

What it showed (fresh H200s, 2026-11-27; benchmarks/RESULTS.md, "compute-sanitizer"): racecheck
reports only the ring's slot refills (the producer's bulk copy against the reads of the chunk the
slot held one ring turn earlier: benchmarks/results/2026-11-27d-h200/racecheck_w8a8_layer_5380c3b.log
and racecheck_w4a8_layer_5380c3b.log), which experiments/racecheck_ring.cu shows racecheck flags in
any mbarrier ring; initcheck with every kernel instrumented: 0 errors
(benchmarks/results/2026-11-27e-h200/initcheck_w8a8_layer.log and initcheck_w4a8_layer.log).

Run from the repository root with quamba._C built (the fused_decode family at least). The argument
is 8 for W8A8 or 4 for W4A8; a second argument "cpu" runs the torch reference instead. No
--kernel-name filter: initcheck needs every kernel instrumented (a filter leaves the writes of other
kernels untracked).

    PYTHONPATH=$PWD compute-sanitizer --tool racecheck python benchmarks/experiments/racecheck_layer_step.py 8

    PYTHONPATH=$PWD compute-sanitizer --tool initcheck python benchmarks/experiments/racecheck_layer_step.py 4

It ran at 6789cb4; its imports follow quamba.ops as regrouped in 8236d4c. Moved from
benchmarks/results/2026-11-27d-h200/, where commit e1bf2e6 added it.
"""
import sys

import torch

import quamba
from quamba.models.config import preset_config
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops.fused_decode.layer_step import qmamba_layer_step

w_bits = int(sys.argv[1])
dev = sys.argv[2] if len(sys.argv) > 2 else "cuda"
config = preset_config("2.8b")
config.n_layer, config.vocab_size = 1, 512
fp_model = randomize_(MambaLMHeadModel(config, dtype=torch.float16).eval(), seed=0)
calib = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
model = quamba.quantize(fp_model, config=quamba.QuantConfig(w_bits=w_bits, a_bits=8, seed=0), calib_data=calib,
                        progress=False)
model = model.to(dev)
block = model.backbone.layers[0]
cache = model.allocate_cache(1, device=dev)
state = cache.states[0]
gen = torch.Generator().manual_seed(2)
state.conv.copy_(torch.randint(-127, 128, state.conv.shape, generator=gen))
state.ssm.copy_(torch.randint(-127, 128, state.ssm.shape, generator=gen))
hidden = torch.randn(1, 1, config.d_model, generator=gen).half().to(dev)
residual = None
with torch.no_grad():
    weights = block.mixer.layer_weights(block.norm)
    for step in range(2):
        hidden, residual = qmamba_layer_step(hidden, residual, weights, state.conv, state.ssm,
                                             backend_name="cuda" if dev == "cuda" else "torch")
if dev == "cuda":
    torch.cuda.synchronize()
print(f"w{w_bits}a8 layer step ran twice, out finite:", bool(torch.isfinite(hidden.float().cpu()).all()))
