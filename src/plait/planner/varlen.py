"""Variable-length sequences (FlexSP): each step's sequence-parallel groups follow the data.

A global batch of sequences of different lengths runs on N devices as micro-batches; within a micro-batch
the devices are split into sequence-parallel (Ulysses) groups of sizes 1, 2, 4, ... and every sequence
runs whole on one group, all groups at once; the micro-batch takes as long as its slowest group. A
sequence of s tokens on a group of d devices costs what the cost model says a block of `cp=d` costs at
`seq_len=s` (attention grows with s^2, the rest with s; the all-to-alls on the group's links), times the
layers, plus the embedding and head; a group holds at most d x `capacity` tokens (memory). Model states
(weights, gradients, Adam) are sharded over all N devices (FSDP2, ZeRO-3, as FlexSP and `plait train
--varlen` do) or replicated; `states_bytes` prices them, and `capacity` is what activations may use beside them.
ByteScale's selective offloading: the saved activations of sequences of at least `offload_above` tokens go
to host memory and back (priced as a `swap=1` block of the cost model: copies beside the compute); the
capacity still counts their tokens.

FlexSP, per global batch:
1. the *sequence blaster* sorts the lengths and cuts them into K contiguous micro-batches of balanced work
   (long sequences together, short ones together), for the fewest K whose micro-batches fit in memory and
   the next few, keeping the fastest;
2. lengths are *bucketed* (a dynamic programme choosing bucket bounds that minimise the padding a bucket's
   bound adds), so the programme has one variable per (bucket, group size);
3. per micro-batch a MILP (HiGHS through `scipy.optimize.milp`, time-limited) decides how many groups of
   each size to form and how many sequences of each bucket each size class takes, under the device count
   and each class's token capacity, for a target time T that a bisection lowers; the best homogeneous
   layout (every group the same size, longest-processing-time assignment) is the start and the fallback;
4. sequences are placed on the groups of their class longest first onto the least-loaded group.

ByteScale-style balance scheduling is the second strategy: sequences are dealt over micro-batches so each
carries a similar share of work (`balance_split`), a long sequence gets ring context parallelism over
ceil(len / capacity) ad-hoc ranks (more when it ends last), short ones stay whole on one rank, and ranks
are balanced by compute (`balance_micro_batch`). Static sequence parallelism (one degree for the whole run; with ring cost, a static
data x context parallel mesh) is the baseline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from plait.cost import comm
from plait.cost.calibration import Calibration, calibration_for
from plait.cost.comm import GroupShape
from plait.cost.layer import BlockContext
from plait.cost.memory import model_state_bytes
from plait.cost.precision import PRECISIONS
from plait.cost.price import carried_bytes, price, price_edge
from plait.errors import PlaitError
from plait.plan import Strategy, split_layers
from plait.spec.cluster import Cluster
from plait.spec.model import ModelSpec

BUCKETS = 16
"""Length buckets per micro-batch in the programme (FlexSP uses 16)."""
BISECTION_STEPS = 12
"""Halvings of the target-time interval per micro-batch."""
SOLVER_TIME_LIMIT_S = 0.5
"""Time limit of one feasibility programme."""
EXTRA_MICRO_BATCH_COUNTS = 2
"""Micro-batch counts tried beyond the fewest that fit memory."""
MORE_MICRO_BATCHES = 16
"""Micro-batch counts tried beyond the fewest by token count when placement runs out of room."""

STATES = ("sharded", "replicated")
"""Model states sharded over every device (FSDP2, ZeRO-3) or replicated on each."""


def states_bytes(model: ModelSpec, devices: int, precision: str, states: str, stages: int = 1) -> float:
    """Bytes of model states (weights, gradients, optimizer) on each device: a stage's share of the model
    (1/`stages` of it) sharded over the stage's devices (ZeRO-3) or replicated on each."""
    sharded = states == "sharded"
    w, g, o = model_state_bytes(model.params / stages, devices // stages if sharded else 1, 3 if sharded else 0,
                                PRECISIONS[precision])
    return w + g + o


def stage_counts(devices: int, layers: int) -> list[int]:
    """Pipeline stage counts the variable-length planner may use: powers of two that divide `devices` and
    leave every stage a layer."""
    return [p for p in degrees(devices) if devices % p == 0 and p <= layers]


