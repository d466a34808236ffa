"""Per-document agreement of two runs: counts, margins, which flips the noise explains, the
report files and the command line; and one real pair of runs (tiny-mamba fp32 against bf16)."""
import json

import pytest

from quamba.errors import QuambaError
from quamba.eval.agreement import agreement, main, margins, task_agreement
from quamba.eval.run import evaluate_zero_shot


def choice_samples(lls, gold):
    correct = [int(row[g] == max(row)) for row, g in zip(lls, gold)]
    return {"doc_id": list(range(len(lls))), "acc,none": correct, "loglikelihoods": lls,
            "gold": gold}


def test_margin_is_gold_minus_best_other_choice():
    samples = choice_samples([[-1.0, -3.0, -2.5], [-4.0, -2.0]], [0, 0])
    assert margins(samples) == [1.5, -2.0]
    assert margins({"doc_id": [0], "loglikelihoods": [[-1.0]]}) is None


def test_flip_within_the_noise_of_the_other_documents_is_explained():
    a = choice_samples([[-1.0, -1.01], [-5.0, -1.0], [-1.0, -2.0], [-1.0, -4.0]], [0, 0, 0, 0])
    # the documents that keep their answer move their margins by up to 0.05; the first flips
    b = choice_samples([[-1.02, -1.0], [-5.05, -1.0], [-1.0, -2.0], [-1.0, -4.02]], [0, 0, 0, 0])
    row = task_agreement(a, b)
    assert (row["documents"], row["agree"]) == (4, 3)
    assert row["noise"] == pytest.approx(0.05)
    [flip] = row["flips"]
    assert flip["doc_id"] == 0 and flip["correct_a"] == 1 and flip["explained"]
    assert flip["margin_a"] == pytest.approx(0.01) and flip["margin_b"] == pytest.approx(-0.02)


def test_flip_far_outside_the_noise_is_not_explained():
    a = choice_samples([[-1.0, -3.0], [-1.0, -2.0]], [0, 0])
    b = choice_samples([[-3.0, -1.0], [-1.0, -2.0]], [0, 0])
    [flip] = task_agreement(a, b)["flips"]
    assert not flip["explained"]


def test_single_continuation_task_reports_both_loglikelihoods():
    a = {"doc_id": [0, 1], "acc,none": [1, 0], "loglikelihoods": [[-2.0], [-9.0]]}
    b = {"doc_id": [0, 1], "acc,none": [0, 0], "loglikelihoods": [[-2.1], [-9.0]]}
    row = task_agreement(a, b)
    assert "noise" not in row
    assert row["flips"] == [{"doc_id": 0, "correct_a": 1, "loglikelihood_a": -2.0,
                             "loglikelihood_b": -2.1}]


def test_different_documents_or_no_shared_task_are_refused():
    a = choice_samples([[-1.0, -2.0]], [0])
    with pytest.raises(QuambaError, match="different documents"):
        task_agreement(a, {**a, "doc_id": [7]})
    run = {"zero_shot": {"per_sample": {"piqa": a}}}
    with pytest.raises(QuambaError, match="share no task"):
        agreement(run, {"zero_shot": {"per_sample": {"arc_easy": a}}})


def test_command_line_writes_json_and_markdown(tmp_path, capsys):
    run = {"zero_shot": {"per_sample": {"piqa": choice_samples([[-1.0, -2.0]], [0])}}}
    paths = []
    for name in ("a.json", "b.json"):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(run))
    assert main([*map(str, paths), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "agreement.json").read_text())["piqa"]["agree"] == 1
    assert "| piqa | 1 | 1 (100.00%)" in (tmp_path / "out" / "agreement.md").read_text()
    (tmp_path / "broken.json").write_text("{")
    assert main([str(paths[0]), str(tmp_path / "broken.json"), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: unreadable run")


@pytest.mark.slow
def test_fp32_and_bf16_runs_of_tiny_mamba_flip_only_within_the_noise(tiny_model_dir,
                                                                       shared_data_dir):
    """The CPU analogue of the GPU check: the same model in two precisions, 60 documents of a
    multiple-choice task; every document whose answer changes has a margin inside the change
    the other documents show."""
    import quamba
    runs = []
    for dtype in ("fp32", "bf16"):
        model, tokenizer = quamba.load_model(str(tiny_model_dir), dtype=dtype)
        result = evaluate_zero_shot(model, tokenizer, ["piqa"], shared_data_dir / "eval",
                                    limit=60, batch_size=8, bootstrap_iters=0)
        runs.append({"zero_shot": result})
    row = agreement(*runs)["piqa"]
    assert row["documents"] == 60 and row["noise"] > 0
    assert all(flip["explained"] for flip in row["flips"])
    assert row["agree"] >= 57
