"""The README's main command on the GPU against the same command on the CPU: the trained test
model quantized W8A8 and evaluated on lambada_openai and piqa (--testing: 100 documents each),
each run on its own device (fp16 and the kernels on the GPU, fp32 and the torch references on the
CPU). Per-document correctness agrees, and every flipped document is a near-tie that the two
devices' rounding explains: for piqa by its choices' margin (quamba.eval.agreement), for lambada
by the gap between the target token and the best other one at the position where the greedy
check turned."""
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")  # on the GPU machine: scripts/gpu_check.sh --eval installs it

import main  # noqa: E402
from quamba.eval.agreement import agreement  # noqa: E402
from quamba.eval.scoring import model_device  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MIN_AGREEMENT = 0.95


def readme_command(device: str, out: Path, model: Path, data: Path) -> list[str]:
    return [str(model), "--quantize", "--calib_data", str(data / "text" / "c4_sample.jsonl"),
            "--calib_data_num", "64", "--calib_seqlen", "256", "--eval_zero_shot", "--task_list", "lambada_openai,piqa",
            "--testing", "--task_data", str(data / "eval"), "--device", device,
            "--log_dir", str(out / "logs"), "--pretrained_dir", str(out / "pretrained")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, shared_data_dir):
    records, models = {}, {}
    for device in ("cpu", "cuda"):
        out = tmp_path_factory.mktemp(device)
        assert main.main(readme_command(device, out, tiny_model_dir, shared_data_dir)) == 0
        [path] = (out / "logs").glob("*.json")
        records[device] = json.loads(path.read_text())
        models[device] = out / "pretrained"
    return records, models


def test_runs_record_their_devices_and_every_quantized_op_on_a_kernel_on_the_gpu(runs):
    """As ``python -m quamba.env --strict``: the quantized ops run kernels; the FP ops (the
    final fused add + RMSNorm) run mamba-ssm's where it is installed, else their reference."""
    from quamba.ops import backend
    records, _ = runs
    assert records["cuda"]["model"]["device"].startswith("cuda")
    assert records["cpu"]["model"]["device"] == "cpu"
    backends = records["cuda"]["model"]["op_backends"]
    quantized = {op: ran for op, ran in backends.items() if op not in backend.fp_ops()}
    assert quantized and "torch" not in quantized.values(), backends


def test_piqa_agrees_and_every_flip_is_a_near_tie(runs):
    records, _ = runs
    row = agreement(records["cpu"], records["cuda"])["piqa"]
    print(f"piqa: {row['agree']}/{row['documents']} agree, noise {row['noise']:.3g}, "
          f"flips {row['flips']}")
    assert row["agree"] >= MIN_AGREEMENT * row["documents"]
    assert all(flip["explained"] for flip in row["flips"]), row["flips"]


def token_logprobs(model, adapter, doc_text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """lambada's continuation (the last word) given its context, as lm-eval encodes the pair:
    per continuation token, its log-probability and its gap to the best other token."""
    context, word = doc_text.rsplit(" ", 1)
    context_ids, continuation_ids = adapter._encode_pair(context, " " + word)
    ids = torch.tensor([context_ids + continuation_ids[:-1]], device=model_device(model))
    with torch.inference_mode():
        logits = model(ids, num_last_tokens=len(continuation_ids))[0].float()
    logprobs = torch.log_softmax(logits, dim=-1).cpu()
    target = torch.tensor(continuation_ids)
    picked = logprobs.gather(-1, target[:, None]).squeeze(-1)
    others = logprobs.scatter(-1, target[:, None], float("-inf")).amax(-1)
    return picked, picked - others


def test_lambada_agrees_and_every_flip_is_a_near_tie(runs, shared_data_dir):
    """A greedy flip needs the target's gap to the best other token to change sign at some
    position; between the devices a gap moves by at most twice the largest change of a token's
    log-probability, which the documents that did not flip bound."""
    import json

    from quamba.eval.lm import QuambaLM
    from quamba.quantization.checkpoint import from_pretrained

    records, models = runs
    row = agreement(records["cpu"], records["cuda"])["lambada_openai"]
    docs = [json.loads(line) for line in (shared_data_dir / "eval" / "lambada_openai_test.jsonl")
            .read_text().splitlines()[:row["documents"]]]
    scores = {}
    for device in ("cpu", "cuda"):
        [saved] = models[device].iterdir()
        model, tokenizer = from_pretrained(str(saved), device=device)
        adapter = QuambaLM(model=model, tokenizer=tokenizer)
        scores[device] = [token_logprobs(model, adapter, doc["text"]) for doc in docs]
    flipped = {flip["doc_id"] for flip in row["flips"]}
    noise = max(float((scores["cpu"][i][0] - scores["cuda"][i][0]).abs().max())
                for i in range(len(docs)) if i not in flipped)
    gaps = {i: min(float(scores[d][i][1].abs().min()) for d in scores) for i in flipped}
    print(f"lambada: {row['agree']}/{row['documents']} agree, token noise {noise:.3g}, "
          f"flipped documents' smallest gaps {gaps}")
    assert row["agree"] >= MIN_AGREEMENT * row["documents"]
    assert all(gap <= 2 * noise for gap in gaps.values()), gaps