def fewest_stages(model: ModelSpec, devices: int, precision: str, states: str, memory: float) -> int:
    """The fewest pipeline stages whose model states fit `memory` bytes per device (ByteScale cuts the model
    into stages when its replicated states do not fit); PlaitError naming the fix when none does."""
    for p in stage_counts(devices, model.layers):
        if states_bytes(model, devices, precision, states, p) <= memory:
            return p
    raise PlaitError(f"{states} model states of {model.name} do not fit {memory / 2**30:.0f} GiB per device in any "
                     f"pipeline of up to {model.layers} stages on {devices} devices; use --states sharded or more "
                     "devices")


def offloaded(length: int, above: int) -> bool:
    """Whether a sequence of `length` tokens has its saved activations swapped to host memory (ByteScale's
    selective offloading of the longest sequences: those of at least `above` tokens; 0: none)."""
    return 0 < above <= length


class SequenceCost:
    """Seconds of one sequence (forward and backward, every layer, embedding and head) on a sequence-parallel
    group, from the cost model (cached): `seconds(length, degree)` on `degree` neighbouring devices,
    `on(length, ranks)` on any set of ranks (the links it spans matter)."""

    def __init__(self, model: ModelSpec, cluster: Cluster, cal: Calibration | None = None, precision: str = "bf16",
                 cp_mode: str = "ulysses", offload_above: int = 0, stages: int = 1) -> None:
        if any(b.kind not in ("decoder", "moe") for b in model.stack):
            raise PlaitError(f"variable-length planning packs decoder-only models; {model.name} has "
                             f"{', '.join(model.kind_counts())} layers")
        if stages < 1 or stages > model.layers:
            raise PlaitError(f"{stages} pipeline stages cannot cut {model.name}'s {model.layers} layers; give 1 to "
                             f"{model.layers} stages")
        self.model, self.cluster, self.stages = model, cluster, stages
        self.cuts = stage_layers(model.layers, stages)
        self.cal = cal or calibration_for(cluster.gpu.name)
        self.prec = PRECISIONS[precision]
        self.cp_mode, self.offload_above = cp_mode, offload_above
        self._cost = lru_cache(maxsize=1 << 17)(self._shaped)
        self.seconds = lru_cache(maxsize=1 << 17)(self._by_degree)

    def _by_degree(self, length: int, degree: int) -> float:
        return self._cost(length, GroupShape.of(range(degree), self.cluster.gpus_per_node))

    def on(self, length: int, ranks: Sequence[int]) -> float:
        return self._cost(length, GroupShape.of(sorted(ranks), self.cluster.gpus_per_node))

    def _shaped(self, length: int, group: GroupShape) -> float:
        """Seconds of the slowest pipeline stage (all of the model with one stage): its layers, the
        embedding on the first, the head on the last, and with several stages the hand-over of the
        sequence's hidden state to the next stage and of its gradient back (`comm.p2p`, this rank's share)."""
        s = Strategy(cp=group.size, cp_mode=self.cp_mode,  # type: ignore[arg-type]
                     swap=float(offloaded(length, self.offload_above)))
        shape = group if group.size > 1 else comm.SINGLE
        ctx = BlockContext(self.model, self.cluster, self.cal, self.prec, length, 1, comm.SINGLE, shape, comm.SINGLE)
        edge = {e: price_edge(e, s, ctx).time for e in ("embedding", "head")}
        stack = self.model.stack
        hand_over = 2 * comm.p2p(carried_bytes(0, 1, ctx) / group.size, False, self.cluster, self.cal) \
            if self.stages > 1 else 0.0
        slowest = 0.0
        for i, (start, end) in enumerate(self.cuts):
            t = sum(price(b, s, ctx).micro_batch_s for b in stack[start:end])
            t += (edge["embedding"].forward + edge["embedding"].backward) if i == 0 else hand_over
            t += (edge["head"].forward + edge["head"].backward) if i == self.stages - 1 else 0.0
            slowest = max(slowest, t)
        return slowest


@dataclass(frozen=True)
class Group:
    """A sequence-parallel group of `degree` devices in one micro-batch, the lengths it runs, its planned
    seconds and its ranks (0-based device numbers)."""

    degree: int
    lengths: tuple[int, ...]
    seconds: float
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class MicroBatch:
    groups: tuple[Group, ...]

    @property
    def seconds(self) -> float:
        return max((g.seconds for g in self.groups), default=0.0)


