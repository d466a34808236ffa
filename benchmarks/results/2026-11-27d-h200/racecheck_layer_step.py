"""Racecheck harness for qmamba_layer_step: a 1-block W8A8 / W4A8 model of Mamba-2.8B's block
quantized on the CPU (so that no other custom kernel runs on the GPU), moved to the GPU, and two
layer-kernel steps."""
import sys

import torch

import quamba
from quamba.models.config import preset_config
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops.fused_layer import qmamba_layer_step

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
