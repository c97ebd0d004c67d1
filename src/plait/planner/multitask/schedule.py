"""The greedy wavefront scheduler (Spindle's `schedule_gen`).

A wave is the set of ops whose predecessors have all finished. The continuous allocator gives the wave's
optimum makespan C* and fractional device counts; each op becomes one or two allotments (valid counts,
layers). Stages are then packed greedily: allotments sorted by more devices first, then longer, join the
stage while devices remain (one allotment per op). The stage lasts about as long as its shortest allotment
(rounded to whole layers); every op runs the whole layers that fit, the rest stay for a later stage.
Leftover devices extend the stage's ops (largest remaining work first) to their next valid count. A stage
with the same ops on the same counts as the one before is merged into it. Times are seconds of forward and
backward per step; the runtime runs the waves forward in order and backward in reverse on the same groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from plait.planner.multitask.allocator import Work, allocate, split
from plait.planner.multitask.placement import Group, Slot, map_devices
from plait.planner.multitask.scalability import Curve

ROUNDING = 1e-9
"""Relative slack when counting the whole layers that fit in a stage (floating-point noise)."""


@dataclass(frozen=True)
class Placement:
    """`layers` layers of op `op` on devices first..first+devices-1, `seconds` long."""

    op: int
    first: int
    devices: int
    layers: int
    seconds: float

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.first + self.devices))


@dataclass(frozen=True)
class Stage:
    start_s: float
    placements: tuple[Placement, ...]

    @property
    def seconds(self) -> float:
        return max(p.seconds for p in self.placements)


@dataclass(frozen=True)
class Wave:
    """Ops scheduled together; `bound_s` is their continuous optimum C*."""

    ops: tuple[int, ...]
    bound_s: float
    stages: tuple[Stage, ...]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)


@dataclass(frozen=True)
class Schedule:
    waves: tuple[Wave, ...]

    @property
    def makespan_s(self) -> float:
        return sum(w.seconds for w in self.waves)

    @property
    def bound_s(self) -> float:
        """Sum of the waves' continuous optima."""
        return sum(w.bound_s for w in self.waves)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(s for w in self.waves for s in w.stages)

    @property
    def relocations(self) -> int:
        """Ops that go on from one stage to the next on other devices (their state moves)."""
        moved = 0
        for a, b in zip(self.stages, self.stages[1:]):
            before = {p.op: p.ranks for p in a.placements}
            moved += sum(1 for p in b.placements if p.op in before and before[p.op] != p.ranks)
        return moved


@dataclass
class _Pending:
    """An allotment still to run: op, valid device count, layers left."""

    op: int
    devices: int
    layers: int


@dataclass
class _Run:
    """An allotment in the stage being built: its count now and the layers it runs."""

    pending: _Pending
    devices: int
    layers: int = 0


def _pack(pending: Sequence[_Pending], curves: Sequence[Curve], total: int,
          rule: Callable[[int, float], tuple[float, float]]) -> list[_Run]:
    """Allotments for one stage in the order of `rule` (devices, seconds), one per op while devices remain."""
    order = sorted(pending, key=lambda p: rule(p.devices, curves[p.op].seconds(p.devices, p.layers)))
    runs: list[_Run] = []
    free = total
    for p in order:
        if p.devices <= free and all(r.pending.op != p.op for r in runs):
            runs.append(_Run(p, p.devices))
            free -= p.devices
    return runs


def _fitting(curve: Curve, devices: int, seconds: float, most: int) -> int:
    """Whole layers (at most `most`) that run in `seconds` on `devices`."""
    return min(most, math.floor(seconds / curve.seconds(devices, 1) * (1 + ROUNDING)))


def _stage_seconds(runs: Sequence[_Run], curves: Sequence[Curve]) -> float:
    """Length of the stage: its shortest allotment rounded to whole layers on every op (at least one)."""
    shortest = min(curves[r.pending.op].seconds(r.devices, r.pending.layers) for r in runs)
    longest = 0.0
    for r in runs:
        curve = curves[r.pending.op]
        layers = max(1, min(r.pending.layers, round(shortest / curve.seconds(r.devices, 1))))
        longest = max(longest, curve.seconds(r.devices, layers))
    return longest


def _extend(runs: Sequence[_Run], curves: Sequence[Curve], free: int, seconds: float,
            remaining: dict[int, int]) -> None:
    """Give leftover devices to the stage's ops: first to unfinished ops with the most work left (they run
    more layers), then to the longest finishing ops (they finish sooner)."""
    while free > 0:
        def grow(run: _Run) -> int:
            nxt = curves[run.pending.op].next_count(run.devices)
            return nxt - run.devices if nxt is not None and nxt - run.devices <= free else 0

        unfinished = sorted((r for r in runs if r.layers < remaining[r.pending.op] and grow(r)),
                            key=lambda r: -curves[r.pending.op].seconds(r.devices, remaining[r.pending.op]))
        finishing = sorted((r for r in runs if r.layers == remaining[r.pending.op] and grow(r)),
                           key=lambda r: -curves[r.pending.op].seconds(r.devices, r.layers))
        if not unfinished and not finishing:
            return
        run = (unfinished or finishing)[0]
        step = grow(run)
        free -= step
        run.devices += step
        if unfinished:
            run.layers = _fitting(curves[run.pending.op], run.devices, seconds, remaining[run.pending.op])


