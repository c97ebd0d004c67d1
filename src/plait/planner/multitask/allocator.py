"""Allocating devices to ops: the continuous optimum, its discretisation, and the task-level allocator.

The continuous allocator treats each op as malleable: it runs in C seconds on n_i(C) devices, a fractional
count. The makespan C* of running all ops at once on N devices solves sum_i n_i(C) = N, found by bisection
(n_i is non-increasing in C). Discretisation (Spindle) turns each fractional n into two allotments on the
adjacent valid counts n1 <= n <= n2 that run one after the other for t1 + t2 = C seconds, with the layers
split between them in proportion to the time each allotment gets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from plait.planner.multitask.scalability import Curve

RELATIVE_TOLERANCE = 1e-13
"""Bisection stops when the makespan interval is this small relative to the makespan."""
MAX_BISECTIONS = 400


class Malleable(Protocol):
    """Work that runs on a fractional number of devices."""

    @property
    def fastest_s(self) -> float: ...

    def devices(self, seconds: float) -> float:
        """Fractional devices to finish in `seconds` (inf if it cannot)."""
        ...


@dataclass(frozen=True)
class Work:
    """`layers` layers of an op with scalability `curve`."""

    curve: Curve
    layers: float

    @property
    def fastest_s(self) -> float:
        return self.layers * self.curve.layer_s[-1]

    def devices(self, seconds: float) -> float:
        return self.curve.devices(self.layers, seconds)


@dataclass(frozen=True)
class Amdahl:
    """Work of `work_s` seconds on one device with a serial fraction: t(n) = w (a + (1 - a) / n), n <= max."""

    work_s: float
    serial: float
    max_devices: float

    def seconds(self, devices: float) -> float:
        return self.work_s * (self.serial + (1 - self.serial) / devices)

    @property
    def fastest_s(self) -> float:
        return self.seconds(self.max_devices)

    def devices(self, seconds: float) -> float:
        spare = seconds - self.work_s * self.serial
        return self.work_s * (1 - self.serial) / spare if spare > 0 else math.inf


@dataclass(frozen=True)
class Allocation:
    """The continuous optimum: makespan (seconds) and each op's fractional device count."""

    makespan_s: float
    devices: tuple[float, ...]


def allocate(work: Sequence[Malleable], total: int) -> Allocation:
    """The least C with sum_i n_i(C) <= `total` (bisection); every op at its fastest if devices are left."""
    def demand(c: float) -> float:
        return sum(w.devices(c) for w in work)

    low = max(w.fastest_s for w in work)
    if demand(low) <= total:
        return Allocation(low, tuple(w.devices(low) for w in work))
    high = 2 * low
    while demand(high) > total:
        low, high = high, 2 * high
    for _ in range(MAX_BISECTIONS):
        if high - low <= RELATIVE_TOLERANCE * high:
            break
        mid = (low + high) / 2
        low, high = (mid, high) if demand(mid) > total else (low, mid)
    return Allocation(high, tuple(w.devices(high) for w in work))


@dataclass(frozen=True)
class Allotment:
    """`layers` layers of an op on `devices` devices (a valid count)."""

    devices: int
    layers: int


def split(curve: Curve, layers: int, devices: float, makespan_s: float) -> tuple[Allotment, ...]:
    """Two allotments on the valid counts around `devices` whose times add up to the makespan, layers
    rounded (an allotment on 0 devices, below the first valid count, is dropped: the op runs faster)."""
    n1, n2 = curve.bracket(devices)
    if n1 == n2:
        return (Allotment(n2, layers),)
    t1 = (n2 - devices) / (n2 - n1) * makespan_s
    l1 = min(layers, round(t1 / curve.seconds(n1, 1))) if n1 else 0
    return tuple(a for a in (Allotment(n1, l1), Allotment(n2, layers - l1)) if a.layers)


def optimus(seconds: Sequence[Callable[[int], float]], total: int) -> tuple[int, ...]:
    """Task-level allocation (Spindle's "optimus", makespan mode): every task starts on one device, then the
    slowest task gets one more while that makes it faster or brings it to a count that does."""
    counts = [1] * len(seconds)
    spare = total - len(seconds)
    while spare > 0:
        slowest = max(range(len(counts)), key=lambda i: seconds[i](counts[i]))
        now = seconds[slowest](counts[slowest])
        step = next((k for k in range(1, spare + 1) if seconds[slowest](counts[slowest] + k) < now), 0)
        if not step:
            break
        counts[slowest] += step
        spare -= step
    return tuple(counts)
