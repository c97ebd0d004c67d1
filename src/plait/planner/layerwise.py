"""Per-layer strategy choice inside one pipeline stage (Galvatron's dynamic programme).

A stage holds ``L`` layers in order; layer ``l`` picks one of ``S`` parallel strategies.
Picking strategy ``s`` for layer ``l`` costs ``time[l, s]`` seconds and ``memory[l, s]``
memory units (non-negative integers: the caller discretises bytes into units).
Consecutive layers with *different* strategies ``a -> b`` also pay ``transition[a, b]``
seconds; staying on the same strategy is free (the diagonal of ``transition`` is ignored).
A pair is forbidden when ``allowed[l, s]`` is False or ``time[l, s]`` is ``inf``; an
``inf`` transition forbids that switch.

The optimum minimises the total time (layer times plus transitions) subject to the total
memory being at most ``budget`` units: a multiple-choice knapsack with transition costs.

The DP keeps ``best[s, u]``: the least time of a prefix whose last layer uses strategy
``s`` and whose memory is at most ``u`` units (non-increasing in ``u`` by construction).
One layer is ``cand[b, u] = min_a best[a, u] + transition[a, b]`` followed by a right shift
of row ``b`` by ``memory[l, b]`` and adding ``time[l, b]``. Cost: ``O(L * S**2 * budget)``
array work and ``L * S * (budget + 1)`` float64 of stored tables for backtracking.

:func:`solve_layers_pareto` solves the same problem with real-valued memory (bytes), so nothing
is lost to rounding: per last strategy it keeps the list of prefixes whose (memory, time) no other
prefix beats on both, dropping those that cannot fit beside the least memory of the layers left.
When switching is free the order of layers does not matter: identical layers are then counted
rather than ordered, and lists for 1, 2, 4, ... of them are summed pairwise (``O(log L)`` merges
instead of ``L`` steps). With switching costs, the free-switching optimum laid out in blocks is a
feasible answer whose time bounds the lists (a prefix that cannot finish faster is dropped).
An optional ``slack`` merges partial assignments whose memory differs by less than
``slack * budget / L``, which caps each list at ``L / slack + 1`` entries and costs at most that
fraction of the budget (the answer is at least as fast as the exact optimum under
``(1 - slack) * budget``): every assignment is built by ``L - 1`` sums, each merging by less than
that width.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from plait.errors import PlaitError

__all__ = [
    "LayerSolution",
    "prune_dominated",
    "solve_layers",
    "solve_layers_all_budgets",
    "solve_layers_brute_force",
    "solve_layers_pareto",
]

_BRUTE_FORCE_LIMIT = 2_000_000
_CUBE_LIMIT = 1 << 18  # elements of the (a, b, u) cube below which it is built whole


@dataclass(frozen=True)
class LayerSolution:
    """An assignment of strategies to a stage's layers.

    ``time`` is in seconds (layer times plus transitions), ``memory`` in the caller's units (an
    int for the unit DPs, a float for :func:`solve_layers_pareto`), ``choice[l]`` is the strategy
    index of layer ``l``.
    """

    time: float
    memory: float
    choice: tuple[int, ...]


# --------------------------------------------------------------------------- validation


def _as_memory(memory: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    mem = np.asarray(memory)
    if mem.shape != shape:
        raise PlaitError(f"memory has shape {mem.shape}; expected {shape} (same as time)")
    if mem.dtype.kind not in "iu" and (
        mem.dtype.kind != "f" or not np.all(np.isfinite(mem)) or np.any(mem != np.round(mem))
    ):
        raise PlaitError("memory must hold whole numbers of units (discretise before calling)")
    mem = mem.astype(np.int64)
    if np.any(mem < 0):
        raise PlaitError("memory must be non-negative (units)")
    return mem


def _as_transition(transition: np.ndarray, s: int) -> np.ndarray:
    trans = np.array(transition, dtype=np.float64)  # a copy: the diagonal is overwritten
    if trans.shape != (s, s):
        raise PlaitError(f"transition has shape {trans.shape}; expected ({s}, {s})")
    if np.any(np.isnan(trans)) or np.any(trans < 0):
        raise PlaitError("transition costs must be >= 0 seconds (inf forbids a switch)")
    np.fill_diagonal(trans, 0.0)
    return trans


def _as_time(time: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """Validated ``(L, S)`` seconds as a float64 copy; pairs not ``allowed`` get ``inf``."""
    t = np.array(time, dtype=np.float64)
    if t.ndim != 2:
        raise PlaitError(f"time must be 2-D (layers, strategies); got shape {t.shape}")
    if np.any(np.isnan(t)) or np.any(t < 0):
        raise PlaitError("time must be >= 0 seconds (inf marks a forbidden pair)")
    if allowed is not None:
        ok = np.asarray(allowed)
        if ok.shape != t.shape or ok.dtype != np.bool_:
            raise PlaitError(f"allowed must be a boolean array of shape {t.shape}")
        t[~ok] = np.inf
    return t


def _prepare(
    time: np.ndarray,
    memory: np.ndarray,
    transition: np.ndarray,
    budget: int,
    allowed: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Validated ``(time, memory, transition, budget)``; forbidden pairs get ``inf`` time."""
    t = _as_time(time, allowed)
    mem = _as_memory(memory, t.shape)
    trans = _as_transition(transition, t.shape[1])
    try:
        budget = operator.index(budget)
    except TypeError:
        raise PlaitError(f"budget must be an integer number of units; got {budget!r}") from None
    if budget < 0:
        raise PlaitError(f"budget must be >= 0 units; got {budget}")
    t[mem > budget] = np.inf  # can never fit
    return t, mem, trans, budget


