"""Measured costs from a profile, which the cost model looks up before its analytic formulas.

`calibrate(profile)` turns a profile into the device type it measured (a `GPU` whose peaks are the measured
GEMM rate and copy bandwidth, links fitted from the measured collectives) and a `Calibration` that carries
the lookups: a block's or edge's measured time curve for the model and tensor-parallel width, a collective's
measured latency and bandwidth for the group size, a block, edge or optimizer step as the runtime ran it
under a parallel strategy, and how much a rank slows down beside busy neighbours. Whatever the profile
lacks falls back to the analytic model. A profile applies to its own device type only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import numpy as np

from plait.cost.calibration import Calibration, calibration_for
from plait.cost.profile_file import (
    CollectiveCurve,
    Curve,
    EdgeProfile,
    LayerProfile,
    PROFILE_ELEMENT_BYTES,
    OptimizerCurve,
    Profile,
    StrategyProfile,
)
from plait.errors import PlaitError
from plait.spec.cluster import GPU, Cluster, Link


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per loaded profile
class Measured:
    """Lookups into one profile. `share` stretches measured compute when more ranks than CPU cores run on a
    node (each rank then gets cores / ranks of a core)."""

    gpu_type: str
    process_bytes: float
    compute_slowdown: float
    comm_slowdown: float
    share: float = 1.0
    element_bytes: int = 4  # bytes of an element of the dtype the layers were measured in (activation bytes)
    cores: int = 1
    ranks_per_node: int = 1
    blocks: dict[tuple[str, int, str, str, int], LayerProfile] = field(default_factory=dict)
    edges: dict[tuple[str, str, int], EdgeProfile] = field(default_factory=dict)
    collectives: dict[tuple[str, int, int], CollectiveCurve] = field(default_factory=dict)
    strategies: dict[tuple[str, str, int], list[StrategyProfile]] = field(default_factory=dict)
    optimizer: OptimizerCurve | None = None

    def block(self, model: str, tp: int, recompute: str = "none", shape: str = "", ep: int = 1
              ) -> LayerProfile | None:
        """The measured layer of `model` (its trunk decoder layer, or the layer of fingerprint `shape`) at
        this tensor (and expert) parallel shard and recompute mode."""
        return self.blocks.get((model, tp, recompute, shape, ep))

    def edge(self, model: str, part: str, tp: int) -> EdgeProfile | None:
        return self.edges.get((model, part, tp))

    def seconds(self, curve: Curve, tokens: float, seq_len: float, model: str | None = None) -> float:
        """A measured compute curve (one rank alone) at this micro-batch, slowed by the ranks computing beside
        it on the node (`contention`)."""
        return self.contention(model, tokens, seq_len) * curve.at(tokens, seq_len)

    def contention(self, model: str | None, tokens: float, seq_len: float) -> float:
        """How much slower a rank computes `model`'s block when every rank of the node computes at once than
        alone: the profile's plain-block timing with that many busy ranks over its one-rank curve, or the
        node's core sharing (ranks / cores) where the profile has no such timing."""
        found = self.strategy_profile(model, "none", 1) if model and self.ranks_per_node > 1 else None
        alone = self.block(model, 1) if model else None
        if found is None or alone is None:
            return self.share
        sp, stretch = found
        single, busy = _step(alone, tokens, seq_len), _step(sp, tokens, seq_len)
        return stretch * busy / single if single > 0 and busy > 0 else self.share

    def contention_at(self, model: str | None, tokens: float, seq_len: float, busy: float) -> float:
        """How much slower a rank computes `model`'s block when on average `busy` ranks of the node (itself
        included) compute at once: linear between 1 (alone), the profile's plain-block timings with fewer
        busy ranks than the node has, and the node's full contention (`contention`) with all of them."""
        full = self.contention(model, tokens, seq_len)
        if busy >= self.ranks_per_node:
            return full
        points = [(1.0, 1.0)]
        alone = self.block(model, 1) if model else None
        single = _step(alone, tokens, seq_len) if alone else 0.0
        if single > 0:
            points += sorted((float(sp.ranks), _step(sp, tokens, seq_len) / single)
                             for sp in self.strategies.get((model, "none", 1), []) if sp.ranks < self.ranks_per_node)
        points.append((float(self.ranks_per_node), full))
        return float(np.interp(busy, [x for x, _ in points], [y for _, y in points]))

    def strategy_profile(self, model: str, kind: str, group: int) -> tuple[StrategyProfile, float] | None:
        """The timing of `model` under a parallel strategy kind over `group` ranks taken with the number of
        busy ranks nearest this node's, and the stretch to apply to it (the ratio of core sharing, CPU)."""
        found = self.strategies.get((model, kind, group))
        if not found:
            return None
        best = min(found, key=lambda sp: (abs(sp.ranks - self.ranks_per_node), -sp.ranks))
        stretch = self.share / max(1.0, best.ranks / self.cores) if self.cores > 1 or self.share > 1 else 1.0
        return best, stretch

    def strategy(self, model: str, kind: str, group: int, tokens: float, seq_len: float, part: str = "block"
                 ) -> tuple[float, float] | None:
        """(forward, backward) wall seconds of one block (or `part` "embedding" / "head") under a parallel
        strategy kind over `group` ranks, as the runtime ran it, or None if not measured."""
        found = self.strategy_profile(model, kind, group)
        if found is None:
            return None
        sp, stretch = found
        timed = sp if part == "block" else getattr(sp, part)
        if timed is None:
            return None
        return stretch * timed.forward.at(tokens, seq_len), stretch * timed.backward.at(tokens, seq_len)

    def optimizer_curve(self, model: str, kind: str | None = None, group: int = 1
                        ) -> tuple[OptimizerCurve, float] | None:
        """The optimizer step's curve for `model`'s parameters laid out by a strategy kind (its own timing if
        the profile has one, else the plain one) and the stretch to apply to it, or None."""
        found = self.strategy_profile(model, kind, group) if kind else None
        if found is not None and found[0].optimizer is not None:
            return found[0].optimizer, found[1]
        return (self.optimizer, self.share) if self.optimizer is not None else None

    def collective(self, op: str, ranks: int, nodes: int, nbytes: float) -> float | None:
        """Seconds of a measured collective, or None if this group size was not measured."""
        curve = self.collectives.get((op, ranks, nodes))
        return curve.at(nbytes) if curve is not None else None