def stage_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) layers of each pipeline stage (`plait.plan.split_layers`: as even as possible)."""
    counts = split_layers(layers, stages)
    ends = np.cumsum(counts).tolist()
    return [(int(e - n), int(e)) for n, e in zip(counts, ends)]


@dataclass
class BatchPlan:
    """One global batch: its micro-batches in order, the planned seconds and the solver's seconds. With
    `stages` > 1 every micro-batch runs through a pipeline of that many stages, its groups laid out on each
    stage's devices alike (group ranks count within a stage)."""

    micro_batches: list[MicroBatch]
    solve_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    stages: int = 1

    @property
    def seconds(self) -> float:
        """Seconds of the step: the micro-batches one after another on the slowest stage, plus the pipeline's
        fill and drain (`pipeline_seconds`)."""
        return pipeline_seconds([m.seconds for m in self.micro_batches], self.stages)

    @property
    def bubble_s(self) -> float:
        """Seconds the pipeline's fill and drain add (0 with one stage)."""
        return self.seconds - sum(m.seconds for m in self.micro_batches)


def pipeline_seconds(stage_s: Sequence[float], stages: int) -> float:
    """Seconds of a GPipe or 1F1B step of variable micro-batches whose slowest stage takes `stage_s` each (forward and
    backward): the stage runs them back to back, and the other `stages - 1` stages add the fill and drain,
    each as long as the longest micro-batch (it is on the critical path of every stage it crosses)."""
    return sum(stage_s) + (stages - 1) * max(stage_s, default=0.0)


def degrees(devices: int) -> list[int]:
    """Group sizes: powers of two up to `devices`."""
    return [1 << k for k in range(devices.bit_length()) if (1 << k) <= devices]


def smallest_degree(longest: int, capacity: int, devices: int) -> int:
    """The smallest power-of-two group that holds a sequence of `longest` tokens; PlaitError if none does."""
    for d in degrees(devices):
        if longest <= d * capacity:
            return d
    raise PlaitError(f"a sequence of {longest} tokens needs more than {devices} devices at {capacity} tokens per "
                     "device; raise the capacity or the devices, or cut such sequences")


# ---- placement on groups ------------------------------------------------------------------------------------

def _least_loaded(lengths: Sequence[int], degree: int, loads: list[float], cost: SequenceCost, capacity: int
                  ) -> list[list[int]] | None:
    """Longest first, each sequence onto the least-loaded of the groups of `degree` devices (`loads`: their
    seconds so far, updated) that still has room for its tokens; the lengths on each group, or None if a
    sequence finds no room."""
    tokens = [0] * len(loads)
    held: list[list[int]] = [[] for _ in loads]
    for n in sorted(lengths, reverse=True):
        room = [g for g in range(len(loads)) if tokens[g] + n <= degree * capacity]
        if not room:
            return None
        g = min(room, key=lambda i: (loads[i], i))
        loads[g] += cost.seconds(n, degree)
        tokens[g] += n
        held[g].append(n)
    return held


def place(classes: dict[int, tuple[int, list[int]]], cost: SequenceCost, capacity: int) -> MicroBatch | None:
    """Put each class's sequences (`classes`: degree -> (groups, lengths)) on its groups, longest first onto
    the least-loaded group with room; None if some sequence finds no room."""
    groups: list[Group] = []
    first = 0  # groups take neighbouring ranks, largest first (so every group is aligned to its size)
    for d, (count, members) in sorted(classes.items(), reverse=True):
        loads = [0.0] * count
        held = _least_loaded(members, d, loads, cost, capacity)
        if held is None:
            return None
        for h, t in zip(held, loads):
            if h:
                groups.append(Group(d, tuple(h), t, tuple(range(first, first + d))))
                first += d
    return MicroBatch(tuple(groups))


