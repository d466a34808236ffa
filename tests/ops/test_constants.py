"""quamba.ops.constants: a launcher's constant is made once per version of its tensor and key,
never kept for an inference tensor, served as kept to a CUDA-graph capture and never made during
one kept; a kernel's workspace is kept per tensor and kernel, never made during a capture kept."""
import torch

from quamba.ops import constants
from quamba.ops.constants import cached, workspace


def counting_maker(calls: list):
    def make():
        calls.append(1)
        return torch.tensor(float(len(calls)))
    return make


def test_a_constant_is_kept_per_key_until_its_tensor_changes():
    anchor, calls = torch.ones(3), []
    make = counting_maker(calls)
    first = cached(anchor, ("a",), make)
    assert cached(anchor, ("a",), make) is first and len(calls) == 1
    cached(anchor, ("b",), make)
    assert len(calls) == 2  # another key, its own constant
    anchor.add_(1)
    assert cached(anchor, ("a",), make) is not first and len(calls) == 3


def test_an_inference_tensor_remakes_its_constant_every_call():
    with torch.inference_mode():
        anchor = torch.ones(3)
    calls = []
    make = counting_maker(calls)
    cached(anchor, ("a",), make)
    cached(anchor, ("a",), make)
    assert len(calls) == 2


def test_a_constant_kept_under_inference_mode_is_an_ordinary_tensor():
    """So that constants made from it are kept too (the layer kernel's repacked x_proj and dt_proj
    come from its x_proj products: remade at every step, they added two kernels a layer)."""
    anchor = torch.ones(3)
    with torch.inference_mode():
        kept = cached(anchor, ("a",), lambda: anchor * 2)
        assert not kept.is_inference()
        derived = cached(kept, ("b",), lambda: kept + 1)
        assert cached(kept, ("b",), lambda: kept + 1) is derived


def capturing(monkeypatch, active: bool):
    """Make ``cached`` see a CUDA-graph capture under way (or none)."""
    monkeypatch.setattr(constants, "keeps_constants", lambda device: not active)


def test_a_capture_reads_the_constant_kept_before_it(monkeypatch):
    """A graph captured after a warm-up reads the kept constant: none of its making kernels are
    captured to replay on every step."""
    anchor, calls = torch.ones(3), []
    make = counting_maker(calls)
    kept = cached(anchor, ("a",), make)
    capturing(monkeypatch, True)
    assert cached(anchor, ("a",), make) is kept and len(calls) == 1


def test_a_constant_made_during_a_capture_is_not_kept(monkeypatch):
    anchor, calls = torch.ones(3), []
    make = counting_maker(calls)
    capturing(monkeypatch, True)
    cached(anchor, ("a",), make)
    capturing(monkeypatch, False)
    cached(anchor, ("a",), make)
    assert len(calls) == 2


def test_a_constant_a_graph_read_outlives_its_replacement(monkeypatch):
    """After the anchor changes, the cache makes a new constant; the one a captured graph reads
    stays alive (its memory is not handed to another tensor), those no graph read do not."""
    anchor, calls = torch.ones(3), []
    make = counting_maker(calls)
    read_by_graph = cached(anchor, ("a",), make)
    never_captured = cached(anchor, ("b",), make)
    capturing(monkeypatch, True)
    cached(anchor, ("a",), make)
    capturing(monkeypatch, False)
    anchor.add_(1)
    assert cached(anchor, ("a",), make) is not read_by_graph
    cached(anchor, ("b",), make)
    held = [id(value) for value in constants._READ_BY_GRAPHS]
    assert id(read_by_graph) in held and id(never_captured) not in held


def test_a_workspace_is_zero_and_kept_per_tensor_and_kernel(monkeypatch):
    for name, words in (("a_words", 4), ("b_words", 6)):  # two kernels' ops that size theirs
        monkeypatch.setattr(torch.ops.quamba, name, lambda words=words: words, raising=False)
    with torch.inference_mode():
        state = torch.ones(3)  # the decode cache's states may be inference tensors
    scratch = workspace(state, "a_words")
    assert scratch.dtype == torch.int32 and torch.equal(scratch, torch.zeros(4, dtype=torch.int32))
    assert workspace(state, "a_words") is scratch
    assert workspace(state, "b_words").shape == (6,)
    assert workspace(torch.ones(3), "a_words") is not scratch


def test_a_workspace_made_during_a_capture_is_not_kept(monkeypatch):
    monkeypatch.setattr(torch.ops.quamba, "a_words", lambda: 4, raising=False)
    state = torch.ones(3)
    capturing(monkeypatch, True)
    made_in_capture = workspace(state, "a_words")
    capturing(monkeypatch, False)
    kept = workspace(state, "a_words")
    assert kept is not made_in_capture and workspace(state, "a_words") is kept
