"""The lm-eval adapter: loglikelihoods against a direct computation, batching, rolling windows,
generation, and construction from a model directory."""
import math
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from quamba.eval.lm import QuambaLM
from quamba.eval.perplexity import perplexity
from quamba.eval.scoring import rolling_windows

TOKENIZER_FILE = (Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers" / "gpt-neox-20b"
                  / "tokenizer.json")

PAIRS = [
    ("The cat sat on the", " mat"),
    ("Question: How do I boil an egg?\nAnswer:", " Put it in boiling water for eight minutes."),
    ("A", " much longer continuation that spans quite a few tokens of text"),
    ("", "Hello world"),  # empty context: the eos token stands in for it
    ("Trailing space moves to the continuation ", "here"),
    ("Short", "!"),
]
TEXT = ("Robert Boulter is an English film, television and theatre actor. He had a guest starring "
        "role on the television series The Bill in 2000. This was followed by a starring role in "
        "the play Herons written by Simon Stephens, which was performed in 2001 at the Royal Court "
        "Theatre. He had a guest role in the television series Judge John Deed in 2002.")


def requests(pairs, kind="loglikelihood"):
    return [Instance(kind, {}, pair, index) for index, pair in enumerate(pairs)]


def generate(adapter, context, **gen_kwargs):
    text, = adapter.generate_until(requests([(context, gen_kwargs)], "generate_until"), disable_tqdm=True)
    return text


def scores(model, tokenizer, pairs, batch_size):
    adapter = QuambaLM(model=model, tokenizer=tokenizer, batch_size=batch_size)
    return adapter.loglikelihood(requests(pairs), disable_tqdm=True)


def direct_loglikelihood(model, context_ids, continuation_ids):
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids)[0].float(), dim=-1)
    positions = range(len(context_ids) - 1, len(context_ids) + len(continuation_ids) - 1)
    picked = [logprobs[p, t] for p, t in zip(positions, continuation_ids)]
    greedy = all(logprobs[p].argmax() == t for p, t in zip(positions, continuation_ids))
    return float(sum(picked)), bool(greedy)


def test_loglikelihood_equals_direct_computation(model, tokenizer):
    adapter = QuambaLM(model=model, tokenizer=tokenizer, batch_size=3)
    results = adapter.loglikelihood(requests(PAIRS), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, results):
        if context:
            stripped = context.rstrip()
            whole = tokenizer.encode(context + continuation)
            context_ids = tokenizer.encode(stripped)
            continuation_ids = whole[len(context_ids):]
        else:
            context_ids, continuation_ids = [tokenizer.eos_token_id], tokenizer.encode(continuation)
        expected, expected_greedy = direct_loglikelihood(model, context_ids, continuation_ids)
        assert logprob == pytest.approx(expected, abs=1e-3)
        assert greedy == expected_greedy


def test_empty_context_conditions_on_eos(model, tokenizer):
    adapter = QuambaLM(model=model, tokenizer=tokenizer)
    (logprob, _), = adapter.loglikelihood(requests([("", " world")]), disable_tqdm=True)
    expected, _ = direct_loglikelihood(model, [tokenizer.eos_token_id], tokenizer.encode(" world"))
    assert logprob == pytest.approx(expected, abs=1e-4)


def test_batched_equals_unbatched(model, tokenizer):
    pairs = PAIRS * 2 + [(TEXT[:n], TEXT[n:n + 40]) for n in (20, 90, 170)]
    one, many = scores(model, tokenizer, pairs, 1), scores(model, tokenizer, pairs, 5)
    assert [greedy for _, greedy in one] == [greedy for _, greedy in many]
    for (a, _), (b, _) in zip(one, many):
        assert a == pytest.approx(b, abs=1e-4)