def homogeneous(lengths: Sequence[int], degree: int, devices: int, cost: SequenceCost, capacity: int
                ) -> MicroBatch | None:
    """Every group of one degree (static sequence parallelism): devices // degree groups."""
    return place({degree: (devices // degree, list(lengths))}, cost, capacity)


# ---- bucketing ------------------------------------------------------------------------------------------

def buckets(lengths: Sequence[int], count: int = BUCKETS) -> list[tuple[int, int]]:
    """(bound, sequences) of at most `count` buckets: each sequence rounds up to its bucket's bound, bounds
    chosen by dynamic programming to minimise the padding tokens that adds."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    n = len(values)
    if n <= count:
        return [(int(v), int(c)) for v, c in zip(values, counts)]
    prefix_n = np.concatenate([[0], np.cumsum(counts)])
    prefix_t = np.concatenate([[0], np.cumsum(counts * values)])
    # pad(i, j): sequences i..j (sorted distinct values) rounded up to values[j]
    best = np.full((count + 1, n), np.inf)
    arg = np.zeros((count + 1, n), dtype=np.int64)
    for j in range(n):
        best[1, j] = values[j] * prefix_n[j + 1] - prefix_t[j + 1]
    for k in range(2, count + 1):
        for j in range(k - 1, n):
            i = np.arange(k - 1, j + 1)  # first index of the last bucket
            pad = values[j] * (prefix_n[j + 1] - prefix_n[i]) - (prefix_t[j + 1] - prefix_t[i])
            total = best[k - 1, i - 1] + pad
            m = int(np.argmin(total))
            best[k, j], arg[k, j] = total[m], i[m]
    out, j = [], n - 1
    for k in range(count, 0, -1):
        i = int(arg[k, j]) if k > 1 else 0
        out.append((int(values[j]), int(prefix_n[j + 1] - prefix_n[i])))
        j = i - 1
        if j < 0:
            break
    return out[::-1]


# ---- one micro-batch ----------------------------------------------------------------------------------------

def _feasible(bucket_list: list[tuple[int, int]], sizes: list[int], devices: int, capacity: int, target: float,
              cost: SequenceCost) -> dict[int, tuple[int, dict[int, int]]] | None:
    """Whether groups can be formed that finish every bucket's sequences within `target` seconds (each size
    class's total work within target x its group count, tokens within its capacity); the groups per size
    and sequences per (size, bucket bound), or None."""
    pairs = [(b, d) for b, (bound, _) in enumerate(bucket_list) for d in sizes
             if bound <= d * capacity and cost.seconds(bound, d) <= target]
    nv = len(sizes) + len(pairs)
    if not pairs:
        return None
    col = {p: len(sizes) + i for i, p in enumerate(pairs)}
    rows, lo, hi = [], [], []
    for b, (_, count) in enumerate(bucket_list):  # every sequence placed
        row = np.zeros(nv)
        for d in sizes:
            if (b, d) in col:
                row[col[b, d]] = 1
        rows.append(row)
        lo.append(count)
        hi.append(count)
    row = np.zeros(nv)
    row[: len(sizes)] = sizes
    rows.append(row)  # devices
    lo.append(0)
    hi.append(devices)
    for k, d in enumerate(sizes):
        work, tokens = np.zeros(nv), np.zeros(nv)
        work[k], tokens[k] = -target, -d * capacity
        for b, (bound, _) in enumerate(bucket_list):
            if (b, d) in col:
                work[col[b, d]] = cost.seconds(bound, d)
                tokens[col[b, d]] = bound
        rows += [work, tokens]
        lo += [-np.inf, -np.inf]
        hi += [0, 0]
    objective = np.concatenate([np.asarray(sizes, float), np.zeros(len(pairs))])  # fewest devices busy
    res = milp(objective, constraints=LinearConstraint(np.vstack(rows), lo, hi), integrality=np.ones(nv),
               bounds=Bounds(np.zeros(nv), np.full(nv, np.inf)), options={"time_limit": SOLVER_TIME_LIMIT_S})
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    return {d: (int(x[k]), {bucket_list[b][0]: int(x[col[b, dd]]) for (b, dd) in pairs if dd == d and x[col[b, dd]]})
            for k, d in enumerate(sizes) if x[k] > 0}


def plan_micro_batch(lengths: Sequence[int], devices: int, cost: SequenceCost, capacity: int) -> MicroBatch | None:
    """FlexSP's layout of one micro-batch (see the module docstring), or None if nothing fits memory."""
    sizes = degrees(devices)
    best = None
    for d in sizes:  # homogeneous start
        mb = homogeneous(lengths, d, devices, cost, capacity)
        if mb is not None and (best is None or mb.seconds < best.seconds):
            best = mb
    if best is None:
        return None
    bucket_list = buckets(lengths)
    low = sum(min(cost.seconds(n, d) * d for d in sizes) for n in lengths) / devices
    high = best.seconds
    for _ in range(BISECTION_STEPS):
        if high - low <= 0.005 * high:
            break
        target = (low + high) / 2
        classes = _feasible(bucket_list, sizes, devices, capacity, target, cost)
        if classes is None:
            low = target
            continue
        mb = _realise(lengths, bucket_list, classes, cost, capacity)
        if mb is not None and mb.seconds < best.seconds:
            best = mb
        high = target
    return best


def _realise(lengths: Sequence[int], bucket_list: list[tuple[int, int]],
             classes: dict[int, tuple[int, dict[int, int]]], cost: SequenceCost, capacity: int) -> MicroBatch | None:
    """Real sequences for the programme's (size, bucket) counts, placed on the groups of each size."""
    by_bucket: dict[int, list[int]] = {bound: [] for bound, _ in bucket_list}
    bounds = [bound for bound, _ in bucket_list]
    for n in sorted(lengths):
        by_bucket[bounds[int(np.searchsorted(bounds, n))]].append(n)
    members: dict[int, tuple[int, list[int]]] = {d: (count, []) for d, (count, _) in classes.items()}
    for d, (_, taken) in classes.items():
        for bound, k in taken.items():
            members[d][1].extend(by_bucket[bound][:k])
            del by_bucket[bound][:k]
    return place(members, cost, capacity)


# ---- ByteScale-style balance scheduler -------------------------------------------------------------------

def balance_micro_batch(lengths: Sequence[int], devices: int, cost: SequenceCost, capacity: int,
                        rounds: int = 32) -> MicroBatch | None:
    """ByteScale-style: a sequence longer than `capacity` runs with ring context parallelism over at least
    ceil(len / capacity) ranks, chosen among the least loaded (an ad-hoc group; it starts when all of them
    are free); the others run whole on one rank, longest first onto the least-loaded rank with room. Then,
    while it shortens the micro-batch, the sequence that ends last (or the longest on the rank that ends
    last) gets twice the ranks. Balances each rank's compute (s^2 and s terms alike, from the cost model)."""
    ordered = sorted(lengths, reverse=True)
    degree = [math.ceil(n / capacity) for n in ordered]
    if degree[0] > devices:
        return None
    best = _balance(ordered, degree, devices, cost, capacity)
    for _ in range(rounds):
        if best is None:
            return None
        mb, critical = best
        if critical is None or degree[critical] * 2 > devices:
            break
        trial = _balance(ordered, degree[:critical] + [degree[critical] * 2] + degree[critical + 1:], devices,
                         cost, capacity)
        if trial is None or trial[0].seconds >= mb.seconds:
            break
        degree[critical] *= 2
        best = trial
    return best[0] if best is not None else None


def _balance(ordered: list[int], degree: list[int], devices: int, cost: SequenceCost, capacity: int
             ) -> tuple[MicroBatch, int | None] | None:
    """Place the spread sequences (degree > 1) as groups, then the rest; the micro-batch and the index of
    the sequence to spread next (the one that ends last, or the longest on the rank that ends last)."""
    load = [0.0] * devices
    groups: list[Group] = []
    ends: list[tuple[float, int]] = []  # (end, sequence index) of each spread sequence
    for i, n in enumerate(ordered):
        if degree[i] == 1:
            continue
        ranks = sorted(sorted(range(devices), key=lambda r: (load[r], r))[: degree[i]])
        end = max(load[r] for r in ranks) + cost.on(n, ranks)
        for r in ranks:
            load[r] = end
        groups.append(Group(degree[i], (n,), end, tuple(ranks)))
        ends.append((end, i))
    held = _least_loaded([n for i, n in enumerate(ordered) if degree[i] == 1], 1, load, cost, capacity)
    if held is None:
        return None
    groups += [Group(1, tuple(h), load[r], (r,)) for r, h in enumerate(held) if h]
    slowest = max(range(devices), key=lambda r: load[r])
    if held[slowest]:  # the longest whole sequence on the rank that ends last
        critical = next(i for i, n in enumerate(ordered) if n == held[slowest][0] and degree[i] == 1)
    else:
        critical = max(ends, default=(0.0, None))[1]
    return MicroBatch(tuple(groups)), critical


def balance_split(lengths: Sequence[int], parts: int, cost: SequenceCost) -> list[list[int]]:
    """ByteScale's data balance: sequences dealt over `parts` micro-batches, heaviest first onto the
    lightest micro-batch (one device's seconds), so every micro-batch carries a similar share of work."""
    work = [0.0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for n in sorted(lengths, reverse=True):
        k = min(range(parts), key=lambda i: (work[i], i))
        work[k] += cost.seconds(n, 1)
        out[k].append(n)
    return [o for o in out if o]


# ---- a global batch -------------------------------------------------------------------------------------

def blast(lengths: Sequence[int], parts: int, cost: SequenceCost) -> list[list[int]]:
    """The sequence blaster: sorted lengths cut into `parts` contiguous micro-batches of about equal work
    (one device's seconds)."""
    ordered = sorted(lengths, reverse=True)
    work = np.cumsum([cost.seconds(n, 1) for n in ordered])
    cuts = [int(np.searchsorted(work, work[-1] * k / parts)) for k in range(1, parts)]
    out, start = [], 0
    for c in [*cuts, len(ordered)]:
        c = max(c, start + 1) if start < len(ordered) else start
        out.append(ordered[start:c])
        start = c
    return [o for o in out if o]


def plan_batch(lengths: Sequence[int], devices: int, cost: SequenceCost, capacity: int,
               method: str = "flexsp", degree: int | None = None) -> BatchPlan:
    """Micro-batches of one global batch: `flexsp`, `bytescale` (the balance scheduler, with `cost` in ring
    mode), or `static` sequence parallelism of `degree` (default: the smallest that holds the longest
    sequence; with a ring cost, a static data x context parallel mesh). With a cost of several pipeline
    stages (`SequenceCost.stages`) the groups are laid out on one stage's devices (devices / stages), which
    every stage repeats, and the step is priced as a pipeline of the micro-batches (`pipeline_seconds`)."""
    t0 = time.perf_counter()
    stages = cost.stages
    if devices % stages:
        raise PlaitError(f"{stages} pipeline stages do not divide {devices} devices; give a stage count that does")
    devices //= stages
    if method == "static":
        degree = degree or smallest_degree(max(lengths), capacity, devices)
        if max(lengths) > degree * capacity:
            raise PlaitError(f"--sp {degree} cannot hold a sequence of {max(lengths)} tokens at {capacity} per "
                             f"device; use --sp {smallest_degree(max(lengths), capacity, devices)} or more")
    else:
        smallest_degree(max(lengths), capacity, devices)  # fails clearly when nothing can hold the longest
    fewest = max(1, math.ceil(sum(lengths) / (devices * capacity)))
    best: BatchPlan | None = None
    for parts in range(fewest, fewest + MORE_MICRO_BATCHES + 1):
        if best is not None and parts > fewest + EXTRA_MICRO_BATCH_COUNTS:
            break
        chunks = balance_split(lengths, parts, cost) if method == "bytescale" else blast(lengths, parts, cost)
        if method == "static":
            mbs = [homogeneous(c, degree, devices, cost, capacity) for c in chunks]  # type: ignore[arg-type]
        elif method == "bytescale":
            mbs = [balance_micro_batch(c, devices, cost, capacity) for c in chunks]
        else:
            mbs = [plan_micro_batch(c, devices, cost, capacity) for c in chunks]
        if any(m is None for m in mbs):
            continue  # a micro-batch did not fit: try more of them
        plan = BatchPlan(mbs, stages=stages)  # type: ignore[arg-type]
        if best is None or plan.seconds < best.seconds:
            best = plan
    if best is None:
        raise PlaitError(f"no micro-batching of this batch fits {capacity} tokens per device on {devices} devices "
                         f"per stage; "
                         "raise the capacity or lower the global batch")
    best.solve_time_s = time.perf_counter() - t0
    return best


def load_lengths(path: str | Path) -> np.ndarray:
    """Sequence lengths, one positive integer per line; PlaitError naming the problem otherwise."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlaitError(f"cannot read lengths file {str(path)!r}: {getattr(exc, 'strerror', None) or exc}; give a "
                         "text file with one token count per line") from None
    values = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                values.append(int(line))
            except ValueError:
                raise PlaitError(f"{str(path)!r} line {i}: {line.strip()[:40]!r} is not a whole number of tokens") from None
            if values[-1] <= 0:
                raise PlaitError(f"{str(path)!r} line {i}: a length must be positive, got {values[-1]}")
    if not values:
        raise PlaitError(f"{str(path)!r} holds no lengths; give one token count per line")
    return np.asarray(values, dtype=np.int64)


def sample_batches(lengths: np.ndarray, batches: int, global_batch: int, seed: int) -> list[list[int]]:
    """`batches` global batches of `global_batch` lengths drawn (with replacement) with a fixed seed."""
    rng = np.random.default_rng(seed)
    return [rng.choice(lengths, size=global_batch).tolist() for _ in range(batches)]


__all__ = ["BatchPlan", "Group", "MicroBatch", "SequenceCost", "balance_micro_batch", "balance_split", "blast", "buckets", "degrees",
           "fewest_stages", "homogeneous", "load_lengths", "pipeline_seconds", "plan_batch", "plan_micro_batch",
           "sample_batches", "smallest_degree", "stage_counts", "stage_layers", "states_bytes"]
