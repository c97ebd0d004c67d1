"""Straggler-resilient planning (Malleus): a plan shaped around devices that run slower than the rest.

A device's speed factor is its time relative to a healthy device (`Cluster.speed`); factors below
`SNAP_FACTOR` count as healthy while planning (the simulator still charges them). For every template
(tensor-parallel degree, pipeline degree, micro-batch size, recompute) the planner

1. groups each node's devices into tensor-parallel *units*, slowest devices together so that a straggler
   holds back one unit, not several; with `shrink`, a unit holding stragglers may instead be its healthy
   members as a smaller tensor-parallel group (non-uniform tp);
2. builds pipelines of `pp` units, the stragglers either spread one per pipeline or concentrated in as few
   pipelines as possible, each pipeline's slowest units first (they get the fewest layers, where 1F1B
   keeps the most activations alive); the slowest units may be left out;
3. gives each stage a number of layers that balances its time (speed x layers) under its memory budget:
   the greedy allocation is the min-max optimum, and an integer programme picks, among allocations that
   fast, the one that moves fewest layers from the current plan;
4. gives each pipeline a number of micro-batches (integer programme: minimise the slowest pipeline; a
   pipeline may get none, which leaves its devices out), data in proportion to speed;

then simulates the best-estimated candidates and keeps the fastest that fits (ties: fewest layers moved).
Integer programmes run through HiGHS (`scipy.optimize.milp`) with a time limit; HiGHS through scipy takes
no initial solution, so the greedy solution's objective bounds each programme from above instead.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from plait.cost import comm
from plait.cost.calibration import Calibration, calibration_for
from plait.cost.comm import GroupShape
from plait.cost.layer import BlockContext
from plait.cost.precision import PRECISIONS, PrecisionBytes
from plait.cost.price import price, price_edge, send_time, usable_memory
from plait.errors import PlaitError
from plait.plan import Pipeline, Plan, Stage, Strategy, validate_plan
from plait.planner.space import divisors
from plait.simulate import Report, simulate
from plait.spec.cluster import SNAP_FACTOR, Cluster, snap
from plait.spec.model import ModelSpec

SIMULATED_CANDIDATES = 12
"""Best-estimated candidates the simulator judges (the estimate ranks hundreds in milliseconds)."""
TIE_TOLERANCE = 0.01
"""Plans within this fraction of the fastest count as equally fast; the one moving fewest layers wins."""
SOLVER_TIME_LIMIT_S = 1.0
"""Time limit of one integer programme (they are small: one variable per stage or per pipeline)."""
MICRO_BATCH_SIZES = (1, 2, 4, 8)
"""Sequences per micro-batch tried."""

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Unit:
    """A tensor-parallel group of devices on one node; `factor` is the time of its slowest member
    relative to a healthy device."""

    ranks: tuple[int, ...]
    factor: float

    @property
    def tp(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class _Prices:
    """Cost-model prices of one healthy unit of `tp` devices for one micro-batch (seconds, bytes)."""

    layer_s: float  # forward + backward (with recompute) of one block
    embedding_s: float
    head_s: float
    send_s: float  # p2p of one micro-batch's hidden state to the next stage
    layer_states: float  # weights + gradients + optimizer of one block on one device
    layer_activation: float  # bytes one block saves per micro-batch in flight
    working: float  # transient bytes of recompute and the head's logits
    embedding_states: float
    head_states: float


@dataclass(frozen=True)
class _Option:
    """An assembled plan with the planner's estimate (seconds) and, once simulated, its report."""

    plan: Plan
    estimate_s: float
    label: str
    report: Report | None = None
    template: _Template | None = None


@dataclass
class StragglerResult:
    """The chosen plan and what it was chosen against. `moved_layers` counts (rank, layer) pairs whose
    state the switch from `current` must move."""

    plan: Plan | None
    report: Report | None
    label: str
    moved_layers: int
    candidates: int
    solve_time_s: float
    migration_s: float = 0.0


def snapped(cluster: Cluster, threshold: float = SNAP_FACTOR) -> Cluster:
    """`cluster` with speed factors below `threshold` set to healthy (1.0)."""
    if not cluster.speed:
        return cluster
    return replace(cluster, speed=tuple(snap(cluster.speed, threshold)))


