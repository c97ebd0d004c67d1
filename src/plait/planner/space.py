"""The search space: every per-layer strategy a stage of n devices can use.

A strategy splits the stage's n devices into dp x tp x cp (Megatron rank order) and picks sequence
parallelism, a ZeRO stage and a recompute mode. Only what the plan validator accepts is generated:
tp divides the heads and kv heads and stays inside a node, Ulysses cp divides the heads per tp rank, the
micro-batch splits evenly over dp, sequence parallelism needs tp > 1, ZeRO needs more than one replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan import Strategy, strategy_problem
from plait.spec.cluster import Cluster
from plait.spec.layers import Block
from plait.spec.model import ModelSpec

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class SpaceLimits:
    """Which dimensions the search may use (all by default)."""

    max_tp: int | None = None  # None: the devices of one node
    max_cp: int | None = None  # None: as many as the stage has
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    sequence_parallel: tuple[bool, ...] = (False, True)
    context_parallel: bool = True


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def block_strategies(block: Block, cluster: Cluster, devices: int, micro_batch: int, seq_len: int,
                     limits: SpaceLimits = SpaceLimits()) -> list[Strategy]:
    """All valid strategies for `block` on a stage of `devices` devices whose micro-batches hold
    `micro_batch` sequences (layers without attention have no selective recompute)."""
    max_tp = min(limits.max_tp or cluster.gpus_per_node, devices)
    modes = [rc for rc in limits.recompute if block.has_attention or rc != "selective"]
    out: list[Strategy] = []
    for tp in divisors(devices):
        if tp > max_tp:
            continue
        for cp in divisors(devices // tp):
            if cp > 1 and (not limits.context_parallel or (limits.max_cp and cp > limits.max_cp)):
                continue
            dp = devices // (tp * cp)
            for sp in limits.sequence_parallel:
                if sp and tp == 1:
                    continue
                if strategy_problem(Strategy(dp=dp, tp=tp, cp=cp, sp=sp), block, devices, micro_batch, seq_len):
                    continue
                zeros = limits.zero_stages if dp * cp > 1 else (0,)
                for zero in zeros:
                    for rc in modes:
                        out.append(Strategy(dp=dp, tp=tp, cp=cp, sp=sp, zero=zero, recompute=rc))  # type: ignore[arg-type]
    return out


def stage_strategies(model: ModelSpec, cluster: Cluster, devices: int, micro_batch: int, seq_len: int,
                     limits: SpaceLimits = SpaceLimits()) -> list[Strategy]:
    """The strategies valid for every layer of `model` (what one strategy for the whole model may use)."""
    blocks = model.distinct_blocks
    first = block_strategies(blocks[0], cluster, devices, micro_batch, seq_len, limits)
    rest = [set(block_strategies(b, cluster, devices, micro_batch, seq_len, limits)) for b in blocks[1:]]
    return [s for s in first if all(s in r for r in rest)]


def pareto_front(costs: list[tuple[float, float]]) -> list[int]:
    """Indices of the (time, memory) pairs not dominated by another (ties keep the first)."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i][0], costs[i][1], i))
    keep: list[int] = []
    best_memory = float("inf")
    for i in order:
        if costs[i][1] < best_memory:
            keep.append(i)
            best_memory = costs[i][1]
    return sorted(keep)