def _merge(previous: Stage, placements: Sequence[Placement]) -> Stage | None:
    """The previous stage continued by `placements` when they are the same ops on the same devices."""
    if sorted((p.op, p.ranks) for p in previous.placements) != sorted((p.op, p.ranks) for p in placements):
        return None
    more = {p.op: p for p in placements}
    return Stage(previous.start_s, tuple(
        Placement(p.op, p.first, p.devices, p.layers + more[p.op].layers, p.seconds + more[p.op].seconds)
        for p in previous.placements))


SORT_RULES: dict[str, Callable[[int, float], tuple[float, float]]] = {
    "more devices, longer": lambda devices, seconds: (-devices, -seconds),
    "more devices, shorter": lambda devices, seconds: (-devices, seconds),
    "fewer devices, shorter": lambda devices, seconds: (devices, seconds),
    "shorter, more devices": lambda devices, seconds: (seconds, -devices),
}
"""Orders in which allotments join a stage (Spindle's sort rules); each wave keeps the shortest result."""


def _consume(pending: Sequence[_Pending], run: _Run) -> None:
    """Take the layers `run` ran from its allotment, the rest from the op's other allotments."""
    left = run.layers
    for p in sorted((p for p in pending if p.op == run.pending.op), key=lambda p: p is not run.pending):
        used = min(left, p.layers)
        p.layers -= used
        left -= used


def _stages(pending: list[_Pending], layers: dict[int, int], curves: Sequence[Curve], total: int, per_node: int,
            start_s: float, previous: Stage | None, rule: Callable[[int, float], tuple[float, float]],
            reallocate: bool) -> list[Stage]:
    """Stages that run the allotments in `pending` to completion; an op in a stage runs as many of its
    layers as fit in the stage, taking them from its other allotment when its own is done. With
    `reallocate`, the work left after each stage is allocated afresh."""
    remaining = dict(layers)
    stages: list[Stage] = []
    clock = start_s
    while pending:
        if stages and reallocate:  # re-allocate the work left, as a wave of its own
            pending = _allotments({o: n for o, n in remaining.items() if n}, curves, total)[1]
        runs = _pack(pending, curves, total, rule)
        seconds = _stage_seconds(runs, curves)
        for r in runs:
            r.layers = _fitting(curves[r.pending.op], r.devices, seconds, remaining[r.pending.op])
        _extend(runs, curves, total - sum(r.devices for r in runs), seconds, remaining)
        for r in runs:
            _consume(pending, r)
            remaining[r.pending.op] -= r.layers
        pending = [p for p in pending if p.layers > 0]
        groups = map_devices([Slot(r.pending.op, r.devices) for r in runs], _groups(previous), total, per_node)
        by_op = {r.pending.op: r for r in runs}
        placements = [Placement(op, first, size, by_op[op].layers, curves[op].seconds(size, by_op[op].layers))
                      for op, first, size in groups]
        merged = _merge(stages[-1], placements) if stages else None
        if merged:
            stages[-1] = merged
        else:
            stages.append(Stage(clock, tuple(placements)))
        previous = stages[-1]
        clock = previous.start_s + previous.seconds
    return stages


def schedule_wave(ops: Sequence[int], layers: dict[int, int], curves: Sequence[Curve], total: int,
                  per_node: int, start_s: float, previous: Stage | None) -> Wave:
    """Stages that run `ops` (each with `layers[op]` layers) to completion on `total` devices."""
    bound_s, _ = _allotments(layers, curves, total)
    options = [_stages(_allotments(layers, curves, total)[1], layers, curves, total, per_node, start_s, previous,
                       rule, again) for rule in SORT_RULES.values() for again in (False, True)]
    best = min(options, key=lambda stages: sum(s.seconds for s in stages))
    return Wave(tuple(ops), bound_s, tuple(best))


def _allotments(layers: dict[int, int], curves: Sequence[Curve], total: int) -> tuple[float, list[_Pending]]:
    """The continuous optimum of running `layers[op]` layers of every op at once, and its allotments."""
    ops = list(layers)
    alloc = allocate([Work(curves[o], layers[o]) for o in ops], total)
    return alloc.makespan_s, [_Pending(o, a.devices, a.layers) for o, n in zip(ops, alloc.devices, strict=True)
                              for a in split(curves[o], layers[o], n, alloc.makespan_s)]


def _groups(stage: Stage | None) -> list[Group]:
    return [(p.op, p.first, p.devices) for p in stage.placements] if stage else []


def wavefront(layers: Sequence[int], edges: Sequence[tuple[int, int]], curves: Sequence[Curve], total: int,
              per_node: int) -> Schedule:
    """Waves of ready ops until every op has run (Spindle's planner with the in-degree candidate rule)."""
    done: set[int] = set()
    waves: list[Wave] = []
    clock = 0.0
    previous: Stage | None = None
    while len(done) < len(layers):
        ready = [i for i in range(len(layers)) if i not in done and all(a in done for a, b in edges if b == i)]
        wave = schedule_wave(ready, {i: layers[i] for i in ready}, curves, total, per_node, clock, previous)
        waves.append(wave)
        done.update(ready)
        clock += wave.seconds
        previous = wave.stages[-1]
    return Schedule(tuple(waves))