def test_rolling_loglikelihood_equals_perplexity_module(model, tokenizer):
    adapter = QuambaLM(model=model, tokenizer=tokenizer, batch_size=2, max_length=16)
    total, = adapter.loglikelihood_rolling(requests([(TEXT,)], "loglikelihood_rolling"), disable_tqdm=True)
    result = perplexity(model, tokenizer, TEXT, window=16, batch_size=3, progress=False)
    assert -total == pytest.approx(result["nll"], rel=1e-5)
    assert result["tokens"] == len(tokenizer.encode(TEXT))
    assert result["windows"] == math.ceil(result["tokens"] / 16)
    assert result["perplexity"] == pytest.approx(math.exp(result["nll"] / result["tokens"]))


def test_rolling_windows_predict_every_token_once_within_the_window():
    tokens = list(range(100, 137))
    windows = rolling_windows(tokens, prefix_id=0, max_length=8)
    assert [t for _, continuation in windows for t in continuation] == tokens
    assert windows[0][0] == [0]
    for context, continuation in windows:
        assert len((context + continuation)[:-1]) <= 8
    # the inputs of consecutive windows do not overlap; the last, partial window reads a full
    # window of the tokens before its own
    inputs = [(context + continuation)[:-1] for context, continuation in windows]
    joined = sum(inputs[:-1], [])
    assert joined == ([0] + tokens)[:len(joined)]
    assert inputs[-1] == tokens[-9:-1]


def test_generate_until_is_greedy_and_honours_stop_sequences(model, tokenizer):
    adapter = QuambaLM(model=model, tokenizer=tokenizer)
    context = "Once upon a time"
    prompt = tokenizer.encode(context)
    direct = model.generate(torch.tensor([prompt]), max_new_tokens=6, eos_token_id=tokenizer.eos_token_id)
    new_tokens = direct[0, len(prompt):].tolist()
    if tokenizer.eos_token_id in new_tokens:
        new_tokens = new_tokens[:new_tokens.index(tokenizer.eos_token_id)]
    expected = tokenizer.decode(new_tokens)
    full = generate(adapter, context, max_gen_toks=6)
    assert full == expected
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop, "the random model should generate some text"
    assert generate(adapter, context, until=[stop], max_gen_toks=6) == full.split(stop, 1)[0]
    short = generate(adapter, context, max_gen_toks=2)
    assert len(tokenizer.encode(short)) <= 2 + 1  # re-tokenizing decoded text may split a token


def test_registered_for_lm_eval_and_built_from_model_args(model_dir):
    assert get_model("quamba") is QuambaLM
    adapter = QuambaLM.create_from_arg_string(
        f"pretrained={model_dir},tokenizer={TOKENIZER_FILE},dtype=fp32,max_length=64",
        {"batch_size": "4", "device": "cpu"})
    assert adapter.batch_size == 4 and adapter.max_length == 64
    assert adapter.eot_token_id == 0
    (logprob, _), = adapter.loglikelihood(requests([("Hello", " world")]), disable_tqdm=True)
    assert logprob < 0


def test_bad_construction_arguments(model, tokenizer):
    with pytest.raises(ValueError, match="exactly one"):
        QuambaLM(tokenizer=tokenizer)
    with pytest.raises(ValueError, match="batch_size"):
        QuambaLM(model=model, tokenizer=tokenizer, batch_size="auto")
    with pytest.raises(ValueError, match="unknown model_args"):
        QuambaLM(pretrained="x", no_such_option=1)


def test_task_text_beyond_the_models_vocabulary_is_a_one_line_error(tokenizer):
    from quamba.errors import QuambaError
    from quamba.models.config import MambaConfig
    from quamba.models.mamba import MambaLMHeadModel
    small = MambaLMHeadModel(MambaConfig(d_model=16, n_layer=1, vocab_size=64)).eval()
    adapter = QuambaLM(model=small, tokenizer=tokenizer)
    with pytest.raises(QuambaError, match="a task's text: token id .* vocabulary of 64"):
        adapter.loglikelihood([Instance("loglikelihood", {}, ("The quick brown", " fox"), 0)])
