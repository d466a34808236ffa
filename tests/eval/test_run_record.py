"""Run records: one strict JSON file per run with versions, config and per-sample correctness."""
import json
import math

import pytest

from quamba import __version__
from quamba.errors import QuambaError
from quamba.eval.run import (per_sample_correctness, run_json_path, summary_lines,
                             write_run_json)

SAMPLES = {"piqa": [
    {"doc_id": 1, "filter": "none", "metrics": ["acc", "acc_norm"], "acc": 0.0, "acc_norm": 1.0},
    {"doc_id": 0, "filter": "none", "metrics": ["acc", "acc_norm"], "acc": 1.0, "acc_norm": 1.0},
], "lambada_openai": [
    {"doc_id": 0, "filter": "none", "metrics": ["perplexity", "acc"], "perplexity": -3.2, "acc": 1},
]}


def test_per_sample_correctness_keeps_binary_metrics_in_document_order():
    table = per_sample_correctness(SAMPLES)
    assert table["piqa"] == {"doc_id": [0, 1], "acc,none": [1, 0], "acc_norm,none": [1, 1]}
    assert table["lambada_openai"] == {"doc_id": [0], "acc,none": [1]}


def test_run_file_is_strict_json_with_versions(tmp_path):
    payload = {"config": {"model": "m"}, "zero_shot": {"per_sample": per_sample_correctness(SAMPLES),
                                                        "results": {"piqa": {"acc_stderr,none": math.nan}}}}
    path = write_run_json(run_json_path(tmp_path, "state-spaces/mamba-130m"), payload)
    record = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert record["quamba_version"] == __version__
    assert "git" in record and record["config"] == {"model": "m"}
    assert record["zero_shot"]["results"]["piqa"]["acc_stderr,none"] is None
    assert record["zero_shot"]["per_sample"]["piqa"]["acc,none"] == [1, 0]
    assert path.name.startswith("mamba-130m-") and path.suffix == ".json"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_existing_run_file_is_never_replaced(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("{}")
    with pytest.raises(QuambaError, match="already exists"):
        write_run_json(path, {"x": 1})
    assert path.read_text() == "{}"


def test_run_file_names_are_unique(tmp_path):
    assert len({run_json_path(tmp_path, "model") for _ in range(50)}) == 50


def test_summary_lines_show_metrics_with_stderr():
    lines = summary_lines({"piqa": {"alias": "piqa", "acc,none": 0.5, "acc_stderr,none": 0.25}})
    assert lines == ["piqa: acc 0.5000 ± 0.2500"]


def test_per_sample_records_each_documents_loglikelihoods_and_gold_choice():
    rows = [{"doc_id": 1, "filter": "none", "metrics": ["acc"], "acc": 0.0, "target": 1,
             "filtered_resps": [(-1.5, False), (-2.0, False)]},
            {"doc_id": 0, "filter": "none", "metrics": ["acc"], "acc": 1.0, "target": 0,
             "filtered_resps": [(-0.5, True), (-3.0, False)]}]
    assert per_sample_correctness({"piqa": rows})["piqa"] == {
        "doc_id": [0, 1], "acc,none": [1, 0], "loglikelihoods": [[-0.5, -3.0], [-1.5, -2.0]],
        "gold": [0, 1]}
    lambada = [{**rows[0], "target": " word", "filtered_resps": [(-9.0, False)]}]
    assert per_sample_correctness({"lambada": lambada})["lambada"]["loglikelihoods"] == [[-9.0]]
    assert "gold" not in per_sample_correctness({"lambada": lambada})["lambada"]
    generated = [{**rows[0], "filtered_resps": ["some text"]}]
    assert "loglikelihoods" not in per_sample_correctness({"gen": generated})["gen"]