def _step(timed: LayerProfile | StrategyProfile, tokens: float, seq_len: float) -> float:
    """Forward plus backward seconds of a timed block at this micro-batch."""
    return timed.forward.at(tokens, seq_len) + timed.backward.at(tokens, seq_len)


def measured_of(profile: Profile, ranks_per_node: int = 1) -> Measured:
    d = profile.device
    strategies: dict[tuple[str, str, int], list[StrategyProfile]] = {}
    for sp in profile.strategies:
        strategies.setdefault((sp.model, sp.kind, sp.group), []).append(sp)
    return Measured(
        gpu_type=d.gpu_type, process_bytes=profile.process_bytes,
        share=max(1.0, ranks_per_node / d.cores) if d.kind == "cpu" else 1.0,
        element_bytes=PROFILE_ELEMENT_BYTES[profile.dtype], cores=d.cores if d.kind == "cpu" else 1,
        ranks_per_node=ranks_per_node,
        strategies=strategies, optimizer=profile.optimizer,
        compute_slowdown=profile.overlap.compute_slowdown, comm_slowdown=profile.overlap.comm_slowdown,
        blocks={(lp.model, lp.tp, lp.recompute, lp.shape, lp.ep): lp for lp in profile.layers},
        edges={(e.model, e.part, e.tp): e for e in profile.edges},
        collectives={(c.op, c.ranks, c.nodes): c for c in profile.collectives})


def device_of(profile: Profile, ranks_per_node: int = 1) -> GPU:
    """The profiled device as a device type: measured GEMM rate (for every precision) and copy bandwidth,
    shared when more CPU ranks than cores run on a node."""
    d = profile.device
    share = max(1.0, ranks_per_node / d.cores) if d.kind == "cpu" else 1.0
    return GPU(d.gpu_type, d.peak_flops / share, d.peak_flops / share, d.memory_bytes, d.memory_bandwidth / share, 1)


def link_of(profile: Profile) -> Link | None:
    """The intra-node link as the smallest measured all-reduce sees it: bus bandwidth and latency."""
    pairs = [c for c in profile.collectives if c.op == "all_reduce" and c.nodes == 1]
    if not pairs:
        return None
    c = min(pairs, key=lambda c: c.ranks)
    bus = c.bandwidth * 2 * (c.ranks - 1) / c.ranks  # an all-reduce moves 2(n-1)/n of the bytes per rank
    return Link(bus, c.latency_s)


def profiled_cluster(profile: Profile, ref: str) -> Cluster | None:
    """`NODESxGPUSxTYPE` whose TYPE is the profile's device type, as a cluster of that device (None for other
    references). Only one node is measured: several nodes need a profile of the network between them."""
    m = re.match(r"^(\d+)x(\d+)x(.+)$", ref)
    if not m or m.group(3) != profile.device.gpu_type:
        return None
    nodes, per_node = int(m.group(1)), int(m.group(2))
    link = link_of(profile)
    if link is None or nodes > 1:
        raise PlaitError(f"the profile measured no links for {ref!r} (it covers one node of "
                         f"{profile.device.gpu_type!r} and its collectives); use 1x{per_node}x{m.group(3)}")
    return Cluster(ref, nodes, per_node, device_of(profile, per_node), link, link)


def calibrate(profile: Profile, cluster: Cluster, base: Calibration | None = None) -> tuple[Cluster, Calibration]:
    """`cluster` with the profiled device type and links, and a calibration that prefers measured costs.
    Refuses a cluster of another device type."""
    if cluster.gpu.name != profile.device.gpu_type:
        raise PlaitError(f"the profile measured device type {profile.device.gpu_type!r} but the cluster has "
                         f"{cluster.gpu.name!r}; profile that device, or give a cluster of "
                         f"{profile.device.gpu_type!r}")
    link = link_of(profile)
    cluster = replace(cluster, gpu=device_of(profile, cluster.gpus_per_node), intra=link or cluster.intra)
    cal = base or calibration_for(cluster.gpu.name)
    return cluster, replace(cal, measured=measured_of(profile, cluster.gpus_per_node),
                            nvlink_efficiency=1.0 if link else cal.nvlink_efficiency)


def local_cost(profile_path: str | None, world: int) -> tuple[Cluster, Calibration]:
    """The cluster (and calibration) that prices plans for `world` ranks on this machine at run time: the
    profile's device when one is given, else a stand-in of that many ranks with datasheet numbers."""
    from plait.spec.cluster import local_ranks

    if profile_path:
        from plait.cost.profile_file import load_profile

        profile = load_profile(profile_path)
        return calibrate(profile, profiled_cluster(profile, f"1x{world}x{profile.device.gpu_type}"))
    cluster = local_ranks(world)
    return cluster, calibration_for(cluster.gpu.name)
