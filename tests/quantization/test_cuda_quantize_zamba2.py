"""Zamba2 quantized on the GPU (fp16): every quantized op of the Mamba2 layers, the shared
blocks and the layers' linears on its kernel (W4A16: its 4-bit linears), the whole model against
the torch reference, decode against prefill."""
import pytest
import torch

import quamba
from quamba.models.mamba import randomize_
from quamba.models.zamba2 import Zamba2Config, Zamba2LM
from quamba.ops import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Kernel-sized: hidden 256 (the 4-bit kernels take multiples of 32 inputs), 8 Mamba heads of 64,
# d_state 64, 4 attention heads of 128 with RoPE, MLP 512, adapters of rank 8; 2 Mamba and 3
# hybrid layers over 2 shared blocks (block 0 used twice).
CONFIG = Zamba2Config(layer_types=("mamba", "hybrid", "hybrid", "mamba", "hybrid"), d_model=256,
                      vocab_size=1000, d_state=64, nheads=8, headdim=64, chunk_size=64,
                      num_attention_heads=4, num_key_value_heads=4, use_rope=True,
                      intermediate_size=512, num_mem_blocks=2, adapter_rank=8,
                      attention_adapters=True, dt_min=0.01)
LINEARS = {"w8a8": "w8a8_linear", "w4a8": "w4a8_linear", "w4a16": "w4a16_linear"}


def tokens(batch, seqlen, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 1000, (batch, seqlen), device="cuda", generator=generator)


@pytest.fixture(scope="module")
def fp_model():
    model = Zamba2LM(CONFIG, device="cuda", dtype=torch.float16).eval()
    return randomize_(model, seed=0)


@pytest.fixture(scope="module", params=list(LINEARS))
def recipe(request):
    return request.param


@pytest.fixture(scope="module")
def qmodel(recipe, fp_model):
    bits = {"w8a8": {}, "w4a8": {"w_bits": 4}, "w4a16": {"w_bits": 4, "a_bits": 16}}[recipe]
    assert backend.cuda_extension_error() is None, backend.cuda_extension_error()
    return quamba.quantize(fp_model, None, quamba.QuantConfig(**bits),
                           calib_data=tokens(8, 128, seed=1), progress=False)


def test_every_quantized_op_runs_on_cuda(qmodel, recipe):
    with torch.inference_mode(), backend.recording() as ran:
        cache = qmodel.allocate_cache(2)
        qmodel(tokens(2, 33, seed=2), cache=cache)
        qmodel(tokens(2, 1, seed=3), cache=cache)
    if recipe != "w4a16":  # W4A16's float conv and scan: the FP16 baseline's kernels
        assert backend.on_reference(ran) == [], backend.summary(ran)
    assert any(op.startswith(LINEARS[recipe]) and "cuda" in used
               for op, used in ran.items())


def test_kernels_match_the_torch_reference(qmodel, monkeypatch):
    ids = tokens(3, 100, seed=4)
    with torch.inference_mode():
        fast = qmodel(ids).float()
        monkeypatch.setenv("QUAMBA_BACKEND", "torch")
        reference = qmodel(ids).float()
    assert (fast - reference).norm() / reference.norm() < 6e-2


def test_decode_continues_the_prefill(qmodel):
    """The steps through the int8 decode state: 0.067 (W8A8) and 0.060 (W4A8) off the full
    forward on an H200; the CPU test's model, 0.135 and 0.151 (bound 0.2)."""
    ids = tokens(2, 48, seed=5)
    with torch.inference_mode():
        full = qmodel(ids).float()
        cache = qmodel.allocate_cache(2)
        prefill = qmodel(ids[:, :40], cache=cache).float()
        steps = qmodel(ids[:, 40:], cache=cache).float()
    assert (prefill - full[:, :40]).norm() / full[:, :40].norm() < 2e-2
    assert (steps - full[:, 40:]).norm() / full[:, 40:].norm() < 0.1
