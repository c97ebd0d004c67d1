"""Event-level simulator of pipeline-parallel schedules (GPipe, 1F1B, interleaved 1F1B).

All times are in seconds. A *chunk* is a contiguous slice of the model; ``stages`` lists
the chunks in model order and chunk ``j`` runs on device ``j % p`` with
``p = len(stages) // chunks`` (Megatron-LM's interleaving: device ``d`` holds chunks
``d, d + p, d + 2p, ...``). With ``chunks == 1`` this is an ordinary ``p``-stage pipeline.

Execution model: every device runs its ops strictly in schedule order, one at a time.
An op starts at ``max(previous op on the device ends, dependencies ready)`` where

* ``F(mb, j)`` needs ``F(mb, j-1)`` finished plus ``stages[j-1].send_s``,
* ``B(mb, j)`` needs ``B(mb, j+1)`` finished plus ``stages[j].send_s`` and ``F(mb, j)``,
* ``B(mb, last)`` needs ``F(mb, last)``.

Point-to-point transfers are pure delays: they do not occupy a device's compute.

The op orders depend only on ``(schedule, p, m, chunks)``, so a topologically sorted
"plan" is built once per shape and cached; each simulation is then a single pass over
plain Python lists. For identical stages with ``chunks == 1`` a closed form is used.
"""

from __future__ import annotations

import gc
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from operator import itemgetter

from plait.plan import SYNC_P2P

__all__ = [
    "MEGATRON_P2P_HOLD",
    "SCHEDULES",
    "Op",
    "PipelineResult",
    "StageTimes",
    "bubble_fraction",
    "clear_plan_cache",
    "ideal_bubble_fraction",
    "p2p_hold",
    "peak_weighted_in_flight",
    "repeat_runs",
    "schedule_order",
    "simulate_pipeline",
]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")

MEGATRON_P2P_HOLD = 3.0
"""How long a synchronous pipeline exchange holds both of its devices, in units of the send's bandwidth time
(dimensionless). Megatron-LM without overlap_p2p_comm batches each op's sends with the next receives and waits
for them before computing on ("send and receive ... implemented together and can be blocked by the slower
one", Jiang et al., MegaScale, NSDI'24, Sec. 3.2). MegaScale's ablation measures what overlapping them gains:
55.5% -> 58.0% MFU (Table 3, step 4) on a 175B GPT, tp 8, pp 8, vpp 6, 256 A100, batch 256, i.e. the
synchronous exchanges cost 4.3% of that step; plait charges that configuration 4.1% with 3.0 (1.4% with the
bandwidth time alone: NCCL's chunked, staged p2p copies and the rendezvous with the slower peer come on top).
Chosen on that ablation, not on any row's error."""

def p2p_hold(p2p: str) -> float:
    """How long each op holds its device per second of its send's bandwidth time under Plan.p2p `p2p`
    (dimensionless): MEGATRON_P2P_HOLD for synchronous exchanges, 0 for asynchronous ones."""
    return MEGATRON_P2P_HOLD if p2p in SYNC_P2P else 0.0


@dataclass(frozen=True)
class StageTimes:
    """Times of one pipeline stage (one model chunk) for ONE micro-batch, in seconds."""

    forward_s: float
    """Forward of one micro-batch on this chunk."""
    backward_s: float
    """Backward of one micro-batch on this chunk (recomputation included)."""
    send_s: float = 0.0
    """P2P time to pass this chunk's output activation to the next chunk (and, same size,
    the gradient back). Ignored for the last chunk."""


@dataclass(frozen=True)
class Op:
    """One scheduled op (for timelines). Times in seconds from the start of the step."""

    device: int
    kind: str  # "F" or "B"
    micro_batch: int
    chunk: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PipelineResult:
    """Outcome of one simulated pipeline step. Times in seconds; tuples indexed by device."""

    makespan_s: float
    """Time from the first op start to the last op end over all devices."""
    busy_s: tuple[float, ...]
    """Compute time per device."""
    bubble_s: tuple[float, ...]
    """Idle time per device: ``makespan_s - busy_s[d]``."""
    peak_in_flight: tuple[int, ...]
    """Per device, the max number of (micro-batch, chunk) pairs whose forward is done and
    backward not yet done at any time (drives activation memory)."""
    last_backward_end_s: tuple[float, ...]
    """Per device, when its last backward ends."""
    first_backward_start_s: tuple[float, ...]
    """Per device, when its first backward starts."""
    ops: tuple[Op, ...] = ()
    """All ops sorted by (start, device); filled only when simulated with ``record=True``."""

    @property
    def devices(self) -> int:
        """Number of pipeline devices."""
        return len(self.busy_s)


