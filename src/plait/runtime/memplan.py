"""MEMO's memory plan for one layer: static offsets for its tensors from their lifetimes, by an integer
programme, beside the peak a caching allocator reaches on the same allocation log.

`trace(fn)` runs `fn` under a dispatch mode and logs every storage an operator creates (bytes, the operator
index that made it and the one after which it was freed). `plan_offsets` places them in one arena: offsets
o_i >= 0 and a peak P >= o_i + s_i, and for every two tensors alive at once a binary that puts one below
the other (big-M disjunction); it minimises P with HiGHS (scipy.optimize.milp). `max_live` is the lower bound
(the most bytes alive at one moment) and `caching_peak` a first-fit allocator with block rounding, splitting
and coalescing (PyTorch's caching allocator without its size pools). Units: bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

BLOCK_BYTES = 512
"""Rounding of every allocation (PyTorch's CUDA caching allocator rounds requests up to 512 bytes)."""
MILP_TIME_LIMIT_S = 30.0
"""Seconds HiGHS may spend on one layer's plan (the best placement found by then is returned)."""


@dataclass(frozen=True)
class Alloc:
    """One tensor storage: bytes, and alive from operator `start` to operator `end` (exclusive)."""

    size: int
    start: int
    end: int


class _Tracer(TorchDispatchMode):
    """Logs the storages operators create and when they die (checked after every operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # ptr -> (ref, bytes, start)
        self.done: list[Alloc] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.step += 1
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.live and storage.nbytes():
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes(), self.step)
        self.collect()
        return out

    def collect(self, final: bool = False) -> None:
        """Move the storages that died (or, `final`, all) to the log."""
        for ptr, (ref, size, start) in list(self.live.items()):
            if final or ref.expired():
                self.done.append(Alloc(size, start, self.step + 1))
                del self.live[ptr]


def trace(fn: Callable[[], object]) -> list[Alloc]:
    """The allocation log of running `fn` (storages still alive at its end last until then)."""
    tracer = _Tracer()
    with tracer:
        fn()
    tracer.collect(final=True)
    return sorted(tracer.done, key=lambda a: (a.start, a.end))


def max_live(allocs: list[Alloc]) -> int:
    """The most bytes alive at one operator: no placement needs less."""
    events = sorted([(a.start, a.size) for a in allocs] + [(a.end, -a.size) for a in allocs])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _overlap(a: Alloc, b: Alloc) -> bool:
    return a.start < b.end and b.start < a.end


def greedy_offsets(allocs: list[Alloc]) -> tuple[list[int], int]:
    """(offsets, peak) placing the largest allocations first, each at the lowest offset free over its
    lifetime (the MILP's starting bound)."""
    offsets = [0] * len(allocs)
    placed: list[int] = []
    for i in sorted(range(len(allocs)), key=lambda k: (-allocs[k].size, allocs[k].start)):
        busy = sorted((offsets[j], offsets[j] + allocs[j].size) for j in placed if _overlap(allocs[i], allocs[j]))
        off = 0
        for lo, hi in busy:
            if off + allocs[i].size <= lo:
                break
            off = max(off, hi)
        offsets[i] = off
        placed.append(i)
    return offsets, max((o + a.size for o, a in zip(offsets, allocs, strict=True)), default=0)


def plan_offsets(allocs: list[Alloc], time_limit_s: float = MILP_TIME_LIMIT_S) -> tuple[list[int], int]:
    """(offset of each allocation, peak bytes) minimising the arena's peak (see the module docstring): the
    MILP bounded by `max_live` below and the greedy placement above (whose peak is also its big M), or the
    greedy placement when HiGHS finds nothing better in `time_limit_s`."""
    greedy, bound = greedy_offsets(allocs)
    floor = max_live(allocs)
    n = len(allocs)
    if bound <= floor or n < 2:
        return greedy, bound
    sizes = np.array([a.size for a in allocs], dtype=float)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n) if _overlap(allocs[i], allocs[j])]
    big = float(bound)
    nv = n + 1 + len(pairs)  # offsets, peak, one binary per overlapping pair
    rows, lo, hi = [], [], []

    def row(coef: dict[int, float], low: float, high: float) -> None:
        r = np.zeros(nv)
        for k, v in coef.items():
            r[k] = v
        rows.append(r)
        lo.append(low)
        hi.append(high)

    for i in range(n):  # o_i + s_i <= P
        row({i: 1.0, n: -1.0}, -np.inf, -sizes[i])
    for k, (i, j) in enumerate(pairs):  # z = 1: i below j; z = 0: j below i
        z = n + 1 + k
        row({i: 1.0, j: -1.0, z: big}, -np.inf, big - sizes[i])
        row({j: 1.0, i: -1.0, z: -big}, -np.inf, -sizes[j])
    cost = np.zeros(nv)
    cost[n] = 1.0
    integrality = np.r_[np.zeros(n + 1), np.ones(len(pairs))]
    lower = np.r_[np.zeros(n), floor, np.zeros(len(pairs))]
    upper = np.r_[big - sizes, big, np.ones(len(pairs))]
    result = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
                  bounds=Bounds(lower, upper), options={"time_limit": time_limit_s})
    if result.x is None:
        return greedy, bound
    offsets = [int(round(v)) for v in result.x[:n]]
    peak = max(o + a.size for o, a in zip(offsets, allocs, strict=True))
    return (offsets, peak) if peak < bound and check_plan(allocs, offsets) else (greedy, bound)


def check_plan(allocs: list[Alloc], offsets: list[int]) -> bool:
    """Whether no two allocations alive at once share a byte."""
    return all(offsets[i] + allocs[i].size <= offsets[j] or offsets[j] + allocs[j].size <= offsets[i]
               for i in range(len(allocs)) for j in range(i + 1, len(allocs)) if _overlap(allocs[i], allocs[j]))


def caching_peak(allocs: list[Alloc], block: int = BLOCK_BYTES) -> int:
    """The arena a first-fit allocator with `block`-byte rounding, block splitting and coalescing of freed
    neighbours grows to on the log (no memory is returned: the caching allocator's reserved bytes)."""
    free: list[tuple[int, int]] = []  # (offset, bytes), sorted by offset
    top = 0
    where: dict[int, tuple[int, int]] = {}
    events = sorted([(a.end, 0, i) for i, a in enumerate(allocs)] + [(a.start, 1, i) for i, a in enumerate(allocs)])
    for _, kind, i in events:
        if kind == 0:  # free, merging with neighbours
            free.append(where.pop(i))
            free.sort()
            merged: list[tuple[int, int]] = []
            for off, size in free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            free = merged
            continue
        need = -(-allocs[i].size // block) * block
        slot = next((k for k, (_, size) in enumerate(free) if size >= need), None)
        if slot is None:
            where[i] = (top, need)
            top += need
        else:
            off, size = free.pop(slot)
            where[i] = (off, need)
            if size > need:
                free.insert(slot, (off + need, size - need))
    return top
