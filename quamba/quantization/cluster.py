"""Quamba2's sort-and-cluster of the SSM input x of a Mamba2 layer (arXiv 2503.22879).

x [..., nheads, headdim] varies in range between heads and, within heads, between channels, and
one scale per tensor wastes most int8 codes on the small ones. Quamba2 sorts the heads of each
SSD group by their range, clusters them into a few head groups, then sorts and clusters the
headdim channels of each head group the same way, and gives each (head group, channel group)
cell one scale. It permutes the weights so that cells are contiguous for its kernels; here every
channel reads its cell's scale from a per-channel table instead, which gives the same codes.

A cluster is a run of the sorted ranges; its range is its largest member's. The runs are chosen
by dynamic programming to minimise Σ log(cluster range / member range), the bits of resolution
the members lose, rather than split into equal counts.
"""
from __future__ import annotations

import math

import torch

HEAD_CLUSTERS = 4
CHANNEL_CLUSTERS = 4


def cluster_ranges(ranges: torch.Tensor, clusters: int) -> torch.Tensor:
    """Each value of ``ranges`` [n] (positive) replaced by its cluster's range: the max of the
    members of the best partition of the sorted values into at most ``clusters`` runs."""
    order = torch.argsort(ranges, stable=True)
    sorted_logs = [math.log(max(float(v), 1e-30)) for v in ranges[order]]
    bounds = _best_runs(sorted_logs, min(clusters, len(sorted_logs)))
    clustered = torch.empty_like(ranges)
    for start, stop in bounds:
        clustered[order[start:stop]] = ranges[order[stop - 1]]
    return clustered


def _best_runs(logs: list[float], clusters: int) -> list[tuple[int, int]]:
    """[start, stop) runs of the sorted ``logs`` minimising Σ (log of the run's last member −
    log of each member), at most ``clusters`` runs."""
    n = len(logs)
    prefix = [0.0]
    for value in logs:
        prefix.append(prefix[-1] + value)

    def cost(start, stop):  # members [start, stop) all take logs[stop - 1]
        return (stop - start) * logs[stop - 1] - (prefix[stop] - prefix[start])

    best = [[math.inf] * (n + 1) for _ in range(clusters + 1)]
    split = [[0] * (n + 1) for _ in range(clusters + 1)]
    best[0][0] = 0.0
    for k in range(1, clusters + 1):
        for stop in range(1, n + 1):
            for start in range(k - 1, stop):
                candidate = best[k - 1][start] + cost(start, stop)
                if candidate < best[k][stop]:
                    best[k][stop], split[k][stop] = candidate, start
    k = min(range(1, clusters + 1), key=lambda c: best[c][n])
    runs, stop = [], n
    while k > 0:
        start = split[k][stop]
        runs.append((start, stop))
        stop, k = start, k - 1
    return runs[::-1]


def sort_and_cluster(channel_ranges: torch.Tensor, nheads: int, ngroups: int,
                     head_clusters: int = HEAD_CLUSTERS,
                     channel_clusters: int = CHANNEL_CLUSTERS) -> torch.Tensor:
    """Clipping range per channel of x from its per-channel ranges [nheads, headdim]: at most
    ``head_clusters`` × ``channel_clusters`` distinct ranges per SSD group. Returns fp32
    [nheads, headdim]."""
    ranges = channel_ranges.float().reshape(nheads, -1)
    clustered = torch.empty_like(ranges)
    heads_per_group = nheads // ngroups
    for group in range(ngroups):
        heads = slice(group * heads_per_group, (group + 1) * heads_per_group)
        group_ranges = ranges[heads]
        head_range = cluster_ranges(group_ranges.amax(dim=1), head_clusters)
        for value in torch.unique(head_range):
            members = (head_range == value).nonzero().flatten()
            channel_range = cluster_ranges(group_ranges[members].amax(dim=0), channel_clusters)
            clustered[heads][members] = channel_range.expand(len(members), -1)
    return clustered