def _prepare_real(
    time: np.ndarray,
    memory: np.ndarray,
    transition: np.ndarray,
    budget: float,
    allowed: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """:func:`_prepare` for real-valued memory and budget (any unit, e.g. bytes)."""
    t = _as_time(time, allowed)
    mem = np.array(memory, dtype=np.float64)
    if mem.shape != t.shape:
        raise PlaitError(f"memory has shape {mem.shape}; expected {t.shape} (same as time)")
    if not np.all(np.isfinite(mem)) or np.any(mem < 0):
        raise PlaitError("memory must be finite and >= 0")
    trans = _as_transition(transition, t.shape[1])
    budget = float(budget)
    if not math.isfinite(budget) or budget < 0:
        raise PlaitError(f"budget must be finite and >= 0; got {budget}")
    t[mem > budget] = np.inf  # can never fit
    return t, mem, trans, budget


# --------------------------------------------------------------------------- the DP


def _relax(best: np.ndarray, trans: np.ndarray, targets: np.ndarray, zero_trans: bool) -> np.ndarray:
    """``cand[i, u] = min_a best[a, u] + trans[a, targets[i]]`` for every budget ``u``."""
    width = best.shape[1]
    if zero_trans:
        return np.broadcast_to(best.min(axis=0), (len(targets), width))
    live = np.flatnonzero(np.isfinite(best[:, -1]))  # rows are non-increasing: last column
    cand = np.full((len(targets), width), np.inf)
    if len(live) == 0:
        return cand
    lo = int(np.isinf(best[live]).sum(axis=1).min())  # columns before lo are inf everywhere
    rows = best[live, lo:]
    sub = trans[np.ix_(live, targets)]
    if sub.size * rows.shape[1] <= _CUBE_LIMIT:  # small: one (a, b, u) cube, reduce over a
        out = (rows[:, None, :] + sub[:, :, None]).min(axis=0)
    else:  # large: accumulate over a to stay in cache
        out = np.full((len(targets), width - lo), np.inf)
        tmp = np.empty_like(out)
        for row, prev in zip(sub, rows):
            np.add(prev[None, :], row[:, None], out=tmp)
            np.minimum(out, tmp, out=out)
    cand[:, lo:] = out
    return cand


def _forward(
    t: np.ndarray, mem: np.ndarray, trans: np.ndarray, budget: int, keep: bool
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Run the DP; return the last ``best`` table ``(S, budget + 1)`` and, if ``keep``,
    every layer's table (for backtracking)."""
    n_layers, n_strat = t.shape
    width = budget + 1
    zero_trans = not np.any(trans)
    tables: list[np.ndarray] = []
    best = np.empty((n_strat, width))
    for layer in range(n_layers):
        targets = np.flatnonzero(np.isfinite(t[layer]))
        if layer == 0:
            cand = np.zeros((len(targets), width))
        else:
            cand = _relax(best, trans, targets, zero_trans)
        new = np.full((n_strat, width), np.inf)
        for i, b in enumerate(targets):
            m = int(mem[layer, b])
            np.add(cand[i, : width - m], t[layer, b], out=new[b, m:])
        best = new
        if keep:
            tables.append(best)
    return best, tables


def _evaluate(t: np.ndarray, mem: np.ndarray, trans: np.ndarray, choice: tuple[int, ...]) -> LayerSolution:
    """Time (seconds) and memory (the caller's units; int or float as ``mem``) of ``choice``,
    summed in the DP's order: layer by layer, each switch before the layer it leads to."""
    if not choice:
        return LayerSolution(time=0.0, memory=0, choice=choice)
    picked = np.asarray(choice, dtype=np.intp)
    layers = np.arange(len(picked))
    steps = np.empty(2 * len(picked) - 1)
    steps[0::2] = t[layers, picked]
    steps[1::2] = trans[picked[:-1], picked[1:]]
    return LayerSolution(time=np.cumsum(steps)[-1].item(), memory=np.cumsum(mem[layers, picked])[-1].item(),
                         choice=choice)


def solve_layers(
    time: np.ndarray,
    memory: np.ndarray,
    transition: np.ndarray,
    budget: int,
    allowed: np.ndarray | None = None,
) -> LayerSolution | None:
    """Exact least-time assignment with total memory <= ``budget`` units (None if nothing fits).

    ``time``: ``(L, S)`` seconds (``inf`` = forbidden); ``memory``: ``(L, S)`` non-negative
    integer units; ``transition``: ``(S, S)`` seconds from previous strategy (row) to next
    (column), diagonal ignored; ``allowed``: optional ``(L, S)`` boolean mask.
    """
    t, mem, trans, budget = _prepare(time, memory, transition, budget, allowed)
    n_layers = t.shape[0]
    if n_layers == 0:
        return LayerSolution(time=0.0, memory=0, choice=())
    if t.shape[1] == 0:
        return None
    best, tables = _forward(t, mem, trans, budget, keep=True)
    if not np.isfinite(best[:, budget].min()):
        return None
    s = int(np.argmin(best[:, budget]))
    u = budget
    choice = [s]
    for layer in range(n_layers - 1, 0, -1):
        u -= int(mem[layer, s])
        s = int(np.argmin(tables[layer - 1][:, u] + trans[:, s]))
        choice.append(s)
    return _evaluate(t, mem, trans, tuple(reversed(choice)))


def solve_layers_all_budgets(
    time: np.ndarray,
    memory: np.ndarray,
    transition: np.ndarray,
    budget: int,
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """Least time (seconds) for every budget ``0..budget`` units: shape ``(budget + 1,)``.

    Entry ``u`` is the optimum of :func:`solve_layers` with budget ``u`` (``inf`` where nothing
    fits); the array is non-increasing, so the smallest feasible memory is the first finite index.
    """
    t, mem, trans, budget = _prepare(time, memory, transition, budget, allowed)
    if t.shape[0] == 0:
        return np.zeros(budget + 1)
    if t.shape[1] == 0:
        return np.full(budget + 1, np.inf)
    best, _ = _forward(t, mem, trans, budget, keep=False)
    return best.min(axis=0)


def solve_layers_brute_force(
    time: np.ndarray,
    memory: np.ndarray,
    transition: np.ndarray,
    budget: int,
    allowed: np.ndarray | None = None,
) -> LayerSolution | None:
    """Reference optimum by enumerating all ``S**L`` assignments (tests only; same arguments
    and units as :func:`solve_layers`). Ties go to the lexicographically first assignment."""
    t, mem, trans, budget = _prepare(time, memory, transition, budget, allowed)
    n_layers, n_strat = t.shape
    if n_strat**n_layers > _BRUTE_FORCE_LIMIT:
        raise PlaitError(f"brute force over {n_strat}**{n_layers} assignments is too large")
    if n_layers == 0:
        return LayerSolution(time=0.0, memory=0, choice=())
    if n_strat == 0:
        return None
    choices = np.array(list(itertools.product(range(n_strat), repeat=n_layers)), dtype=np.intp)
    layers = np.arange(n_layers)
    totals = t[layers, choices].sum(axis=1) + trans[choices[:, :-1], choices[:, 1:]].sum(axis=1)
    used = mem[layers, choices].sum(axis=1)
    totals[used > budget] = np.inf
    k = int(np.argmin(totals))
    if not np.isfinite(totals[k]):
        return None
    return _evaluate(t, mem, trans, tuple(int(s) for s in choices[k]))


# --------------------------------------------------------------------------- Pareto lists

_PAIR_LIMIT = 1 << 14
"""Candidates one merge of two lists of partial assignments may form; beyond it the free-switching
solver adds layers one at a time (each step then forms list size x strategies candidates)."""

_Expand = Callable[[int], tuple[int, ...]]
"""Entry index of a final list -> the strategy of every layer."""

_Arrange = Callable[[np.ndarray], np.ndarray]
"""The strategies picked for a group of identical layers -> their order along those layers."""


def _survivors(time: np.ndarray, memory: np.ndarray, limit: float, merge: float, slowest: float = np.inf
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, cols)`` of the candidates kept, each row sorted by memory: those faster than every
    candidate of their row with less memory, with memory at most ``limit`` and time at most
    ``slowest``, and the last such of their row in their ``merge``-wide memory bucket (the fastest
    there; ``merge == 0``: of their exact memory)."""
    earlier = np.empty_like(time)
    earlier[:, :1] = np.inf
    np.minimum.accumulate(time[:, :-1], axis=1, out=earlier[:, 1:])
    rows, cols = np.nonzero((time < earlier) & (memory <= limit) & (time <= slowest))
    bucket = np.floor(memory[rows, cols] / merge) if merge > 0 else memory[rows, cols]
    last = np.ones(len(rows), dtype=bool)
    last[:-1] = (rows[1:] != rows[:-1]) | (bucket[1:] != bucket[:-1])
    return rows[last], cols[last]


def _least_memory(t: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """Each layer's least memory over its usable strategies: ``(L,)``."""
    return np.where(np.isfinite(t), mem, np.inf).min(axis=1)


def _after(values: np.ndarray) -> np.ndarray:
    """``out[l]``: the sum of ``values`` over the layers after layer ``l``."""
    return np.concatenate([np.cumsum(values[:0:-1])[::-1], [0.0]])


# With switching costs: one list per last strategy, extended one layer at a time.


@dataclass(frozen=True)
class _Front:
    """Prefixes kept after one layer, flat: grouped by last strategy, memory ascending in a group.

    ``memory`` and ``time`` are the prefix totals (caller's memory unit, seconds), ``strategy`` the
    last layer's strategy and ``back`` the index of the prefix it extends in the previous front.
    """

    memory: np.ndarray
    time: np.ndarray
    strategy: np.ndarray
    back: np.ndarray


def _first_front(t: np.ndarray, mem: np.ndarray, limit: float, slowest: float) -> _Front:
    """One prefix per usable strategy of the first layer (costs of shape ``(S,)``) within ``limit``
    and ``slowest``."""
    targets = np.flatnonzero(np.isfinite(t) & (mem <= limit) & (t <= slowest))
    return _Front(mem[targets], t[targets], targets, np.full(len(targets), -1, dtype=np.intp))


def _switch_classes(trans: np.ndarray) -> np.ndarray | None:
    """Class of each strategy: strategies whose switches to every strategy cost the same (so switching
    between them is free, and a prefix ending in either has the same futures), e.g. strategies of one
    activation layout. None when every class holds one strategy."""
    rows = trans.copy()
    np.fill_diagonal(rows, 0.0)
    _, classes = np.unique(rows, axis=0, return_inverse=True)
    classes = classes.reshape(-1)
    return classes if len(np.unique(classes)) < len(classes) else None


def _extend(front: _Front, t: np.ndarray, mem: np.ndarray, trans: np.ndarray, limit: float,
            slowest: float, merge: float, classes: np.ndarray | None = None) -> _Front:
    """The front after one more layer (costs of shape ``(S,)``): row ``i`` of the candidates holds
    every kept prefix (memory ascending) extended by target strategy ``targets[i]``. Targets of one
    switch class (`_switch_classes`) compete in one list: their prefixes have the same futures."""
    order = np.argsort(front.memory, kind="stable")
    targets = np.flatnonzero(np.isfinite(t))
    time = front.time[order] + trans[:, targets][front.strategy[order]].T + t[targets][:, None]
    memory = front.memory[order] + mem[targets][:, None]
    if classes is not None and len(targets) and len(np.unique(classes[targets])) < len(targets):
        rows, cols = _class_survivors(time, memory, classes[targets], limit, merge, slowest)
    else:
        rows, cols = _survivors(time, memory, limit, merge, slowest)
    return _Front(memory[rows, cols], time[rows, cols], targets[rows], order[cols])


def _class_survivors(time: np.ndarray, memory: np.ndarray, cls: np.ndarray, limit: float, merge: float,
                     slowest: float) -> tuple[np.ndarray, np.ndarray]:
    """`_survivors` over the candidates of each class of rows together: ``(rows, cols)`` into
    ``time``/``memory`` ``(R, F)`` of the kept ones, by class, memory ascending in a class. Each row's own
    survivors are found first (a candidate its own row drops, its class drops too), so only those are
    sorted into their class's list."""
    rows, cols = _survivors(time, memory, limit, merge, slowest)
    if len(rows) == 0:
        return rows, cols
    group = np.unique(cls[rows], return_inverse=True)[1].reshape(-1)
    kept_memory = memory[rows, cols]
    order = np.lexsort((kept_memory, group))  # by class, then memory; ties in row order
    counts = np.bincount(group)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    by_class = group[order]
    slot = np.arange(len(order)) - starts[by_class]
    flat_memory = np.full((len(counts), counts.max()), np.inf)  # [class, slot], memory ascending
    flat_time = np.full_like(flat_memory, np.inf)
    flat_memory[by_class, slot] = kept_memory[order]
    flat_time[by_class, slot] = time[rows, cols][order]
    g, k = _survivors(flat_time, flat_memory, limit, merge, slowest)
    pick = order[starts[g] + k]
    return rows[pick], cols[pick]


def _chain(t: np.ndarray, mem: np.ndarray, trans: np.ndarray, budget: float, merge: float, upper: float
           ) -> tuple[np.ndarray, np.ndarray, _Expand] | None:
    """Final ``(memory, time)`` list and its expansion, layer by layer (None if nothing fits). A
    prefix is dropped when the least memory of the layers after it no longer fits, or when it
    cannot finish within ``upper`` seconds even with each later layer's fastest strategy."""
    room, slowest = budget - _after(_least_memory(t, mem)), upper - _after(t.min(axis=1))
    classes = _switch_classes(trans)
    fronts = [_first_front(t[0], mem[0], room[0], slowest[0])]
    for layer in range(1, t.shape[0]):
        if len(fronts[-1].time) == 0:
            return None
        fronts.append(_extend(fronts[-1], t[layer], mem[layer], trans, room[layer], slowest[layer], merge, classes))

    def expand(k: int) -> tuple[int, ...]:
        choice = []
        for front in reversed(fronts):
            choice.append(int(front.strategy[k]))
            k = int(front.back[k])
        return tuple(reversed(choice))

    return fronts[-1].memory, fronts[-1].time, expand


# Free switching: the order of layers does not matter, so identical layers are counted, not ordered.


@dataclass(frozen=True)
class _Sums:
    """Pareto list of the assignments of a set of layers: memory ascending, time descending.

    A leaf is one layer of ``group`` with its usable ``strategy`` per entry; otherwise entry ``k``
    is entry ``left[k]`` of ``parts[0]`` plus entry ``right[k]`` of ``parts[1]``.
    """

    memory: np.ndarray
    time: np.ndarray
    group: int = -1
    strategy: np.ndarray | None = None
    parts: tuple[_Sums, _Sums] | None = None
    left: np.ndarray | None = None
    right: np.ndarray | None = None


def _leaf(t: np.ndarray, mem: np.ndarray, group: int, limit: float) -> _Sums:
    """One layer's usable strategies (costs of shape ``(S,)``) within ``limit``, Pareto-pruned."""
    usable = np.flatnonzero(np.isfinite(t))
    usable = usable[np.argsort(mem[usable], kind="stable")]
    _, cols = _survivors(t[usable][None, :], mem[usable][None, :], limit, 0.0)
    return _Sums(mem[usable[cols]], t[usable[cols]], group=group, strategy=usable[cols])


def _combine(a: _Sums, b: _Sums, limit: float, merge: float) -> _Sums:
    """Every entry of ``a`` plus every entry of ``b``, Pareto-pruned and merged into buckets."""
    memory = (a.memory[:, None] + b.memory[None, :]).reshape(-1)
    time = (a.time[:, None] + b.time[None, :]).reshape(-1)
    order = np.argsort(memory)  # not stable: entries of equal memory keep the fastest whatever their order
    _, cols = _survivors(time[order][None, :], memory[order][None, :], limit, merge)
    picked = order[cols]
    left, right = np.divmod(picked, len(b.memory))
    return _Sums(memory[picked], time[picked], parts=(a, b), left=left, right=right)


def _halved(strategies: np.ndarray) -> np.ndarray:
    """``strategies`` with each one's copies split evenly between the two halves of the sequence (the
    first holds ``len // 2``), in blocks: ascending in the first half, descending in the second. Each
    half, such as one of an interleaved pipeline stage's two chunks, gets a fair share of every
    strategy, and at most ``2k - 1`` neighbours differ for ``k`` distinct strategies."""
    values, counts = np.unique(strategies, return_counts=True)
    odd = np.flatnonzero(counts % 2)
    early = counts // 2
    early[odd[: len(odd) // 2]] += 1  # the odd copies go alternately to each half
    late = counts - early
    return np.concatenate([np.repeat(values, early), np.repeat(values[::-1], late[::-1])])


def _mergeable(a: _Sums | None, b: _Sums) -> bool:
    """Whether summing ``a`` and ``b`` forms few enough candidates (always true without ``a``)."""
    return a is None or len(a.time) * len(b.time) <= _PAIR_LIMIT


def _powers(leaf: _Sums, count: int, least: float, room: float, merge: float) -> list[_Sums]:
    """Lists covering 1, 2, 4, ... of a group's ``count`` identical layers (each the previous one
    summed with itself, while that stays :func:`_mergeable`); ``least``: a layer's least memory,
    ``room``: the memory a list may use beyond the least of its layers."""
    powers = [leaf]
    while 2 ** len(powers) <= count and _mergeable(powers[-1], powers[-1]):
        powers.append(_combine(powers[-1], powers[-1], room + 2 ** len(powers) * least, merge))
    return powers


def _expand_sums(root: _Sums, k: int, members: list[np.ndarray], n_layers: int, arrange: _Arrange
                 ) -> tuple[int, ...]:
    """Strategy of every layer in entry ``k`` of ``root`` (``members[g]``: the layers of group
    ``g``, which get their group's strategies in the order ``arrange`` gives)."""
    picks: list[list[np.ndarray]] = [[] for _ in members]
    wanted: dict[int, list[np.ndarray]] = {id(root): [np.array([k], dtype=np.intp)]}
    for node in _parents_first(root):  # a list is reused, so gather all its entries before its parts
        entries = np.concatenate(wanted.pop(id(node)))
        if node.parts is None:
            picks[node.group].append(node.strategy[entries])  # type: ignore[index]
            continue
        for part, index in zip(node.parts, (node.left, node.right)):
            wanted.setdefault(id(part), []).append(index[entries])  # type: ignore[index]
    choice = np.empty(n_layers, dtype=np.intp)
    for layers, strategies in zip(members, picks):
        choice[layers] = arrange(np.concatenate(strategies))
    return tuple(choice.tolist())


def _parents_first(root: _Sums) -> list[_Sums]:
    """Every list ``root`` is built from (each once), every one before the lists it is built from."""
    order: list[_Sums] = []
    done: set[int] = set()
    stack: list[tuple[_Sums, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif id(node) not in done:
            done.add(id(node))
            stack.append((node, True))
            stack.extend((part, False) for part in node.parts or ())
    return order[::-1]


def _groups(t: np.ndarray, mem: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Identical layers (same times and memory): each group's first layer, each layer's group and
    each group's size."""
    rows = np.concatenate([t, mem], axis=1)
    if np.all(rows == rows[0]):
        return np.zeros(1, dtype=np.intp), np.zeros(len(rows), dtype=np.intp), np.array([len(rows)])
    _, first, group_of, counts = np.unique(rows, axis=0, return_index=True, return_inverse=True,
                                           return_counts=True)
    return first, group_of.reshape(-1), counts


def _counted(t: np.ndarray, mem: np.ndarray, budget: float, merge: float, arrange: _Arrange = _halved
             ) -> tuple[np.ndarray, np.ndarray, _Expand] | None:
    """Final ``(memory, time)`` list and its expansion when switching is free (None if nothing fits);
    ``arrange`` orders the strategies of each group's layers.

    Identical layers form a group; ``k`` layers of a group are covered by the lists of
    :func:`_powers` for the binary digits of ``k``, so ``O(log k)`` merges replace ``k`` steps.
    A partial list drops what cannot fit next to the least memory of the layers it leaves out.
    """
    first, group_of, counts = _groups(t, mem)
    least = _least_memory(t, mem)
    room = budget - float(least.sum())
    total: _Sums | None = None
    covered = 0.0  # least memory of the layers in total
    for group, (row, count) in enumerate(zip(first, counts)):
        one = float(least[row])
        powers = _powers(_leaf(t[row], mem[row], group, room + one), int(count), one, room, merge)
        left = int(count)
        for i in reversed(range(len(powers))):
            while left >= 2**i and (i == 0 or _mergeable(total, powers[i])):
                covered += 2**i * one
                total = powers[i] if total is None else _combine(total, powers[i], room + covered, merge)
                left -= 2**i
    if total is None or len(total.time) == 0:
        return None
    members = [np.flatnonzero(group_of == g) for g in range(len(first))]
    root = total
    return root.memory, root.time, lambda k: _expand_sums(root, k, members, t.shape[0], arrange)


def _unconstrained(t: np.ndarray, mem: np.ndarray, trans: np.ndarray) -> tuple[int, ...] | None:
    """Each layer's fastest strategy (least memory among ties) when no switch between neighbours
    costs anything: then no assignment is faster, whatever the budget. None otherwise."""
    fastest = t.min(axis=1, keepdims=True)
    choice = np.where(t == fastest, mem, np.inf).argmin(axis=1)
    if np.any(trans[choice[:-1], choice[1:]]):
        return None
    return tuple(choice.tolist())


def solve_layers_pareto(
    time: np.ndarray,
    memory: np.ndarray,
    transition: np.ndarray,
    budget: float,
    allowed: np.ndarray | None = None,
    slack: float = 0.0,
) -> LayerSolution | None:
    """Least-time assignment with total memory <= ``budget``, memory real-valued (None if nothing fits).

    Arguments as :func:`solve_layers`, except that ``memory`` ``(L, S)`` and ``budget`` are finite,
    non-negative reals in one unit (e.g. bytes) and are never rounded: the answer's memory, summed
    layer by layer, is at most ``budget``. ``slack`` in ``[0, 1)``: 0 gives the exact optimum;
    above 0, partial assignments within ``slack * budget / L`` of each other in memory are merged
    (the faster kept), which caps every list at ``L / slack + 1`` entries and returns a solution at
    least as fast as the exact optimum under ``(1 - slack) * budget``. Ties go to less memory.
    """
    t, mem, trans, budget = _prepare_real(time, memory, transition, budget, allowed)
    if not 0.0 <= slack < 1.0:
        raise PlaitError(f"slack must be in [0, 1); got {slack}")
    n_layers = t.shape[0]
    if n_layers == 0:
        return LayerSolution(time=0.0, memory=0.0, choice=())
    if t.shape[1] == 0 or _least_memory(t, mem).sum() > budget:  # nothing fits
        return None
    quick = _unconstrained(t, mem, trans)
    if quick is not None:
        sol = _evaluate(t, mem, trans, quick)
        if sol.memory <= budget:
            return sol
    merge = slack * budget / n_layers
    if not np.any(trans):
        return _fastest_fitting(t, mem, trans, budget, _counted(t, mem, budget, merge))
    # A feasible bound first: the free-switching optimum with each group's layers in blocks.
    bound = _fastest_fitting(t, mem, trans, budget, _counted(t, mem, budget, merge, np.sort))
    upper = bound.time if bound is not None else np.inf
    sol = _fastest_fitting(t, mem, trans, budget, _chain(t, mem, trans, budget, merge, upper))
    best = sol if sol is not None and sol.time < upper else bound
    return best if best is not None and math.isfinite(best.time) else None


def _fastest_fitting(t: np.ndarray, mem: np.ndarray, trans: np.ndarray, budget: float,
                     found: tuple[np.ndarray, np.ndarray, _Expand] | None) -> LayerSolution | None:
    """The fastest entry (then least memory) of a final list whose memory, summed layer by layer,
    fits ``budget``: the first, unless rounding differs."""
    if found is None:
        return None
    final_memory, final_time, expand = found
    for k in np.lexsort((final_memory, final_time)):
        sol = _evaluate(t, mem, trans, expand(int(k)))
        if sol.memory <= budget:
            return sol
    return None


# --------------------------------------------------------------------------- pruning


def prune_dominated(
    time: np.ndarray, memory: np.ndarray, transition: np.ndarray | None = None
) -> np.ndarray:
    """Sorted indices of the strategies worth keeping when every layer has the same costs.

    ``time``: ``(S,)`` seconds per layer; ``memory``: ``(S,)`` units per layer;
    ``transition``: ``(S, S)`` seconds (diagonal ignored), or None when switching is free.
    Strategies with ``inf`` time are dropped. Strategy ``b`` is dropped when some ``a``
    dominates it: ``time[a] <= time[b]`` and ``memory[a] <= memory[b]`` with one strict (or
    both equal and ``a < b``), and for every ``x`` not in ``{a, b}``:
    ``transition[x, a] <= transition[x, b]`` and ``transition[a, x] <= transition[b, x]``.

    Proof that the optimum is unchanged: replacing every ``b`` in an assignment by ``a`` keeps
    each layer's time and memory no larger, turns switches ``x<->b`` into no dearer ``x<->a``,
    and ``a<->b`` or ``b->b`` into free ``a->a``, so it is feasible and no slower.
    Dominance strictly improves ``(time, memory)`` or keeps it and lowers the index, so it has
    no cycles; repeating the replacement therefore ends on kept strategies only.
    """
    t = np.array(time, dtype=np.float64)
    if t.ndim != 1:
        raise PlaitError(f"time must be 1-D (strategies); got shape {t.shape}")
    if np.any(np.isnan(t)) or np.any(t < 0):
        raise PlaitError("time must be >= 0 seconds (inf marks a forbidden strategy)")
    n = t.shape[0]
    mem = _as_memory(memory, t.shape)
    usable = np.flatnonzero(np.isfinite(t))
    t, mem = t[usable], mem[usable]
    k = len(usable)
    idx = np.arange(k)
    # dom[a, b]: a dominates b on (time, memory) with the tie-break.
    t_le = t[:, None] <= t[None, :]
    m_le = mem[:, None] <= mem[None, :]
    strict = (t[:, None] < t[None, :]) | (mem[:, None] < mem[None, :])
    tie = (t[:, None] == t[None, :]) & (mem[:, None] == mem[None, :]) & (idx[:, None] < idx[None, :])
    dom = t_le & m_le & (strict | tie)
    if transition is not None:
        trans = _as_transition(transition, n)[np.ix_(usable, usable)]
        # Entries with x in {a, b} are masked out of the "for every x" conditions.
        outside = (idx[None, None, :] != idx[:, None, None]) & (idx[None, None, :] != idx[None, :, None])
        into = trans.T[:, None, :] <= trans.T[None, :, :]  # [a, b, x]: trans[x, a] <= trans[x, b]
        out_of = trans[:, None, :] <= trans[None, :, :]  # [a, b, x]: trans[a, x] <= trans[b, x]
        dom &= np.all((into & out_of) | ~outside, axis=2)
    dropped = dom.any(axis=0)
    return usable[~dropped].astype(np.intp)
