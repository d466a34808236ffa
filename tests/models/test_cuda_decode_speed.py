"""GPU speed as a user gets it: a model quantized at Mamba-2.8B's layer shapes runs every quantized
op of its prefill and graphed decode step on quamba's CUDA kernels, and its decode step is faster
than the FP16 one, timed in the same test.

These fail, rather than skip, on a GPU where quamba._C is missing or cannot run: that is the
defect they exist to catch (a quantized model silently 10-25x slower on the torch references).
"""
import statistics

import pytest
import torch

import quamba
from quamba.models.config import preset_config
from quamba.models.generation import graphed_decoder
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops import backend, fp_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Mamba-2.8B's blocks (d_model 2560, d_inner 5120, dt_rank 160) with 4 layers and a small
# vocabulary, so that the blocks, not the lm_head, make the step's weight bytes.
N_LAYER, VOCAB = 4, 4096
PRECISIONS = {"w8a8": (8, 8), "w4a8": (4, 8), "w4a16": (4, 16)}
PROMPT_LEN, BATCH = 64, 1


@pytest.fixture(scope="module")
def fp_model():
    config = preset_config("2.8b")
    config.n_layer, config.vocab_size = N_LAYER, VOCAB
    model = MambaLMHeadModel(config, device="cuda", dtype=torch.float16).eval()
    return randomize_(model, seed=0)


@pytest.fixture(scope="module")
def prompt():
    gen = torch.Generator(device="cuda").manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, PROMPT_LEN), device="cuda", generator=gen)


def quantized(fp_model, precision):
    w_bits, a_bits = PRECISIONS[precision]
    gen = torch.Generator(device="cuda").manual_seed(0)
    calib = torch.randint(0, VOCAB, (4, 256), device="cuda", generator=gen)
    config = quamba.QuantConfig(w_bits=w_bits, a_bits=a_bits, seed=0)
    return quamba.quantize(fp_model, config=config, calib_data=calib, progress=False)


def prefilled_step(model, prompt):
    """The model's graphed decode step, its cache filled by a prefill of ``prompt``."""
    cache, step = graphed_decoder(model, prompt.shape[0], "cuda")
    cache.seqlen_offset = 0
    next_ids = model(prompt, cache=cache, num_last_tokens=1)[:, -1].argmax(-1)
    return lambda: step(next_ids)


def step_ms(step, replays: int = 100) -> float:
    """Median time of one graphed step, waited on as a TPOT is (CUDA events around it)."""
    for _ in range(10):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def test_quamba_kernels_load_on_this_gpu():
    assert backend.cuda_extension_error() is None, backend.cuda_extension_error()
    assert backend.device_error(torch.cuda.current_device()) is None


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_quantized_op_runs_on_cuda(fp_model, prompt, precision):
    model = quantized(fp_model, precision)
    with torch.inference_mode(), backend.recording() as ran:
        prefilled_step(model, prompt)()
    int8_ops = {"rmsnorm_quant", "w8a8_linear", "qconv1d", "qconv1d_update", "qsscan",
                "qsscan_update", "hadamard_quant"}
    # W8A8's and W4A8's batch-1 decode step: one qmamba_layer_step a block where its layer kernel
    # runs here
    layer_kernel = torch.ops.quamba.qmamba_layer_step_lacks(2560, 5120, 16, 160, 4,
                                                            torch.cuda.current_device()) == ""
    if layer_kernel:
        int8_ops = (int8_ops - {"qconv1d_update", "qsscan_update"}) | {"qmamba_layer_step"}
    expected = {"w8a8": int8_ops, "w4a8": int8_ops | {"w4a8_linear"}, "w4a16": {"w4a16_linear"}}
    assert expected[precision] <= set(ran), sorted(ran)
    assert backend.on_reference(ran) == [], {op: backend.cuda_missing(op, torch.device("cuda"))
                                             for op in backend.on_reference(ran)}
    reported = {op: name for op, name in model.op_backends().items() if op in backend.quamba_ops()}
    assert set(reported) >= expected[precision] and set(reported.values()) == {"cuda"}, reported


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_quantized_decode_step_beats_fp16(fp_model, prompt, precision):
    if fp_kernels.missing():
        pytest.skip(f"the FP16 baseline needs mamba-ssm's kernels: {fp_kernels.missing()}")
    with torch.inference_mode():
        fp_step = prefilled_step(fp_model, prompt)
        model = quantized(fp_model, precision)
        quant_step = prefilled_step(model, prompt)
        fp_ms, quant_ms = [], []
        for _ in range(3):  # alternate, so that a slow phase of the GPU hits both
            fp_ms.append(step_ms(fp_step))
            quant_ms.append(step_ms(quant_step))
    ratio = statistics.median(quant_ms) / statistics.median(fp_ms)
    print(f"{precision}: decode step {statistics.median(quant_ms) * 1e3:.1f} us, fp16 "
          f"{statistics.median(fp_ms) * 1e3:.1f} us, ratio {ratio:.3f}")
    assert ratio < 1.0, f"{precision} decode step is {ratio:.2f}x the fp16 step's time"
