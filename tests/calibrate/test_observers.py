import dataclasses
import math

import numpy as np
import pytest
import torch

from quamba.calibrate import (AbsMaxObserver, CalibrationError, ObserverSpec, PercentileObserver,
                              make_observer)


def feed(observer, tensor, splits):
    for part in torch.split(tensor.flatten(), splits):
        observer.update(part)
    return observer.result()


def test_absmax_uses_magnitudes_across_batches():
    observer = AbsMaxObserver("t")
    observer.update(torch.tensor([[1.0, -2.5], [0.5, 2.0]]))
    observer.update(torch.tensor([-7.0, 3.0], dtype=torch.float16))
    assert observer.result() == 7.0


@pytest.mark.parametrize("alpha", [0.5, 0.9, 0.99, 0.9995, 1.0])
@pytest.mark.parametrize("count", [1, 7, 1000, 4097, 30011])
def test_percentile_matches_numpy_inverted_cdf(alpha, count):
    values = torch.randn(count, generator=torch.Generator().manual_seed(count), dtype=torch.float64)
    values = values.float()
    magnitudes = values.abs().numpy()
    expected = np.quantile(magnitudes, alpha, method="inverted_cdf")
    by_rank = np.sort(magnitudes)[max(1, math.ceil(round(alpha * 10000) * count / 10000)) - 1]
    observer = PercentileObserver(alpha, "t")
    observer.update(values)
    assert observer.result() == float(expected) == float(by_rank)


def test_percentile_is_exact_above_torch_quantile_limit():
    values = torch.randn(17_000_003, generator=torch.Generator().manual_seed(0))
    assert values.numel() > 2 ** 24  # torch.quantile refuses inputs this large
    k = math.ceil(9995 * values.numel() / 10000)
    expected = torch.kthvalue(values.abs(), k).values.item()
    one_batch = PercentileObserver(0.9995, "big")
    one_batch.update(values)
    assert one_batch.result() == expected
    splits = [5_000_000, 1, 7_000_000, values.numel() - 12_000_001]
    assert feed(PercentileObserver(0.9995, "big"), values, splits) == expected


def test_percentile_does_not_depend_on_batch_split():
    values = torch.randn(50_000, generator=torch.Generator().manual_seed(1)) ** 3
    reference = feed(PercentileObserver(0.999, "t"), values, [values.numel()])
    generator = torch.Generator().manual_seed(2)
    for _ in range(5):
        cuts = sorted(torch.randint(1, values.numel(), (6,), generator=generator).tolist())
        splits = [b - a for a, b in zip([0] + cuts, cuts + [values.numel()]) if b > a]
        assert feed(PercentileObserver(0.999, "t"), values, splits) == reference
        expected_total = PercentileObserver(0.999, "t", expected_numel=values.numel())
        assert feed(expected_total, values, splits) == reference


def test_percentile_with_small_later_data():
    """A value dropped early is needed once many small values follow: exact with the expected
    total, and refused (never silently wrong) without it."""
    large = torch.arange(1, 100_001, dtype=torch.float32)
    data = torch.cat([large, torch.zeros(900_000), large[:10_000]])
    expected = float(np.quantile(data.numpy(), 0.9, method="inverted_cdf"))
    splits = [100_000, 900_000, 10_000]
    informed = PercentileObserver(0.9, "layer 0 ssm_state", expected_numel=data.numel())
    assert feed(informed, data, splits) == expected
    with pytest.raises(CalibrationError, match="layer 0 ssm_state cannot be computed exactly"):
        feed(PercentileObserver(0.9, "layer 0 ssm_state"), data, splits)


@pytest.mark.parametrize("observer_type", [AbsMaxObserver, PercentileObserver])
@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "inf"),
                                       (float("-inf"), "inf")])
def test_non_finite_values_raise_with_the_name(observer_type, bad, word):
    observer = observer_type(name="layer 3 x_proj.input")
    observer.update(torch.ones(10))
    tensor = torch.ones(4, 5, dtype=torch.bfloat16)
    tensor[2, 1] = bad
    with pytest.raises(CalibrationError, match=f"^{word} in layer 3 x_proj.input"):
        observer.update(tensor)


def test_low_precision_inputs_are_observed_exactly():
    for dtype, peak in [(torch.float16, -65504.0), (torch.bfloat16, -3.0e38)]:
        values = torch.tensor([0.1, peak, 3.0], dtype=dtype)
        exact = abs(float(values[1]))
        for observer in (AbsMaxObserver(), PercentileObserver(1.0)):
            observer.update(values)
            assert observer.result() == exact


@pytest.mark.parametrize("observer", [AbsMaxObserver("t"), PercentileObserver(0.9, "t")])
def test_no_data_raises(observer):
    observer.update(torch.empty(0))
    with pytest.raises(CalibrationError, match="observer of t saw no data"):
        observer.result()


def test_spec_and_factory():
    spec = ObserverSpec("percentile", 0.999)
    assert dataclasses.asdict(spec) == {"kind": "percentile", "alpha": 0.999}
    assert ObserverSpec(**dataclasses.asdict(spec)) == spec
    observer = make_observer(spec, "layer 0 ssm_state", expected_numel=100)
    assert isinstance(observer, PercentileObserver) and observer.name == "layer 0 ssm_state"
    assert isinstance(make_observer(ObserverSpec(), "x"), AbsMaxObserver)
    with pytest.raises(CalibrationError, match="unknown observer kind 'minmax'"):
        ObserverSpec("minmax")
    with pytest.raises(CalibrationError, match="alpha must lie in"):
        ObserverSpec("percentile", 1.5)
