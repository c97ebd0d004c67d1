"""Device mapping: which devices each op of a stage runs on, keeping ops where they already are.

The ops of a stage take consecutive devices in some order. Spindle scores an order against the previous
stage per device: +1/size of the device's previous group when its op changes (its share of that group's
data must move), -1 when its op and group are the same as before (nothing moves). A local search swaps
ops while the score drops; groups never straddle a node when they fit in one (their tensor-parallel
communication stays on the node's links, as priced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Group = tuple[int, int, int]
"""(op, first device, device count) of one group."""


@dataclass(frozen=True)
class Slot:
    """An op that needs `devices` consecutive devices in a stage."""

    op: int
    devices: int


def aligned(start: int, size: int, per_node: int) -> bool:
    """Whether a group of `size` devices from `start` stays in one node, or starts one when larger."""
    if size <= per_node:
        return start // per_node == (start + size - 1) // per_node
    return start % per_node == 0


def layout(order: Sequence[Slot]) -> list[Group]:
    """Consecutive groups of the slots in `order` from device 0."""
    groups, start = [], 0
    for s in order:
        groups.append((s.op, start, s.devices))
        start += s.devices
    return groups


def per_device(groups: Sequence[Group], total: int) -> list[Group | None]:
    """The group of every device (None: idle)."""
    out: list[Group | None] = [None] * total
    for g in groups:
        for d in range(g[1], g[1] + g[2]):
            out[d] = g
    return out


def move_score(previous: Sequence[Group], current: Sequence[Group], total: int) -> float:
    """Spindle's cost of going from the previous stage's groups to the current ones (lower is better)."""
    score = 0.0
    for before, after in zip(per_device(previous, total), per_device(current, total), strict=True):
        if before is None:
            continue
        if after is None or before[0] != after[0]:
            score += 1 / before[2]
        elif before == after:
            score -= 1
    return score


def _valid(order: Sequence[Slot], per_node: int) -> bool:
    return all(aligned(start, size, per_node) for _, start, size in layout(order))


def map_devices(slots: Sequence[Slot], previous: Sequence[Group], total: int, per_node: int) -> list[Group]:
    """Groups for `slots`: largest first (aligned to nodes), then pairwise swaps that lower the score."""
    order = sorted(slots, key=lambda s: -s.devices)
    best = move_score(previous, layout(order), total)
    improved = True
    while improved:
        improved = False
        for i in range(len(order)):
            for j in range(i + 1, len(order)):
                trial = list(order)
                trial[i], trial[j] = trial[j], trial[i]
                score = move_score(previous, layout(trial), total)
                if score < best and _valid(trial, per_node):
                    order, best, improved = trial, score, True
    return layout(order)
