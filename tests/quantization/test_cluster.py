"""Quamba2's sort-and-cluster of the SSM input's channel ranges (quamba.quantization.cluster)."""
import itertools
import math

import pytest
import torch

from quamba.quantization.cluster import cluster_ranges, sort_and_cluster


def lost_bits(ranges, clustered):
    return sum(math.log(c / r) for r, c in zip(ranges.tolist(), clustered.tolist()))


def brute_force_best(ranges, clusters):
    """The least lost resolution over every split of the sorted ranges into at most ``clusters``
    runs, tried exhaustively."""
    values = sorted(ranges.tolist())
    n, best = len(values), math.inf
    for k in range(clusters):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = (0,) + cuts + (n,)
            cost = sum(math.log(values[stop - 1] / v) for start, stop in zip(bounds, bounds[1:])
                       for v in values[start:stop])
            best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n,clusters", [(1, 4), (3, 4), (9, 3), (10, 4)])
def test_cluster_ranges_is_the_best_partition(seed, n, clusters):
    ranges = torch.rand(n, generator=torch.Generator().manual_seed(seed)).exp() ** 4
    clustered = cluster_ranges(ranges, clusters)
    assert torch.all(clustered >= ranges)
    assert len(torch.unique(clustered)) <= clusters
    assert set(clustered.tolist()) <= set(ranges.tolist())  # each cluster's range is a member's
    assert lost_bits(ranges, clustered) == pytest.approx(brute_force_best(ranges, clusters), abs=1e-9)


def test_sort_and_cluster_gives_few_scales_per_group():
    nheads, headdim, ngroups = 12, 10, 2
    ranges = torch.rand(nheads, headdim, generator=torch.Generator().manual_seed(0)).exp() ** 3
    clustered = sort_and_cluster(ranges, nheads, ngroups, head_clusters=3, channel_clusters=2)
    assert clustered.shape == (nheads, headdim)
    assert torch.all(clustered >= ranges)
    for group in clustered.view(ngroups, -1):
        assert len(torch.unique(group)) <= 6
    # each head group shares one channel pattern: heads of equal range rows share their scales
    head_max = clustered.amax(dim=1)
    for value in torch.unique(head_max):
        rows = clustered[head_max == value]
        assert torch.all(rows == rows[0])
