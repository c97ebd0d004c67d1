"""Spindle's plan for a task file on a cluster, beside the baselines it is judged against.

Baselines (each op priced by the same curves, i.e. its best data/tensor/context-parallel strategy on the
devices it gets, no pipelining): `sequential` runs the tasks one after another, each op on all devices;
`proportional` runs all tasks at once, each on a device share proportional to its FLOPs (largest remainders,
at least one device), its ops one after another; `task-level` is Spindle's task-level allocator (optimus,
makespan mode) with the same per-task times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from plait.planner.multitask.allocator import optimus
from plait.planner.multitask.graph import Graph, build_graph
from plait.planner.multitask.scalability import Curve, Pricing, Progress, curves
from plait.planner.multitask.schedule import Schedule, wavefront
from plait.spec.cluster import Cluster
from plait.spec.tasks import TaskSet


@dataclass(frozen=True)
class TaskGroups:
    """Tasks run at once, each on its own `devices` devices, its ops one after another (seconds)."""

    devices: tuple[int, ...]
    seconds: tuple[float, ...]

    @property
    def makespan_s(self) -> float:
        return max(self.seconds)


@dataclass(frozen=True)
class MultitaskPlan:
    tasks: TaskSet
    graph: Graph
    curves: tuple[Curve, ...]
    schedule: Schedule
    sequential_s: float
    proportional: TaskGroups
    task_level: TaskGroups

    @property
    def baselines(self) -> dict[str, float]:
        return {"sequential": self.sequential_s, "proportional": self.proportional.makespan_s,
                "task-level": self.task_level.makespan_s}


def task_seconds(graph: Graph, curves: Sequence[Curve], task: str) -> Callable[[int], float]:
    """Seconds of a task's ops one after another on n devices."""
    ops = graph.task_ops(task)
    return lambda n: sum(curves[i].seconds(n, graph.ops[i].layers) for i in ops)


def proportional_counts(weights: Sequence[float], total: int) -> tuple[int, ...]:
    """Device counts proportional to `weights` (each at least one, largest remainders first)."""
    share = [total * w / sum(weights) for w in weights]
    counts = [max(1, math.floor(s)) for s in share]
    for i in sorted(range(len(share)), key=lambda i: counts[i] - share[i]):
        if sum(counts) >= total:
            break
        counts[i] += 1
    return tuple(counts)


def _groups(counts: Sequence[int], times: Sequence[Callable[[int], float]]) -> TaskGroups:
    return TaskGroups(tuple(counts), tuple(t(n) for t, n in zip(times, counts, strict=True)))


def plan_multitask(tasks: TaskSet, cluster: Cluster, precision: str = "bf16",
                   progress: Progress | None = None) -> MultitaskPlan:
    """Price the tasks' MetaOps, schedule them in waves and price the baselines."""
    graph = build_graph(tasks)
    priced = tuple(curves(graph.ops, cluster, Pricing.for_cluster(cluster, precision), progress))
    total = cluster.world_size
    schedule = wavefront([op.layers for op in graph.ops], graph.edges, priced, total, cluster.gpus_per_node)
    times = [task_seconds(graph, priced, t.name) for t in tasks.tasks]
    flops = [sum(graph.ops[i].flops for i in graph.task_ops(t.name)) for t in tasks.tasks]
    return MultitaskPlan(tasks, graph, priced, schedule, sum(t(total) for t in times),
                         _groups(proportional_counts(flops, total), times), _groups(optimus(times, total), times))
