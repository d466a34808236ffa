"""quamba.ops.constants: a launcher's constant is made once per version of its tensor and key,
and never kept for an inference tensor."""
import torch

from quamba.ops.constants import cached


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
