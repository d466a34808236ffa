"""W8A8 and W4A8 Vision Mamba on the trained test classifier (tests/fixtures/tiny-vim): accuracy
against FP on the digits test split, every SSM mode, batch independence, determinism, checkpoints."""
import pytest
import torch

import quamba
from quamba.errors import QuambaError
from quamba.eval.images import evaluate_images, load_image_set, normalize
from quamba.models.mamba import randomize_
from quamba.models.quantized_vision import QuantizedVisionMamba
from quamba.models.vision import VisionMamba, VisionMambaConfig

RECIPES = {"w8a8": dict(w_bits=8, a_bits=8), "w4a8": dict(w_bits=4, a_bits=8, group_size=48)}
CALIB_IMAGES = 512


@pytest.fixture(scope="module")
def fp_model(repo_root):
    model, _ = quamba.load_model(repo_root / "tests" / "fixtures" / "tiny-vim")
    return model


@pytest.fixture(scope="module")
def test_set():
    return load_image_set("digits", "test")


@pytest.fixture(scope="module")
def quantized(fp_model):
    """recipe name → the fixture quantized with it (digits train images for calibration)."""
    return {name: quamba.quantize(fp_model, config=quamba.QuantConfig(calib_num_samples=CALIB_IMAGES,
                                                                       **bits),
                                  calib_data="digits", progress=False)
            for name, bits in RECIPES.items()}


@pytest.fixture(scope="module")
def fp_top1(fp_model, test_set):
    return evaluate_images(fp_model, test_set)["top1"]


def test_the_fixture_classifies_far_above_chance(fp_top1, repo_root):
    import json
    report = json.loads((repo_root / "tests" / "fixtures" / "tiny-vim" / "training_report.json").read_text())
    assert fp_top1 == pytest.approx(report["test_top1"]) and fp_top1 > 0.9


@pytest.mark.parametrize("recipe, allowed_drop", [("w8a8", 0.005), ("w4a8", 0.02)])
def test_quantized_accuracy_stays_near_fp(quantized, test_set, fp_top1, recipe, allowed_drop):
    top1 = evaluate_images(quantized[recipe], test_set)["top1"]
    assert top1 >= fp_top1 - allowed_drop, (recipe, top1, fp_top1)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_ssm_mode_runs_and_the_int8_ones_agree(quantized, test_set, recipe):
    model = quantized[recipe]
    x = normalize(test_set.images[:64], model.config)
    logits = {}
    with torch.no_grad():
        for mode in quamba.SSM_MODES:
            logits[mode] = model.set_ssm_mode(mode)(x).float()
    model.set_ssm_mode("int8")

    def error(a, b):
        return ((logits[a] - logits[b]).norm() / logits[b].norm()).item()
    assert error("fp32-ssm-input", "int8") < 1e-3  # the same codes, the scan in fp32
    assert error("float-sim-asic-int8", "int8") < 0.02  # int8 simulated in float
    assert error("fp16", "int8") < 0.2 and error("fp32-conv", "fp16") < 0.2
    assert (logits["int8"].argmax(-1) == logits["fp16"].argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("mode", ["int8", "fp32-ssm-input", "float-sim-asic-int8", "fp32-conv"])
def test_each_sample_is_computed_on_its_own_in_every_mode(quantized, test_set, mode):
    model = quantized["w8a8"].set_ssm_mode(mode)
    x = normalize(test_set.images[:6], model.config)
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    with torch.no_grad():
        together = model(x)
        alone = torch.cat([model(x[i:i + 1]) for i in range(len(x))])
        shuffled = model(x[order])
    model.set_ssm_mode("int8")
    assert torch.allclose(together, alone, atol=1e-4, rtol=1e-4)
    assert torch.allclose(shuffled, together[order], atol=1e-4, rtol=1e-4)


def test_calibration_is_deterministic(fp_model, quantized):
    again = quamba.quantize(fp_model, config=quamba.QuantConfig(calib_num_samples=CALIB_IMAGES),
                            calib_data="digits", progress=False)
    first = {k: v for k, v in quantized["w8a8"].state_dict().items()}
    assert again.calibration == quantized["w8a8"].calibration
    assert all(torch.equal(first[k], v) for k, v in again.state_dict().items())


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_and_reload_give_identical_logits_in_every_mode(quantized, test_set, tmp_path, recipe):
    model = quantized[recipe]
    model.save_pretrained(tmp_path / recipe)
    reloaded, tokenizer = quamba.load_model(tmp_path / recipe)
    assert tokenizer is None and isinstance(reloaded, QuantizedVisionMamba)
    x = normalize(test_set.images[:16], model.config)
    with torch.no_grad():
        for mode in quamba.SSM_MODES:  # fp16 reloads the FP model from the recorded base model
            assert torch.equal(model.set_ssm_mode(mode)(x), reloaded.set_ssm_mode(mode)(x)), mode
    model.set_ssm_mode("int8")


def test_backends_of_a_quantized_classifier_are_reported(quantized):
    ran = quantized["w8a8"].op_backends()
    assert {"w8a8_linear", "qconv1d", "qsscan", "hadamard_quant", "rmsnorm_quant"} <= set(ran)
    assert set(ran.values()) == {"torch"}  # the CPU runs the references


def test_images_as_a_tensor_calibrate_too(fp_model, test_set):
    x = normalize(load_image_set("digits", "train").images[:32], fp_model.config)
    model = quamba.quantize(fp_model, config=quamba.QuantConfig(calib_num_samples=32), calib_data=x,
                            progress=False)
    assert model.calibration["source"] == "image tensor" and model.calibration["num_samples"] == 32


@pytest.mark.parametrize("config, calib, message", [
    (dict(w_bits=4, a_bits=16), "digits", "W4A16 is not supported"),
    (dict(w_bits=4, a_bits=8, apply_gptq=True), "digits", "GPTQ is not supported"),
    (dict(), None, "calibrated on images"),
    (dict(), "no-such-image-set", "unknown image set"),
    (dict(), torch.full((4, 1, 8, 8), float("nan")), "NaN"),
])
def test_bad_requests_are_clear_errors(fp_model, config, calib, message):
    with pytest.raises(QuambaError, match=message):
        quamba.quantize(fp_model, config=quamba.QuantConfig(**config), calib_data=calib, progress=False)


def test_separate_branch_models_are_refused():
    config = VisionMambaConfig(img_size=8, patch_size=2, stride=2, channels=1, d_model=24, n_layer=1,
                               num_classes=3, bimamba="separate", image_mean=(0.5,), image_std=(0.5,))
    model = randomize_(VisionMamba(config), seed=0)
    with pytest.raises(QuambaError, match="only bimamba 'v2'"):
        quamba.quantize(model, calib_data=torch.randn(4, 1, 8, 8), progress=False)
