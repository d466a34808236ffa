"""Mode comparison: McNemar's exact test, the Markdown report and chart, layer-wise SQNR."""
import json
import math

import pytest
import torch

import quamba
from quamba.errors import QuambaError
from quamba.eval.compare import (LAYER_TAPS, MAMBA2_LAYER_TAPS, layer_kinds, layerwise_sqnr,
                                 mcnemar_exact, sqnr_db, write_layer_report, write_mode_report)
from quamba.models import MambaConfig, MambaLMHeadModel, randomize_


def test_mcnemar_exact_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0
    assert math.isclose(mcnemar_exact(0, 5), 2 / 32)  # two-sided: both all-one-way outcomes
    assert math.isclose(mcnemar_exact(1, 9), 2 * 11 / 1024)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)


def run_record(mode, correct, stderr=0.05):
    accuracy = sum(correct) / len(correct)
    return {"model": {"ssm_mode": mode},
            "zero_shot": {"results": {"piqa": {"acc,none": accuracy, "acc_stderr,none": stderr}},
                          "per_sample": {"piqa": {"doc_id": list(range(len(correct))),
                                                  "acc,none": correct}}}}


def write_runs(tmp_path, runs):
    paths = []
    for mode, correct in runs.items():
        path = tmp_path / f"{mode}.json"
        path.write_text(json.dumps(run_record(mode, correct)))
        paths.append(path)
    return paths


def test_mode_report_and_chart(tmp_path):
    paths = write_runs(tmp_path, {"int8": [1, 1, 0, 1, 0, 1], "fp32-conv": [1, 1, 1, 1, 1, 1],
                                  "fp16": [1, 0, 0, 1, 0, 1]})
    report, chart = write_mode_report(paths, tmp_path / "out")
    text = report.read_text()
    assert "| fp32-conv | 1.0000 | 0.0500 | +0.3333 | 0 / 2 | 0.5 |" in text
    assert "| fp16 | 0.5000 | 0.0500 | -0.1667 | 1 / 0 | 1 |" in text
    assert text.index("| int8 |") < text.index("| fp32-conv |") < text.index("| fp16 |")
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mode_report_needs_int8_and_the_same_documents(tmp_path):
    with pytest.raises(QuambaError, match="no run in mode int8"):
        write_mode_report(write_runs(tmp_path, {"fp16": [1, 0]}), tmp_path / "out")
    paths = write_runs(tmp_path, {"int8": [1, 0, 1], "fp16": [1, 0]})
    with pytest.raises(QuambaError, match="different documents"):
        write_mode_report(paths, tmp_path / "out")


def test_sqnr_db():
    x = torch.randn(100, dtype=torch.float64)
    assert sqnr_db(x, x) == math.inf
    assert math.isclose(sqnr_db(x, 0.9 * x), 20.0, rel_tol=1e-9)


@pytest.fixture(scope="module")
def quantized_random_model():
    model = randomize_(MambaLMHeadModel(MambaConfig(d_model=64, n_layer=2, vocab_size=256)), seed=3)
    calib = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    return quamba.quantize(model.eval(), None, quamba.QuantConfig(), calib_data=calib, progress=False)


def test_layerwise_sqnr_covers_every_mode_layer_and_tap(quantized_random_model, tmp_path):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    sqnr = layerwise_sqnr(quantized_random_model, ids)
    assert set(sqnr) == {"int8", "fp32-ssm-input", "float-sim-asic-int8", "fp32-conv"}
    for layers in sqnr.values():
        assert len(layers) == 2
        assert all(set(layer) == set(LAYER_TAPS) for layer in layers)
    # the int8 path quantizes u; the fp32-conv mode does not, so its u is closer to FP
    assert sqnr["fp32-conv"][0]["u"] > sqnr["int8"][0]["u"] > 20
    assert abs(sqnr["float-sim-asic-int8"][1]["out"] - sqnr["int8"][1]["out"]) < 3
    assert quantized_random_model.ssm_mode == "int8"
    report, plot = write_layer_report(quantized_random_model, ids, tmp_path)
    assert "## u" in report.read_text() and plot.stat().st_size > 1000


def test_layerwise_sqnr_walks_a_hybrids_blocks(tmp_path):
    """The trained Nemotron-H (pattern M*M-M-): its Mamba2 layers report their mixers' taps, its
    attention and MLP layers their output, each row labelled with the layer's kind."""
    from tests.models.test_fixture_hybrid import TINY_HYBRID_DIR
    model, _ = quamba.load_model(TINY_HYBRID_DIR)
    calib = torch.randint(0, 4096, (4, 32), generator=torch.Generator().manual_seed(0))
    qmodel = quamba.quantize(model, None, quamba.QuantConfig(hadamard=False), calib_data=calib,
                             progress=False)
    assert layer_kinds(model) == ["mamba2", "attention", "mamba2", "mlp", "mamba2", "mlp"]
    ids = torch.randint(0, 4096, (2, 37), generator=torch.Generator().manual_seed(1))
    sqnr = layerwise_sqnr(qmodel, ids, modes=("int8", "fp32-conv"))
    for layers in sqnr.values():
        assert [set(layer) for layer in layers[:2]] == [set(MAMBA2_LAYER_TAPS), {"out"}]
        assert set(layers[3]) == {"out"}
        assert all(10 < value < 80 for layer in layers for value in layer.values())
    report, plot = write_layer_report(qmodel, ids, tmp_path)
    text = report.read_text()
    assert "| 1 (attention) |" in text and "| 3 (mlp) |" in text and "| 2 (mamba2) |" in text
    assert "| 1 (attention) |" not in text.split("## out\n")[0]  # only in the output table
    assert json.loads((tmp_path / "layer_sqnr.json").read_text())["layer_kinds"][1] == "attention"