def group_units(cluster: Cluster, tp: int, shrink: bool, heads: tuple[int, int]) -> list[Unit]:
    """Each node's devices in units of `tp`, slowest together (fast units first in the list). With
    `shrink`, a unit with stragglers becomes its healthy members as the largest tensor-parallel group that
    divides the heads (`heads` = (query, kv)), when it has any healthy members."""
    units: list[Unit] = []
    for node in range(cluster.nodes):
        ranks = sorted(range(node * cluster.gpus_per_node, (node + 1) * cluster.gpus_per_node),
                       key=lambda r: (cluster.speed_of(r), r))
        for i in range(0, len(ranks) - tp + 1, tp):
            group = tuple(sorted(ranks[i: i + tp]))
            factor = max(cluster.speed_of(r) for r in group)
            healthy = tuple(r for r in group if cluster.speed_of(r) == 1.0)
            if shrink and factor > 1.0 and healthy:
                size = max(d for d in divisors(tp) if d <= len(healthy) and heads[0] % d == 0 and heads[1] % d == 0)
                units.append(Unit(healthy[:size], 1.0))
            else:
                units.append(Unit(group, factor))
    return sorted(units, key=lambda u: (u.factor, -u.tp, u.ranks))


def _prices(model: ModelSpec, cluster: Cluster, cal: Calibration, prec: PrecisionBytes, seq_len: int, mbs: int,
            s: Strategy, ranks: tuple[int, ...], replicas: int) -> _Prices:
    """Prices of strategy `s` on a unit's `ranks`, its layers' states sharded (ZeRO) over `replicas`
    pipelines (one device of each, on different nodes)."""
    ctx = BlockContext.for_ranks(model, cluster, cal, prec, seq_len, mbs, s, ranks, ranks[:1])
    ctx = replace(ctx, dp_group=GroupShape(replicas, replicas, 1) if replicas > 1 else ctx.dp_group)
    layer = price(model.block, s, ctx)
    embedding, head = price_edge("embedding", s, ctx), price_edge("head", s, ctx)
    return _Prices(layer_s=layer.micro_batch_s, embedding_s=embedding.time.forward + embedding.time.backward
                   + embedding.time.tp_comm, head_s=head.time.forward + head.time.backward + head.time.tp_comm,
                   send_s=2 * send_time(model.layers - 1, s, mbs, ctx, False), layer_states=layer.states,
                   layer_activation=layer.activation, working=max(head.working, layer.working),
                   embedding_states=embedding.states, head_states=head.states)


# ---- step 3: layers per stage ---------------------------------------------------------------------------

def assign_layers(per_layer: list[float], fixed: list[float], caps: list[int], layers: int,
                  current: list[int] | None = None) -> list[int] | None:
    """Layers per stage minimising the slowest stage, `per_layer[s] * l + fixed[s]`, with 1 <= l <= caps[s]
    and sum l = `layers`; among allocations that fast, the one closest to `current` (fewest layers moved).
    None when the caps do not hold the layers."""
    n = len(per_layer)
    if sum(caps) < layers or min(caps) < 1 or layers < n:
        return None
    counts = [1] * n
    for _ in range(layers - n):  # greedy: the next layer to the stage that stays fastest (min-max optimal)
        open_ = [s for s in range(n) if counts[s] < caps[s]]
        s = min(open_, key=lambda s: (per_layer[s] * (counts[s] + 1) + fixed[s], s))
        counts[s] += 1
    if current is None or len(current) != n or current == counts:
        return counts
    best = max(per_layer[s] * counts[s] + fixed[s] for s in range(n))
    # Variables: l_0..l_{n-1}, d_0..d_{n-1} (|l - current|); minimise sum d with every stage within `best`.
    c = np.concatenate([np.zeros(n), np.ones(n)])
    eye = np.eye(n)
    rows = [np.concatenate([np.ones(n), np.zeros(n)])[None, :],  # sum l = layers
            np.hstack([eye, -eye]), np.hstack([-eye, -eye]),  # l - d <= cur, -l - d <= -cur
            np.hstack([np.diag(per_layer), np.zeros((n, n))])]  # per_layer * l <= best - fixed
    cur = np.asarray(current, dtype=float)
    lo = np.concatenate([[layers], np.full(n, -np.inf), np.full(n, -np.inf), np.full(n, -np.inf)])
    hi = np.concatenate([[layers], cur, -cur, best * (1 + 1e-9) - np.asarray(fixed)])
    res = milp(c, constraints=LinearConstraint(np.vstack(rows), lo, hi), integrality=np.concatenate([np.ones(n),
               np.zeros(n)]), bounds=Bounds(np.concatenate([np.ones(n), np.zeros(n)]),
                                            np.concatenate([np.asarray(caps, float), np.full(n, np.inf)])),
               options={"time_limit": SOLVER_TIME_LIMIT_S})
    if res.x is None:
        return counts
    return [round(float(v)) for v in res.x[:n]]


