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
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np

from plait.errors import PlaitError

__all__ = [
    "LayerSolution",
    "prune_dominated",
    "solve_layers",
    "solve_layers_all_budgets",
    "solve_layers_brute_force",
]

_BRUTE_FORCE_LIMIT = 2_000_000
_CUBE_LIMIT = 1 << 18  # elements of the (a, b, u) cube below which it is built whole


@dataclass(frozen=True)
class LayerSolution:
    """An assignment of strategies to a stage's layers.

    ``time`` is in seconds (layer times plus transitions), ``memory`` in the caller's units,
    ``choice[l]`` is the strategy index of layer ``l``.
    """

    time: float
    memory: int
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


def _prepare(
    time: np.ndarray,
    memory: np.ndarray,
    transition: np.ndarray,
    budget: int,
    allowed: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Validated ``(time, memory, transition, budget)``; forbidden pairs get ``inf`` time."""
    t = np.array(time, dtype=np.float64)
    if t.ndim != 2:
        raise PlaitError(f"time must be 2-D (layers, strategies); got shape {t.shape}")
    if np.any(np.isnan(t)) or np.any(t < 0):
        raise PlaitError("time must be >= 0 seconds (inf marks a forbidden pair)")
    mem = _as_memory(memory, t.shape)
    trans = _as_transition(transition, t.shape[1])
    try:
        budget = operator.index(budget)
    except TypeError:
        raise PlaitError(f"budget must be an integer number of units; got {budget!r}") from None
    if budget < 0:
        raise PlaitError(f"budget must be >= 0 units; got {budget}")
    if allowed is not None:
        ok = np.asarray(allowed)
        if ok.shape != t.shape or ok.dtype != np.bool_:
            raise PlaitError(f"allowed must be a boolean array of shape {t.shape}")
        t[~ok] = np.inf
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
    """Time (seconds) and memory (units) of ``choice``, summed in the DP's order."""
    total = 0.0
    used = 0
    prev = None
    for layer, s in enumerate(choice):
        if prev is not None:
            total = total + float(trans[prev, s])
        total = total + float(t[layer, s])
        used += int(mem[layer, s])
        prev = s
    return LayerSolution(time=total, memory=used, choice=choice)


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
