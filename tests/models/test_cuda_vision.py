"""Vision Mamba on the GPU: the quantized bidirectional path on quamba's kernels against the torch
reference, every quantized op on cuda, batch independence, and the FP model on mamba-ssm's kernels."""
import pytest
import torch

import quamba
from quamba.models.mamba import randomize_
from quamba.models.vision import VisionMamba, VisionMambaConfig
from quamba.ops import backend, fp_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Vim-tiny's blocks (d_model 192, d_inner 384) over a 64 × 64 image: 16 × 16 patches of 4, class
# token in the middle, 257 tokens.
CONFIG = dict(img_size=64, patch_size=4, stride=4, d_model=192, n_layer=3, num_classes=100)


@pytest.fixture(scope="module")
def fp_model():
    model = VisionMamba(VisionMambaConfig(**CONFIG), device="cuda", dtype=torch.float16).eval()
    return randomize_(model, seed=0)


def images(batch: int, seed: int = 1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, 3, 64, 64, device="cuda", generator=gen, dtype=torch.float16)


@pytest.fixture(scope="module", params=["w8a8", "w4a8"])
def qmodel(request, fp_model):
    # d_model 192 is no multiple of 128: groups of 64
    bits = {"w8a8": dict(w_bits=8, a_bits=8), "w4a8": dict(w_bits=4, a_bits=8, group_size=64)}[request.param]
    assert backend.cuda_extension_error() is None, backend.cuda_extension_error()
    return quamba.quantize(fp_model, config=quamba.QuantConfig(calib_num_samples=16, **bits),
                           calib_data=images(16, seed=2), progress=False)


def test_every_quantized_op_runs_on_cuda(qmodel):
    with torch.inference_mode(), backend.recording() as ran:
        qmodel(images(2))
    assert {"w8a8_linear", "qconv1d", "qsscan", "hadamard_quant", "rmsnorm_quant"} <= set(ran)
    assert backend.on_reference(ran) == [], backend.summary(ran)


@pytest.mark.parametrize("mode", ["int8", "fp32-ssm-input", "fp32-conv"])
def test_kernels_match_the_torch_reference(qmodel, mode, monkeypatch):
    x = images(4, seed=3)
    qmodel.set_ssm_mode(mode)
    with torch.inference_mode():
        fast = qmodel(x).float()
        monkeypatch.setenv("QUAMBA_BACKEND", "torch")
        reference = qmodel(x).float()
    qmodel.set_ssm_mode("int8")
    assert (fast - reference).norm() / reference.norm() < 2e-2, mode
    assert (fast.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75


def test_each_sample_is_computed_on_its_own_on_the_gpu(qmodel, fp_model):
    x = images(5, seed=4)
    order = torch.tensor([4, 1, 3, 0, 2], device="cuda")
    for model in (qmodel, fp_model):
        with torch.inference_mode():
            together = model(x).float()
            alone = torch.cat([model(x[i:i + 1]) for i in range(5)]).float()
            shuffled = model(x[order]).float()
        assert torch.allclose(together, alone, atol=2e-2, rtol=2e-2)
        assert torch.allclose(shuffled, together[order], atol=2e-2, rtol=2e-2)


def test_fp_classifier_on_mamba_ssm_kernels_matches_the_reference(fp_model, monkeypatch):
    if fp_kernels.missing():
        pytest.skip(fp_kernels.missing())
    x = images(3, seed=5)
    with torch.inference_mode(), backend.recording() as ran:
        fast = fp_model(x).float()
    assert backend.summary(ran)["selective_scan"] == "cuda"
    monkeypatch.setenv("QUAMBA_BACKEND", "torch")
    with torch.inference_mode():
        reference = fp_model(x).float()
    assert (fast - reference).norm() / reference.norm() < 1e-2