@lru_cache(maxsize=4096)
def _assign_layers_cached(per_layer: tuple[float, ...], fixed: tuple[float, ...], caps: tuple[int, ...], layers: int,
                          current: tuple[int, ...] | None) -> list[int] | None:
    """`assign_layers` once per distinct pipeline (most pipelines of a cluster are alike)."""
    return assign_layers(list(per_layer), list(fixed), list(caps), layers, list(current) if current else None)


# ---- step 4: micro-batches per pipeline -----------------------------------------------------------------

def assign_micro_batches(slope: list[float], intercept: list[float], total: int, least: int,
                         exact: bool = True) -> list[int] | None:
    """Micro-batches per pipeline minimising the slowest pipeline, `slope[p] * m + intercept[p]` when
    m >= `least` (a used pipeline) and 0 when m = 0 (left out), with sum m = `total`. None when no pipeline
    can be used. Without `exact`, the greedy solution (`_water_fill`) alone."""
    n = len(slope)
    if total < least or n == 0:
        return None
    greedy, greedy_t = _water_fill(slope, intercept, total, least)
    classes = len(set(zip(slope, intercept)))
    if classes == 1 or not exact:  # identical pipelines: the first k filled evenly is optimal for the best k
        return greedy
    # Variables: m_0..m_{n-1} (integer), y_0..y_{n-1} (binary: pipeline used), z (the slowest pipeline).
    c = np.concatenate([np.zeros(2 * n), [1.0]])
    eye = np.eye(n)
    rows = [np.concatenate([np.ones(n), np.zeros(n), [0.0]])[None, :],  # sum m = total
            np.hstack([np.diag(slope), np.diag(intercept), -np.ones((n, 1))]),  # slope m + intercept y <= z
            np.hstack([-eye, least * eye, np.zeros((n, 1))]),  # m >= least y
            np.hstack([eye, -total * eye, np.zeros((n, 1))])]  # m <= total y
    for p, q in zip(range(n), range(1, n)):  # identical neighbours: p gets at least q's share (no symmetry)
        if (slope[p], intercept[p]) == (slope[q], intercept[q]):
            row = np.zeros(2 * n + 1)
            row[q], row[p] = 1.0, -1.0
            rows.append(row[None, :])
    extra = len(rows) - 4
    lo = np.concatenate([[total], np.full(3 * n + extra, -np.inf)])
    hi = np.concatenate([[total], np.zeros(3 * n + extra)])
    res = milp(c, constraints=LinearConstraint(np.vstack(rows), lo, hi),
               integrality=np.concatenate([np.ones(2 * n), [0]]),
               bounds=Bounds(np.zeros(2 * n + 1), np.concatenate([np.full(n, total), np.ones(n), [greedy_t * (1 + 1e-9)]])),
               options={"time_limit": SOLVER_TIME_LIMIT_S})
    if res.x is None:
        return greedy
    return [round(float(v)) for v in res.x[:n]]


