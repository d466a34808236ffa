"""Model resolution for runs: FP, freshly quantized and saved, reused only for the same recipe."""
import dataclasses
import logging
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance

from quamba.cli_support import ModelRequest, prepare_model, saved_model_name
from quamba.errors import ModelNotFoundError, QuambaError
from quamba.eval.lm import QuambaLM

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TOKENIZER = str(SHARED_DATA / "tokenizers" / "gpt-neox-20b" / "tokenizer.json")
CALIB = str(SHARED_DATA / "text" / "tinyshakespeare.txt")


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pretrained")


@pytest.fixture(scope="module")
def quantize_request(model_dir, pretrained_dir):
    return ModelRequest(model=str(model_dir), quantize=True, calib_source=CALIB, calib_num_samples=4,
                        calib_seqlen=32, pretrained_dir=str(pretrained_dir), tokenizer=TOKENIZER,
                        device="cpu")


@pytest.fixture(scope="module")
def quantized(quantize_request):
    return prepare_model(quantize_request)


def test_saved_model_name():
    assert saved_model_name("state-spaces/mamba-130m", 8, 8) == "quamba-mamba-130m-w8a8"
    assert saved_model_name("/models/mamba-2.8b/", 4, 8) == "quamba-mamba-2.8b-w4a8"
    assert saved_model_name("m", 4, 8, learn_scales=True) == "quamba-m-w4a8-learned"
    assert saved_model_name("m", 4, 8, learn_scales=True,
                            learn_weight_clipping=True) == "quamba-m-w4a8-learned-clip"


def test_fp_model_loads_with_the_fp_mode_only(model_dir):
    prepared = prepare_model(ModelRequest(model=str(model_dir), tokenizer=TOKENIZER, device="cpu"))
    assert prepared.quant_config is None and prepared.ssm_mode == "fp16" and prepared.dtype == "float32"
    assert "unquantized" in prepared.summary() and "backend" in prepared.summary()
    with pytest.raises(QuambaError, match="needs a quantized model"):
        prepare_model(ModelRequest(model=str(model_dir), tokenizer=TOKENIZER, ssm_mode="int8"))


def test_missing_model_says_so(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        prepare_model(ModelRequest(model=str(tmp_path / "nope")))
    with pytest.raises(ModelNotFoundError, match="nor is it a saved model under"):
        prepare_model(ModelRequest(model="./nope", pretrained_dir=str(tmp_path)))


def test_quantize_saves_then_reuses_the_same_recipe(quantized, quantize_request, pretrained_dir):
    target = pretrained_dir / saved_model_name(quantize_request.model, 8, 8)
    assert quantized.how == "quantized" and quantized.saved_to == str(target)
    assert (target / "config.json").is_file()
    assert quantized.ssm_mode == "int8" and "W8A8" in quantized.summary()
    reused = prepare_model(dataclasses.replace(quantize_request, ssm_mode="fp32-ssm-input"))
    assert reused.how == "reused saved quantized model" and reused.ssm_mode == "fp32-ssm-input"


def test_saved_name_resolves_under_pretrained_dir(quantized, quantize_request, pretrained_dir):
    name = saved_model_name(quantize_request.model, 8, 8)
    prepared = prepare_model(ModelRequest(model=name, pretrained_dir=str(pretrained_dir),
                                          ssm_mode="float-sim-asic-int8"))
    assert prepared.quant_config.same_recipe(quantize_request.quant_config())
    assert prepared.ssm_mode == "float-sim-asic-int8"
    with pytest.raises(QuambaError, match="already quantized with a different recipe"):
        prepare_model(dataclasses.replace(quantize_request, model=name, seed=7))


def test_adapter_scores_a_quantized_model_the_same_batched(quantized):
    pairs = [("The king", " is dead"), ("To be or not", " to be, that is the question"), ("A", " horse")]
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    one = QuambaLM(model=quantized.model, tokenizer=quantized.tokenizer, batch_size=1)
    many = QuambaLM(model=quantized.model, tokenizer=quantized.tokenizer, batch_size=3)
    for (a, _), (b, _) in zip(one.loglikelihood(instances, disable_tqdm=True),
                              many.loglikelihood(instances, disable_tqdm=True)):
        assert a == pytest.approx(b, abs=1e-4)


def test_a_different_recipe_is_requantized_and_says_so(quantized, quantize_request, caplog):
    with caplog.at_level(logging.WARNING, logger="quamba"):
        again = prepare_model(dataclasses.replace(quantize_request, hadamard=False))
    assert again.how == "quantized" and not again.quant_config.hadamard
    assert "re-quantizing" in caplog.text and "hadamard" in caplog.text