# --------------------------------------------------------------------------- op orders
# Ops are encoded as ints: F(mb, j) = mb * n + j and B(mb, j) = m * n + mb * n + j,
# where n = p * chunks is the number of model chunks; 2 * m * n is a "no op" sentinel.


def _device_orders(schedule: str, p: int, m: int, v: int) -> list[list[int]]:
    """Per-device op order (encoded op ids), following Megatron-LM."""
    n = p * v
    half = m * n
    if schedule == "interleaved" and v == 1:
        schedule = "1f1b"
    orders: list[list[int]] = []
    for d in range(p):
        if schedule == "gpipe":
            fw = [mb * n + d for mb in range(m)]
            orders.append(fw + [half + o for o in fw])
            continue
        if schedule == "1f1b":
            # forward_backward_pipelining_without_interleaving: p - d - 1 warm-up forwards.
            warmup = min(p - d - 1, m)
            fw = [mb * n + d for mb in range(m)]
            bw = [half + o for o in fw]
        else:
            # forward_backward_pipelining_with_interleaving (micro-batch groups of size p):
            # forward op k is chunk (k // p) % v of micro-batch (k // (p v)) p + k % p;
            # backward op k is the same but walks the chunks in reverse.
            total = m * v
            warmup = min((p - d - 1) * 2 + (v - 1) * p, total)
            pv = p * v
            fw = [((k // pv) * p + k % p) * n + ((k // p) % v) * p + d for k in range(total)]
            bw = [half + ((k // pv) * p + k % p) * n + (v - 1 - (k // p) % v) * p + d for k in range(total)]
        steady = len(fw) - warmup
        seq = fw[:warmup]
        seq += [o for k in range(steady) for o in (fw[warmup + k], bw[k])]
        seq += bw[steady:]
        orders.append(seq)
    return orders


def schedule_order(
    schedule: str, p: int, micro_batches: int, chunks: int = 1
) -> list[list[tuple[str, int, int]]]:
    """Per-device op order as ``(kind, micro_batch, chunk)`` with kind ``"F"`` or ``"B"``."""
    _check_shape(schedule, p * chunks, micro_batches, chunks)
    n = p * chunks
    half = micro_batches * n
    return [
        [("F" if o < half else "B", (o % half) // n, o % n) for o in seq]
        for seq in _device_orders(schedule, p, micro_batches, chunks)
    ]


@lru_cache(maxsize=64)
def _cached_orders(schedule: str, p: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(order) for order in _device_orders(schedule, p, m, v))


def peak_weighted_in_flight(schedule: str, p: int, micro_batches: int, chunks: int,
                            weights: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Per device, the peak over time of the summed weights of its alive (micro-batch, chunk) pairs.

    ``weights[d][c]`` is what one micro-batch of device d's local chunk c keeps alive (e.g. activation
    bytes), so uneven chunks are counted exactly rather than as peak count x largest chunk.
    """
    if chunks == 1:
        counts = _peaks(schedule if schedule != "interleaved" else "1f1b", p, micro_batches)
        return tuple(counts[d] * weights[d][0] for d in range(p))
    return tuple(max(sum(w * k for w, k in zip(weights[d], alive, strict=True)) for alive in candidates)
                 for d, candidates in enumerate(_alive_maxima(schedule, p, micro_batches, chunks)))


@lru_cache(maxsize=256)
def _alive_maxima(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per device, the alive-pair counts per local chunk at the moments no other moment dominates (at
    least as many alive of every chunk): the weighted peak for any non-negative weights is among them."""
    n = p * v
    half = m * n
    out = []
    for order in _cached_orders(schedule, p, m, v):
        alive = [0] * v
        seen: set[tuple[int, ...]] = set()
        for op in order:
            c = (op % n) // p
            if op < half:
                alive[c] += 1
                seen.add(tuple(alive))
            else:
                alive[c] -= 1
        kept: list[tuple[int, ...]] = []  # a dominating tuple has the larger sum, so it comes first
        for a in sorted(seen, key=sum, reverse=True):
            if not any(all(x >= y for x, y in zip(b, a, strict=True)) for b in kept):
                kept.append(a)
        out.append(tuple(kept))
    return tuple(out)


@dataclass(frozen=True)
class _Plan:
    """Topologically sorted ops of one schedule shape, ready for a single timing pass."""

    steps: tuple[tuple[int, int, int, int], ...]  # (op, device, dep, kind * n + chunk)
    first_b: tuple[tuple[int, int, int], ...]  # per device first backward: (op before it, dep, kind_chunk)
    last_b: tuple[int, ...]  # per device, op id of its last backward
    peak_in_flight: tuple[int, ...]
    n_ops: int


_PLAN_CACHE: OrderedDict[tuple[str, int, int, int], _Plan] = OrderedDict()
_PLAN_CACHE_MAX_OPS = 1_000_000  # ~150 MB of plan tuples at most


def clear_plan_cache() -> None:
    """Drop all cached schedule plans."""
    _PLAN_CACHE.clear()


def _plan(schedule: str, p: int, m: int, v: int) -> _Plan:
    """Cached plan for a shape (LRU, bounded by the total number of ops held)."""
    key = (schedule, p, m, v)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        _PLAN_CACHE.move_to_end(key)
        return plan
    # The plan is tens of thousands of small acyclic tuples: pausing the cyclic GC while
    # building it avoids repeated collections (about a third of the build time).
    paused = gc.isenabled()
    gc.disable()
    try:
        plan = _plan_from_orders(_device_orders(schedule, p, m, v), p, m, v, schedule, validate=False)
    finally:
        if paused:
            gc.enable()
    if plan.n_ops <= _PLAN_CACHE_MAX_OPS:
        _PLAN_CACHE[key] = plan
        total = sum(pl.n_ops for pl in _PLAN_CACHE.values())
        while total > _PLAN_CACHE_MAX_OPS:
            total -= _PLAN_CACHE.popitem(last=False)[1].n_ops
    return plan


def _plan_from_orders(
    orders: list[list[int]], p: int, m: int, v: int, label: str = "", validate: bool = True
) -> _Plan:
    """Build a plan from per-device op orders; raise RuntimeError if they deadlock.

    ``validate`` checks that every device runs exactly its own ops and each backward after
    its forward (the built-in orders satisfy this by construction).
    """
    n = p * v
    half = m * n
    none = 2 * half
    # Static per-op tables, indexed by op id (plus the sentinel at index ``none``).
    device = [j % p for j in range(n)] * (2 * m) + [0]
    kind_chunk = list(range(n)) * m + list(range(n, 2 * n)) * m + [0]
    dep = list(range(-1, half - 1)) + list(range(half + 1, none + 1)) + [none]
    dep[0:half:n] = [none] * m  # F(mb, 0) waits for nothing
    dep[half + n - 1 : none : n] = [none] * m  # B(mb, last) waits for F(mb, last): same device

    peaks: list[int] = []
    first_b: list[tuple[int, int, int]] = []
    last_b: list[int] = []
    for d, ids in enumerate(orders):
        if validate:
            mine = {x for j in range(d, n, p) for mb in range(m) for x in (mb * n + j, half + mb * n + j)}
            if len(ids) != len(mine) or set(ids) != mine:
                raise ValueError(f"device {d}: op order must hold F and B of each of its chunks once")
            pos = {o: i for i, o in enumerate(ids)}
            if any(pos[o - half] > pos[o] for o in ids if o >= half):
                raise RuntimeError(
                    f"schedule {label!r} deadlocks: device {d} runs a backward before its forward"
                )
        peaks.append(max(accumulate(1 if o < half else -1 for o in ids)))
        i = next(i for i, o in enumerate(ids) if o >= half)
        first_b.append((ids[i - 1], dep[ids[i]], kind_chunk[ids[i]]))
        last_b.append(next(o for o in reversed(ids) if o >= half))

    # Topological order: advance a device's pointer while its next op's cross-device
    # dependency is done. A blocked device waits on a neighbour (F(mb, j-1) lives on device
    # d-1, B(mb, j+1) on d+1), so only neighbours are re-queued after a device advances.
    dev_deps = [[*map(dep.__getitem__, ids), none + 1] for ids in orders]  # never-done sentinel
    done = bytearray(none + 2)
    done[none] = 1
    ptr = [0] * p
    lens = [len(ids) for ids in orders]
    blocked = [none] * p  # op each device waits for (``none``: not waiting)
    queued = [True] * p
    stack = list(range(p - 1, -1, -1))
    order: list[int] = []
    remaining = none
    while stack:
        d = stack.pop()
        queued[d] = False
        ids, deps = orders[d], dev_deps[d]
        i = start = ptr[d]
        while done[deps[i]]:
            done[ids[i]] = 1
            i += 1
        blocked[d] = deps[i] if i < lens[d] else none
        if i == start:
            continue
        order += ids[start:i]
        ptr[d] = i
        remaining -= i - start
        for nb in ((d + 1) % p, (d - 1) % p):
            w = blocked[nb]
            if w != none and done[w] and not queued[nb]:
                queued[nb] = True
                stack.append(nb)
    if remaining:
        stuck = {d: orders[d][ptr[d]] for d in range(p) if ptr[d] < lens[d]}
        raise RuntimeError(f"schedule {label!r} deadlocks; blocked op per device: {stuck}")
    steps = tuple(
        zip(
            order,
            itemgetter(*order)(device),
            itemgetter(*order)(dep),
            itemgetter(*order)(kind_chunk),
        )
    )
    return _Plan(steps, tuple(first_b), tuple(last_b), tuple(peaks), none)


# --------------------------------------------------------------------------- simulation


def _check_shape(schedule: str, n_stages: int, m: int, chunks: int) -> int:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    if chunks < 1 or n_stages < 1 or n_stages % chunks:
        raise ValueError(f"need len(stages) ({n_stages}) to be a positive multiple of chunks ({chunks})")
    if m < 1:
        raise ValueError(f"micro_batches must be >= 1, got {m}")
    p = n_stages // chunks
    if chunks > 1:
        if schedule != "interleaved":
            raise ValueError(f"chunks={chunks} > 1 requires schedule 'interleaved', got {schedule!r}")
        if m % p:
            raise ValueError(
                f"interleaved schedule needs micro_batches ({m}) divisible by the number of "
                f"pipeline devices ({p})"
            )
    return p


def _peaks(schedule: str, p: int, m: int) -> tuple[int, ...]:
    if schedule == "gpipe":
        return (m,) * p
    return tuple(min(p - d, m) for d in range(p))


def _closed_form(st: StageTimes, p: int, m: int, schedule: str) -> PipelineResult:
    """Identical stages, one chunk per device; ``schedule`` is "gpipe" or "1f1b".

    GPipe: ``makespan = (m + p - 1)(f + b) + 2 (p - 1) s``. 1F1B pays extra p2p round trips
    because a device may only start a new forward after its next backward (the in-flight
    window is bounded): ``makespan = (m + p - 1)(f + b) + 2 s [(p - 1) + (m - 2) - floor((m - 2) / p)]``
    (equal to the GPipe value when ``s == 0`` or ``m <= 2``). Both are exact w.r.t. the
    event simulation (checked by property tests).
    """
    f, b, s = st.forward_s, st.backward_s, (st.send_s if p > 1 else 0.0)
    hops = p - 1
    if schedule == "1f1b":
        hops += (m - 2) - (m - 2) // p
    makespan = (m + p - 1) * (f + b) + 2 * hops * s
    # Micro-batch 0's backward starts on the last device once its forward(s) are done and
    # walks back one device per b + s; the last backward ends d * (b + s) before device 0's.
    warm = m if schedule == "gpipe" else 1
    first_b = tuple((p - 1 + warm) * f + (p - 1) * s + (p - 1 - d) * (b + s) for d in range(p))
    last_b = tuple(makespan - d * (b + s) for d in range(p))
    busy = m * (f + b)
    return PipelineResult(
        makespan_s=makespan,
        busy_s=(busy,) * p,
        bubble_s=(max(0.0, makespan - busy),) * p,
        peak_in_flight=_peaks(schedule, p, m),
        last_backward_end_s=last_b,
        first_backward_start_s=first_b,
    )


def _simulate(
    schedule: str, p: int, m: int, v: int, stages: Sequence[StageTimes], record: bool, hold: float = 0.0
) -> PipelineResult:
    plan = _plan(schedule, p, m, v)
    n = p * v
    # Tables indexed by kind * n + chunk: op duration, and the p2p delay on its input edge.
    compute = [st.forward_s for st in stages] + [st.backward_s for st in stages]
    sends = [st.send_s for st in stages[:-1]]  # the last chunk's send is never used
    delay = [0.0, *sends, *sends, 0.0]
    # A synchronous exchange keeps the device until the op's output is sent: forward to the next chunk,
    # backward to the one before.
    dur = [c + hold * s for c, s in zip(compute, [*sends, 0.0, 0.0, *sends], strict=True)] if hold else compute
    end = [0.0] * (plan.n_ops + 1)  # end[n_ops] == 0.0 is the "no dependency" sentinel
    free = [0.0] * p
    starts: list[float] | None = [0.0] * (plan.n_ops + 1) if record else None
    if starts is None:
        for o, d, dp, k in plan.steps:
            t = free[d]
            r = end[dp] + delay[k]
            t = max(t, r)
            t += dur[k]
            end[o] = t
            free[d] = t
    else:
        for o, d, dp, k in plan.steps:
            t = free[d]
            r = end[dp] + delay[k]
            t = max(t, r)
            starts[o] = t
            t += dur[k]
            end[o] = t
            free[d] = t

    makespan = max(free)
    busy = [0.0] * p
    for j in range(n):
        busy[j % p] += m * (compute[j] + compute[n + j])
    first_b = tuple(max(end[prev], end[dp] + delay[k]) for prev, dp, k in plan.first_b)
    ops: tuple[Op, ...] = ()
    if starts is not None:
        half = m * n
        ops = tuple(
            sorted(
                (
                    Op(
                        device=d,
                        kind="F" if o < half else "B",
                        micro_batch=(o % half) // n,
                        chunk=o % n,
                        start_s=starts[o],
                        end_s=end[o],
                    )
                    for o, d, _, _ in plan.steps
                ),
                key=lambda op: (op.start_s, op.device),
            )
        )
    return PipelineResult(
        makespan_s=makespan,
        busy_s=tuple(busy),
        bubble_s=tuple(max(0.0, makespan - x) for x in busy),
        peak_in_flight=plan.peak_in_flight,
        last_backward_end_s=tuple(end[o] for o in plan.last_b),
        first_backward_start_s=first_b,
        ops=ops,
    )


def simulate_pipeline(
    stages: Sequence[StageTimes],
    micro_batches: int,
    schedule: str,
    chunks: int = 1,
    record: bool = False,
    *,
    closed_form: bool = True,
    hold: float = 0.0,
) -> PipelineResult:
    """Simulate one training step of a pipeline schedule.

    Args:
        stages: per-chunk times for one micro-batch, in model order (``p * chunks`` items).
        micro_batches: number of micro-batches ``m`` per step.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (Megatron-LM orders).
            ``"interleaved"`` with ``chunks == 1`` is exactly ``"1f1b"``.
        chunks: model chunks (virtual stages) per device; > 1 only for ``"interleaved"``,
            which then needs ``micro_batches % p == 0``.
        record: also return every op with its start/end time (for timelines).
        closed_form: allow the analytic shortcut for identical stages with ``chunks == 1``.
        hold: > 0 for synchronous sends (Megatron-LM's): each op also holds its device for ``hold`` times
            the send of its output (see MEGATRON_P2P_HOLD); ``busy_s`` still counts compute only.

    Returns:
        A :class:`PipelineResult`; all times in seconds, measured from the first op start.

    Raises:
        ValueError: on an unknown schedule or inconsistent shape.
        RuntimeError: if the schedule order deadlocks.
    """
    p = _check_shape(schedule, len(stages), micro_batches, chunks)
    lowest = min(min(st.forward_s, st.backward_s, st.send_s) for st in stages)
    total = sum(st.forward_s + st.backward_s + st.send_s for st in stages)
    if not (lowest >= 0.0 and total < math.inf):  # also rejects NaN
        raise ValueError("stage times must be finite and >= 0")
    if schedule == "interleaved" and chunks == 1:
        schedule = "1f1b"
    if hold < 0.0 or not math.isfinite(hold):
        raise ValueError("hold must be finite and >= 0")
    if closed_form and not record and chunks == 1 and not hold:
        first = stages[0]
        if all(st == first for st in stages[1:-1]) and (
            p == 1 or (stages[-1].forward_s == first.forward_s and stages[-1].backward_s == first.backward_s)
        ):
            return _closed_form(first, p, micro_batches, schedule)
    return _simulate(schedule, p, micro_batches, chunks, stages, record, hold)


# --------------------------------------------------------------------------- helpers


def repeat_runs(result: PipelineResult, runs: int) -> PipelineResult:
    """`runs` copies of one schedule's step run back to back, as a training loop that calls a pipeline
    schedule once per gradient accumulation step does (NeMo AutoModel: one ``schedule.step()`` per GA step).
    Each run starts on every device ``makespan_s`` after the previous one: the first device ends the
    previous run last (its final backward) and starts the next one's fill, which the other devices wait
    for, so every run pays its own fill and drain. Times in seconds; peaks in flight are one run's."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if runs == 1:
        return result
    span = result.makespan_s
    shift = (runs - 1) * span
    makespan = runs * span
    busy = tuple(runs * b for b in result.busy_s)
    per_run = 1 + max((o.micro_batch for o in result.ops), default=-1)
    ops = tuple(Op(o.device, o.kind, o.micro_batch + k * per_run, o.chunk, o.start_s + k * span,
                   o.end_s + k * span) for k in range(runs) for o in result.ops)
    return PipelineResult(
        makespan_s=makespan,
        busy_s=busy,
        bubble_s=tuple(max(0.0, makespan - b) for b in busy),
        peak_in_flight=result.peak_in_flight,
        last_backward_end_s=tuple(shift + t for t in result.last_backward_end_s),
        first_backward_start_s=result.first_backward_start_s,
        ops=ops,
    )


def bubble_fraction(result: PipelineResult) -> float:
    """Fraction of device-time spent idle: ``sum(bubble) / (p * makespan)`` (dimensionless)."""
    if result.makespan_s <= 0.0:
        return 0.0
    return sum(result.bubble_s) / (len(result.bubble_s) * result.makespan_s)


def ideal_bubble_fraction(p: int, micro_batches: int, chunks: int = 1) -> float:
    """Bubble fraction of (interleaved) 1F1B with equal stages and free p2p:
    ``(p - 1) / (chunks * m + p - 1)``."""
    return (p - 1) / (chunks * micro_batches + p - 1)


def paired_share(schedule: str, p: int, micro_batches: int, chunks: int = 1) -> float:
    """Share of the first device's passes that the schedule runs beside another micro-batch's opposite pass, as
    Megatron's expert-parallel overlap pairs them (each steady-state forward with an earlier micro-batch's
    backward): all but the warm-up forwards, as many cool-down backwards and the first steady forward (with
    one device: every micro-batch but the first forward and the last backward); none under GPipe, which runs
    every forward before any backward. Dimensionless."""
    if schedule == "gpipe":
        return 0.0
    passes = micro_batches * chunks
    warm_up = 2 * (p - 1) + (chunks - 1) * p if chunks > 1 else p - 1  # Megatron's first-rank warm-up
    return max(0, passes - min(passes, warm_up) - 1) / passes
