"""lm-eval adapter for any quamba LM, FP or quantized (they share forward and generate).

Registered as ``quamba``. lm-eval finds models only in modules it has imported, so run its
command line through ``python -m quamba.eval``::

    python -m quamba.eval --model quamba --model_args pretrained=DIR,tokenizer=T --batch_size 16 \
        --tasks lambada_openai --device cpu

model_args: ``pretrained`` and the fields of :class:`quamba.cli_support.ModelRequest` (tokenizer,
dtype, device, quantize, w_bits, a_bits, hadamard, ssm_mode, calib_source, pretrained_dir,
backend, ...), plus ``max_length`` (default 2048) and ``max_gen_toks`` (default 256).

Data-parallel runs (torchrun) follow lm-eval's convention for LM subclasses: the adapter reports
``rank`` and ``world_size`` of the process group (quamba.eval.distributed), lm-eval's evaluator
deals each task's documents by them, and gathers through ``all_gather``, ``gather_object`` and
``barrier``, as lm-eval's HFLM.
"""
from __future__ import annotations

import itertools
import logging

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from quamba.eval import distributed
from quamba.eval.scoring import model_device, rolling_windows, score_continuations
from quamba.models.hub import check_token_ids

log = logging.getLogger("quamba")

DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256


@register_model("quamba")
class QuambaLM(TemplateLM):
    """Scores with right-padded batches sorted by length; generates greedily one request at a
    time (the model takes no attention mask, so left padding would leak into the SSM state).

    Give either ``model`` and ``tokenizer`` objects, or ``pretrained`` (a model directory, Hub
    id or saved quantized model name, resolved by :func:`quamba.cli_support.prepare_model`,
    which the remaining keyword arguments are passed to).
    """

    def __init__(self, pretrained: str | None = None, model=None, tokenizer=None,
                 batch_size: int | str = 1, max_length: int = DEFAULT_MAX_LENGTH,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, **model_args):
        super().__init__()
        if (pretrained is None) == (model is None):
            raise ValueError("give exactly one of pretrained (a name or path) and model (an object)")
        if model is None:
            model, tokenizer = _prepare(pretrained, tokenizer, model_args)
        elif model_args:
            raise ValueError(f"unexpected arguments with a model object: {', '.join(model_args)}")
        if tokenizer is None:
            raise ValueError("a tokenizer is needed")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.max_length = _positive_int(max_length, "max_length")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        self._device = model_device(model)
        self._rank, self._world_size = distributed.rank(), distributed.world_size()

    def all_gather(self, tensor):
        return distributed.all_gather_tensor(tensor)

    def gather_object(self, obj, dst: int = 0):
        gathered = distributed.gather_objects(obj, dst)
        return None if gathered is None else [_in_document_order(gathered)]

    def barrier(self) -> None:
        distributed.barrier()

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return self.model.config.eos_token_id if eos is None else eos

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))
        check_token_ids(ids, self.model.config.vocab_size, "a task's text")
        return ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False):
        """``requests``: ``(request strings or None, context tokens, continuation tokens)``."""
        collator = Collator(requests, sort_fn=lambda req: -(len(req[1]) + len(req[2])))
        scores = []
        with tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                  desc="quamba loglikelihood") as bar:
            for chunk in collator.get_batched(n=self.batch_size):
                chunk_scores = score_continuations(self.model, [(ctx, cont) for _, ctx, cont in chunk],
                                                   self.max_length, pad_id=self.eot_token_id)
                for (request, _, _), score in zip(chunk, chunk_scores):
                    if request is not None:
                        self.cache_hook.add_partial("loglikelihood", request, score)
                scores.extend(chunk_scores)
                bar.update(len(chunk))
        return collator.get_original(scores)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in rolling_windows(self.tok_encode(text), self.prefix_token_id,
                                                         self.max_length):
                windows.append((None, context, continuation))
                owners.append(index)
        window_scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, window_scores):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0,
                            desc="quamba generate_until"):
            context, gen_kwargs = request.args
            text = self._generate_one(context, gen_kwargs)
            self.cache_hook.add_partial("generate_until", request.args, text)
            outputs.append(text)
        return outputs

    def _generate_one(self, context: str, gen_kwargs: dict) -> str:
        """Greedy continuation of ``context``, cut before the first stop sequence."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if kwargs.get("do_sample"):
            log.warning("quamba generate_until decodes greedily; ignoring do_sample")
        until = handle_stop_sequences(kwargs.get("until"), eos=self.tok_decode([self.eot_token_id]))
        max_new = kwargs["max_gen_toks"]
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks {max_new} must be below max_length {self.max_length}")
        prompt = self.tok_encode(context)[-(self.max_length - max_new):] or [self.eot_token_id]
        input_ids = torch.tensor([prompt], dtype=torch.long, device=self._device)
        with torch.inference_mode():
            output = self.model.generate(input_ids, max_new_tokens=max_new,
                                         eos_token_id=self.eot_token_id)
        new_tokens = output[0, len(prompt):].tolist()
        if self.eot_token_id in new_tokens:
            new_tokens = new_tokens[:new_tokens.index(self.eot_token_id)]
        text = self.tok_decode(new_tokens)
        for stop in until:
            if stop:
                text = text.split(stop, 1)[0]
        return text


def _in_document_order(per_rank: list[dict]) -> dict:
    """The ranks' payloads of lm-eval's evaluate() as one, in the single-process order.

    evaluate() gathers, per task, the logged samples (a list: per filter, one per document) and
    the raw metrics (``(metric, filter)`` to one value per document), and chains the ranks'
    lists. Its documents were dealt round-robin, so dealing the lists back restores the order of
    a single-process run, in which order-dependent aggregates (float sums, bootstrap standard
    errors) come out the same."""
    merged = {}
    for task in per_rank[0]:
        parts = [payload[task] for payload in per_rank]
        if isinstance(parts[0], dict):
            keys = dict.fromkeys(key for part in parts for key in part)
            merged[task] = {key: _undeal([part.get(key, []) for part in parts]) for key in keys}
        else:
            filters = list(dict.fromkeys(sample["filter"] for part in parts for sample in part))
            merged[task] = sorted(itertools.chain(*parts),
                                  key=lambda sample: (filters.index(sample["filter"]),
                                                      sample["doc_id"]))
    return merged


_NONE = object()


def _undeal(lists: list[list]) -> list:
    """The inverse of dealing one list round-robin into ``lists``."""
    rounds = itertools.zip_longest(*lists, fillvalue=_NONE)
    return [item for row in rounds for item in row if item is not _NONE]


def _prepare(pretrained: str, tokenizer, model_args: dict):
    from quamba.cli_support import ModelRequest, prepare_model
    try:
        request = ModelRequest(model=str(pretrained), tokenizer=tokenizer, **model_args)
    except TypeError:
        known = ", ".join(ModelRequest.__dataclass_fields__)
        raise ValueError(f"unknown model_args among {', '.join(model_args)}; known: {known}") from None
    prepared = prepare_model(request)
    log.info("%s", prepared.summary())
    return prepared.model, prepared.tokenizer


def _positive_int(value, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number
