"""Collective and point-to-point communication time on a two-level (NVLink + network) topology.

A group is described by its shape: `size` ranks spread over `nodes` nodes with at most `per_node` of them
on one node. Inside one node collectives run at NVLink bus bandwidth. Across nodes every member drives its
own NIC, so NCCL's rings run `per_node` channels through `per_node` NICs of each node: the inter-node bus
bandwidth is per_node x NIC bandwidth, capped by NVLink. Latency: a ring inside the node plus a tree
across nodes for all-reduce; one hop per rank for the ring-only all-gather and reduce-scatter. Sizes are bytes of the full (unsharded) buffer; times are seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plait.cached_hash import cached_hash
from plait.cost.calibration import Calibration
from plait.spec.cluster import Cluster


@cached_hash
@dataclass(frozen=True)
class GroupShape:
    """How a process group sits on the cluster."""

    size: int
    nodes: int
    per_node: int

    @staticmethod
    def of(ranks: Sequence[int], gpus_per_node: int) -> GroupShape:
        """Shape of the group of `ranks` on nodes of `gpus_per_node` devices."""
        return _shape(tuple(ranks), gpus_per_node)


@lru_cache(maxsize=8192)
def _shape(ranks: tuple[int, ...], gpus_per_node: int) -> GroupShape:
    counts = np.bincount(np.asarray(ranks, dtype=np.int64) // gpus_per_node)
    return GroupShape(len(ranks), int(np.count_nonzero(counts)), int(counts.max()))


@lru_cache(maxsize=8192)
def nodes_of(ranks: tuple[int, ...], gpus_per_node: int) -> frozenset[int]:
    """The nodes that `ranks` live on."""
    return frozenset((np.asarray(ranks, dtype=np.int64) // gpus_per_node).tolist())


SINGLE = GroupShape(1, 1, 1)


@lru_cache(maxsize=4096)
def bus_bandwidth(group: GroupShape, cluster: Cluster, cal: Calibration) -> float:
    """Achievable bus bandwidth (bytes/s) of a collective over `group`."""
    intra = cluster.intra.bandwidth * cal.nvlink_efficiency
    if group.nodes == 1:
        return intra
    return min(intra, group.per_node * cluster.inter.bandwidth * cal.network_efficiency)


def _latency(group: GroupShape, cluster: Cluster) -> float:
    """One pass of a ring inside the node plus a tree across nodes, seconds."""
    inter = math.ceil(math.log2(group.nodes)) * cluster.inter.latency if group.nodes > 1 else 0.0
    return (group.per_node - 1) * cluster.intra.latency + inter


def _ring_latency(group: GroupShape, cluster: Cluster) -> float:
    """Latency of a ring all-gather or reduce-scatter, seconds: NCCL runs these as rings only (no tree), so
    each of the n - 1 steps waits for its slowest hop, the network once the group spans nodes (Thakur et al.
    2005; NCCL's ring algorithm). This is what makes per-layer FSDP collectives costly on hundreds of GPUs."""
    hop = cluster.inter.latency if group.nodes > 1 else cluster.intra.latency
    return (group.size - 1) * hop


def _measured(op: str, nbytes: float, group: GroupShape, cal: Calibration) -> float | None:
    """Seconds of a collective that the calibration's profile measured for this group size, else None."""
    return cal.measured.collective(op, group.size, group.nodes, nbytes) if cal.measured is not None else None


def all_reduce(nbytes: float, group: GroupShape, cluster: Cluster, cal: Calibration) -> float:
    """Seconds to all-reduce `nbytes` over `group` (ring: 2 (n-1)/n of the data through each rank)."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    if (t := _measured("all_reduce", nbytes, group, cal)) is not None:
        return t
    return 2 * (n - 1) / n * nbytes / bus_bandwidth(group, cluster, cal) + 2 * _latency(group, cluster)


def all_gather(nbytes: float, group: GroupShape, cluster: Cluster, cal: Calibration) -> float:
    """Seconds to all-gather a buffer of `nbytes` in all ((n-1)/n of it into each rank)."""
    return _gather_or_scatter("all_gather", nbytes, group, cluster, cal)


def reduce_scatter(nbytes: float, group: GroupShape, cluster: Cluster, cal: Calibration) -> float:
    """Seconds to reduce-scatter a buffer of `nbytes` in all: the bytes of an all-gather, the other way."""
    return _gather_or_scatter("reduce_scatter", nbytes, group, cluster, cal)


def _gather_or_scatter(op: str, nbytes: float, group: GroupShape, cluster: Cluster, cal: Calibration) -> float:
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    if (t := _measured(op, nbytes, group, cal)) is not None:
        return t
    return (n - 1) / n * nbytes / bus_bandwidth(group, cluster, cal) + _ring_latency(group, cluster)


def all_to_all(nbytes: float, group: GroupShape, cluster: Cluster, cal: Calibration) -> float:
    """Seconds for an all-to-all where each rank holds `nbytes` and keeps 1/n of it."""
    return exchange((group.size - 1) / group.size * nbytes if group.size > 1 else 0.0, group, cluster, cal)


def exchange(nbytes: float, group: GroupShape, cluster: Cluster, cal: Calibration) -> float:
    """Seconds for every rank to send `nbytes` in all, spread evenly over the other ranks of its group.

    Traffic that stays in the node runs on NVLink; traffic leaving it goes through the rank's own NIC.
    """
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    if (t := _measured("all_to_all", nbytes * n / (n - 1), group, cal)) is not None:
        return t  # an all-to-all of that input sends exactly nbytes
    local = (group.per_node - 1) / (n - 1) * nbytes / (cluster.intra.bandwidth * cal.nvlink_efficiency)
    remote = 0.0
    if group.nodes > 1:
        remote = (n - group.per_node) / (n - 1) * nbytes / (cluster.inter.bandwidth * cal.network_efficiency)
    latency = cluster.inter.latency if group.nodes > 1 else cluster.intra.latency
    return max(local, remote) + latency


def p2p(nbytes: float, cross_node: bool, cluster: Cluster, cal: Calibration) -> float:
    """Seconds to send `nbytes` from one rank to another."""
    if nbytes <= 0:
        return 0.0
    if cal.measured is not None and not cross_node and (t := cal.measured.collective("p2p", 2, 1, nbytes)):
        return t
    if cross_node:
        return nbytes / (cluster.inter.bandwidth * cal.network_efficiency) + cluster.inter.latency
    return nbytes / (cluster.intra.bandwidth * cal.nvlink_efficiency) + cluster.intra.latency


def overlapped(comm_s: float, compute_s: float, contention: float) -> float:
    """Seconds a collective of `comm_s` adds to `compute_s` of compute that it runs beside: the part longer
    than the compute, plus the compute slowed by `contention` (its lost fraction of throughput) while the two
    overlap."""
    return max(0.0, comm_s - compute_s) + contention * min(comm_s, compute_s)


def gradient_sync(params: float, zero: int, group: GroupShape, grad_bytes: int, param_bytes: int,
                  cluster: Cluster, cal: Calibration) -> tuple[float, float]:
    """(seconds reducing gradients before the optimizer, seconds gathering parameters after it) of once-per-
    step data-parallel synchronisation of `params` parameters under a ZeRO stage. ZeRO-0 all-reduces,
    ZeRO-1 reduce-scatters and re-gathers, ZeRO-2 only re-gathers (it reduce-scatters every micro-batch),
    ZeRO-3 does neither (it gathers and reduces every micro-batch)."""
    if group.size <= 1:
        return 0.0, 0.0
    reduce_t = 0.0
    if zero == 0:
        reduce_t = all_reduce(params * grad_bytes, group, cluster, cal)
    elif zero == 1:
        reduce_t = reduce_scatter(params * grad_bytes, group, cluster, cal)
    gather_t = all_gather(params * param_bytes, group, cluster, cal) if zero in (1, 2) else 0.0
    return reduce_t, gather_t