def _water_fill(slope: list[float], intercept: list[float], total: int, least: int) -> tuple[list[int], float]:
    """The greedy solution: use the k cheapest pipelines (k at each boundary between distinct pipelines, in
    order of their cost at `least` micro-batches), start each at `least` and give every further micro-batch
    to the pipeline that stays fastest; the best k."""
    n = len(slope)
    order = sorted(range(n), key=lambda p: (slope[p] * least + intercept[p], slope[p], p))
    ks = [k for k in range(1, min(n, total // least) + 1)
          if k == min(n, total // least) or (slope[order[k]], intercept[order[k]]) != (slope[order[k - 1]],
                                                                                      intercept[order[k - 1]])]
    best, best_t = [0] * n, math.inf
    for k in ks:
        counts = dict.fromkeys(order[:k], least)
        heap = [(slope[p] * (least + 1) + intercept[p], p) for p in order[:k]]
        heapq.heapify(heap)
        for _ in range(total - least * k):
            _, p = heapq.heappop(heap)
            counts[p] += 1
            heapq.heappush(heap, (slope[p] * (counts[p] + 1) + intercept[p], p))
        t = max(slope[p] * counts[p] + intercept[p] for p in counts)
        if t < best_t:
            best, best_t = [counts.get(p, 0) for p in range(n)], t
    return best, best_t


# ---- steps 2 and assembly ----------------------------------------------------------------------------------

def build_pipelines(units: list[Unit], pp: int, spread: bool) -> list[list[Unit]]:
    """Pipelines of `pp` units each (as many as the units allow; the slowest leftovers stay out), each
    pipeline's slowest units first. `spread`: one straggler unit per pipeline round-robin; otherwise the
    stragglers fill as few pipelines as possible."""
    count = len(units) // pp
    if count == 0:
        return []
    fast_first = sorted(units, key=lambda u: (u.factor, -u.tp, u.ranks))[: count * pp]
    if spread:
        slow_first = fast_first[::-1]
        pipes: list[list[Unit]] = [[] for _ in range(count)]
        for i, u in enumerate(slow_first):
            pipes[i % count].append(u)
    else:
        pipes = [fast_first[i * pp: (i + 1) * pp] for i in range(count)]
    return [sorted(p, key=lambda u: (-u.factor, u.ranks)) for p in pipes]


@dataclass(frozen=True)
class _Shard:
    """How a rank holds one layer: split `tp` ways, weights split `weight_parts` ways (ZeRO-3) and optimizer
    state `optimizer_parts` ways (ZeRO-1 and up) over the layer's replicas."""

    tp: int
    weight_parts: int
    optimizer_parts: int


def _holdings(plan: Plan) -> dict[int, dict[int, _Shard]]:
    """rank -> {layer: how it holds that layer}."""
    holders: dict[int, int] = {}  # layer -> ranks holding a tensor-parallel shard of it, every pipeline
    for pipe in plan.pipelines:
        for st in pipe.stages:
            for layer in range(*st.layers):
                holders[layer] = holders.get(layer, 0) + len(st.ranks) // st.strategy(layer).tp
    out: dict[int, dict[int, _Shard]] = {}
    for pipe in plan.pipelines:
        for st in pipe.stages:
            for layer in range(*st.layers):
                s, n = st.strategy(layer), holders[layer]
                shard = _Shard(s.tp, n if s.zero >= 3 else 1, n if s.zero >= 1 else 1)
                for r in st.ranks:
                    out.setdefault(r, {})[layer] = shard
    return out


def _received(current: Plan, new: Plan) -> dict[int, list[_Shard]]:
    """rank -> the layer shards `new` gives it in another shape than `current` did (state it must receive)."""
    old = _holdings(current)
    return {r: [shard for layer, shard in held.items() if old.get(r, {}).get(layer) != shard]
            for r, held in _holdings(new).items()}


def moved_layers(current: Plan, new: Plan) -> int:
    """(rank, layer) pairs that `new` places on a rank that does not hold that layer in the same shape
    (tensor-parallel and ZeRO sharding) in `current`: the layers' states a switch must send."""
    return sum(len(shards) for shards in _received(current, new).values())


def migration_seconds(current: Plan, new: Plan, model: ModelSpec, cluster: Cluster, precision: str) -> float:
    """Seconds to send the weights and optimizer state of every moved (rank, layer) shard, ranks receiving
    in parallel over the inter-node link (the slower one): the cost of switching plans."""
    prec = PRECISIONS[precision]
    per_rank = [sum(model.block_params / sh.tp * (prec.param / sh.weight_parts + prec.optimizer / sh.optimizer_parts)
                    for sh in shards) for shards in _received(current, new).values()]
    return max(per_rank, default=0.0) / cluster.inter.bandwidth


@dataclass(frozen=True)
class _Template:
    tp: int
    pp: int
    mbs: int
    recompute: str
    zero: int  # ZeRO stage over the pipelines (1: optimizer state sharded; no per-layer lockstep)
    shrink: bool
    spread: bool


def _templates(model: ModelSpec, cluster: Cluster, global_batch: int) -> list[_Template]:
    out = []
    stragglers = any(f > 1.0 for f in cluster.speed)
    for tp in divisors(cluster.gpus_per_node):
        if model.heads % tp or model.kv_heads % tp:
            continue
        for pp in divisors(cluster.world_size // tp):
            if pp > model.layers:
                continue
            for mbs in MICRO_BATCH_SIZES:
                if global_batch % mbs or global_batch // mbs < pp:
                    continue
                for recompute, zero in itertools.product(("none", "full"), (0, 1)):
                    if zero and cluster.world_size // (tp * pp) == 1:
                        continue
                    for shrink in ((False, True) if stragglers and tp > 1 else (False,)):
                        for spread in ((False, True) if stragglers and pp > 1 else (False,)):
                            out.append(_Template(tp, pp, mbs, recompute, zero, shrink, spread))
    return out


def _assemble(model: ModelSpec, cluster: Cluster, cal: Calibration, prec: PrecisionBytes, seq_len: int,
              global_batch: int, precision: str, t: _Template, current: Plan | None,
              price: Callable[[int, tuple[int, ...], int], _Prices], exact: bool) -> _Option | None:
    """The template's plan: units, pipelines, layers per stage, micro-batches per pipeline (`exact`: by the
    integer programme, else greedily)."""
    units = group_units(cluster, t.tp, t.shrink, (model.heads, model.kv_heads))
    pipes = build_pipelines(units, t.pp, t.spread)
    if not pipes:
        return None
    capacity = usable_memory(cluster.gpu.memory_bytes, cal)
    current_cuts = _current_cuts(current)
    # ZeRO splits a layer's optimizer state among the pipelines only where every pipeline holds it alike
    # (`plait.runtime.replica_zero`); a shrunk unit beside full ones holds it in another shape: whole states.
    replicas = len(pipes) if len({u.tp for units_p in pipes for u in units_p}) == 1 else 1
    slopes, intercepts, cuts = [], [], []
    for units_p in pipes:
        per_layer, fixed, caps = [], [], []
        for s, u in enumerate(units_p):
            pr = price(u.tp, u.ranks, replicas)
            in_flight = t.pp - s  # 1F1B keeps pp - s micro-batches alive on stage s
            edge = (pr.embedding_s if s == 0 else 0.0) + (pr.head_s if s == t.pp - 1 else 0.0)
            per_layer.append(u.factor * pr.layer_s)
            fixed.append(u.factor * edge)
            room = capacity - pr.working - (pr.embedding_states if s == 0 else 0.0) - \
                (pr.head_states if s == t.pp - 1 else 0.0)
            caps.append(max(0, int(room // (pr.layer_states + in_flight * pr.layer_activation))))
        cur = [current_cuts.get(u.ranks, -1) for u in units_p]
        counts = _assign_layers_cached(tuple(per_layer), tuple(fixed), tuple(caps), model.layers,
                                       tuple(cur) if min(cur) > 0 else None)
        if counts is None:
            return None
        times = [per_layer[s] * counts[s] + fixed[s] for s in range(t.pp)]
        send = price(units_p[0].tp, units_p[0].ranks, replicas).send_s if t.pp > 1 else 0.0
        slopes.append(max(times) + send)
        intercepts.append(sum(times) - max(times) + (t.pp - 1) * send)
        cuts.append(counts)
    micro = assign_micro_batches(slopes, intercepts, global_batch // t.mbs, t.pp, exact)
    if micro is None:
        return None
    strategy_of = {tp: Strategy(tp=tp, zero=t.zero, recompute=t.recompute)  # type: ignore[arg-type]
                   for tp in {u.tp for p in pipes for u in p}}
    pipelines = []
    for units_p, counts, m in zip(pipes, cuts, micro):
        if m == 0:
            continue
        stages, start = [], 0
        for u, n in zip(units_p, counts):
            stages.append(Stage(layers=(start, start + n), ranks=u.ranks, strategies=(strategy_of[u.tp],)))
            start += n
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=m, micro_batch_sequences=t.mbs))
    plan = Plan(model=model.name, seq_len=seq_len, global_batch=global_batch, precision=precision,  # type: ignore[arg-type]
                pipelines=tuple(pipelines))
    plan = plan.with_runtime_p2p()
    estimate = max(a * m + b for a, b, m in zip(slopes, intercepts, micro) if m) + \
        _sync_estimate(plan, model, cluster, cal, prec)
    label = f"tp{t.tp} pp{t.pp} mbs{t.mbs}" + (" rc=full" if t.recompute == "full" else "") + \
        (f" zero{t.zero}" if t.zero else "") + \
        (" shrunk-tp" if t.shrink else "") + (" spread" if t.spread else "")
    return _Option(plan, estimate, label, template=t)


def _sync_estimate(plan: Plan, model: ModelSpec, cluster: Cluster, cal: Calibration, prec: PrecisionBytes) -> float:
    """Seconds of the largest stage's gradient all-reduce over the pipelines (after every pipeline is done)."""
    if len(plan.pipelines) == 1:
        return 0.0
    heaviest = max((st for p in plan.pipelines for st in p.stages), key=lambda st: st.num_layers / st.strategies[0].tp)
    s = heaviest.strategies[0].model_copy(update={"zero": 0})
    group = GroupShape.of([p.stages[0].ranks[0] for p in plan.pipelines], cluster.gpus_per_node)
    ctx = BlockContext(model, cluster, cal, prec, plan.seq_len, 1, comm.SINGLE, comm.SINGLE, group)
    layer = price(model.block, s, ctx)
    return heaviest.num_layers * (layer.grad_reduce + layer.param_gather)


def _degrees(t: _Template) -> tuple:
    return (t.tp, t.pp, t.mbs, t.recompute, t.zero)


def _current_degrees(plan: Plan) -> tuple:
    """The current plan's degrees in template terms (first pipeline's first stage and layer)."""
    pipe = plan.pipelines[0]
    s = pipe.stages[0].strategies[0]
    return (s.tp, len(pipe.stages) // plan.chunks, pipe.per_replica(s), s.recompute,
            min(s.zero, 1) if s.dp > 1 or len(plan.pipelines) > 1 else 0)


def _current_cuts(current: Plan | None) -> dict[tuple[int, ...], int]:
    """Layers each stage's ranks hold in the current plan."""
    if current is None:
        return {}
    return {st.ranks: st.num_layers for pipe in current.pipelines for st in pipe.stages}


def plan_around_stragglers(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int, *,
                           precision: str = "bf16", cal: Calibration | None = None, current: Plan | None = None,
                           keep_degrees: bool = False, min_gain: float = 0.0,
                           also: tuple[Plan, ...] = (), progress: Progress | None = None,
                           record: Callable[[Plan], None] | None = None) -> StragglerResult:
    """The fastest plan that fits `cluster` with its speed factors (see the module docstring). `current`
    (the plan running now) is a candidate too, ties go to the plan that moves fewest layers from it, and
    another plan must be `min_gain` (a fraction) faster than it to be chosen. With `keep_degrees`, only the current plan's tensor- and
    pipeline-parallel degrees, micro-batch size, recompute and ZeRO stage (data, layers and devices move).
    Plans in `also` (e.g. the healthy cluster's best, to return to when stragglers recover) are judged too.
    `record` gets every plan assembled and priced (the best-estimated ones as the integer programme splits
    their micro-batches), fastest estimate first."""
    if seq_len <= 0 or global_batch <= 0:
        raise PlaitError(f"seq_len and global_batch must be positive, got {seq_len} and {global_batch}")
    if not model.uniform:
        raise PlaitError(f"straggler-aware planning splits stacks of one layer kind; {model.name} has "
                         f"{', '.join(f'{n} {k}' for k, n in model.kind_counts().items())} layers and windows: "
                         "plan it without --slow")
    t0 = time.perf_counter()
    cal = cal or calibration_for(cluster.gpu.name)
    prec = PRECISIONS[precision]
    planning = snapped(cluster)
    cache: dict[tuple, _Prices] = {}

    def price_for(t: _Template) -> Callable[[int, tuple[int, ...], int], _Prices]:
        def price(tp: int, ranks: tuple[int, ...], replicas: int) -> _Prices:
            key = (tp, t.recompute, t.mbs, t.zero, replicas)
            if key not in cache:
                s = Strategy(tp=tp, zero=t.zero, recompute=t.recompute)  # type: ignore[arg-type]
                cache[key] = _prices(model, planning, cal, prec, seq_len, t.mbs, s, ranks, replicas)
            return cache[key]
        return price

    templates = _templates(model, planning, global_batch)
    if keep_degrees and current is not None:
        templates = [t for t in templates if _degrees(t) == _current_degrees(current)]
    found: list[_Option] = []
    for i, t in enumerate(templates):  # every template, micro-batches assigned greedily
        cand = _assemble(model, planning, cal, prec, seq_len, global_batch, precision, t, current, price_for(t), False)
        if cand is not None:
            found.append(cand)
        if progress:
            progress("straggler", i + 1, len(templates))
    found.sort(key=lambda c: c.estimate_s)
    exact = []  # the best-estimated ones again, micro-batches by the integer programme
    for cand in found[:SIMULATED_CANDIDATES]:
        t = cand.template
        again = _assemble(model, planning, cal, prec, seq_len, global_batch, precision, t, current, price_for(t), True)
        exact.append(again if again is not None and again.estimate_s < cand.estimate_s else cand)
    found = sorted(exact, key=lambda c: c.estimate_s) + found[SIMULATED_CANDIDATES:]
    for c in found if record is not None else ():
        record(c.plan)
    judged: list[_Option] = []
    if current is not None:
        validate_plan(current, model, cluster)
        judged.append(_Option(current, math.inf, "current plan"))
    for extra in also:
        validate_plan(extra, model, cluster)
        judged.append(_Option(extra, math.inf, "given plan"))
    judged += found[:SIMULATED_CANDIDATES]
    judged = [replace(c, report=simulate(c.plan, model, cluster, cal=cal, validate=c.estimate_s < math.inf))
              for c in judged]
    fitting = [c for c in judged if c.report is not None and c.report.fits]
    if not fitting:
        return StragglerResult(None, None, "nothing fits", 0, len(found), time.perf_counter() - t0)
    fastest = min(c.report.iteration_time_s for c in fitting)  # type: ignore[union-attr]
    near = [c for c in fitting if c.report.iteration_time_s <= fastest * (1 + TIE_TOLERANCE)]  # type: ignore[union-attr]
    moves = (lambda c: moved_layers(current, c.plan)) if current is not None else (lambda c: 0)
    best = min(near, key=lambda c: (moves(c), c.report.iteration_time_s))  # type: ignore[union-attr]
    if current is not None and best.label != "current plan" and judged[0].report is not None and \
            best.report.iteration_time_s > judged[0].report.iteration_time_s * (1 - min_gain):  # type: ignore[union-attr]
        best = judged[0]  # not worth a switch
    migration = migration_seconds(current, best.plan, model, cluster, precision) if current is not None else 0.0
    return StragglerResult(best.plan, best.report, best.label, moves(best), len(found), time.perf_counter() - t0,
                           migration)


__all__ = ["StragglerResult", "Unit", "assign_layers", "assign_micro_batches", "build_pipelines",
           "group_units", "migration_seconds", "moved_layers", "plan_around_stragglers", "snapped"]
