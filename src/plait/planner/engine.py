"""The search engine: the fastest per-layer hybrid-parallel plan that fits, judged by the simulator.

For every pipeline degree, micro-batch count and schedule it (1) prices each candidate layer strategy
once with the cost model (time per micro-batch, gradient synchronisation, model states, activations),
(2) keeps the strategies on the time/memory Pareto front, (3) solves Galvatron's dynamic programme over the
layers of each stage under that stage's memory budget (a multiple-choice knapsack with re-layout costs
between differing neighbours), (4) partitions layers into stages the Galvatron-BMW way: start from a
memory-balanced cut, move layers from the slowest stage toward time balance while the simulated
throughput improves, and (5) lets the simulator judge every assembled plan. The best uniform Megatron
layout (grid search) is a candidate too, so the result is never worse than it.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plait.cost.calibration import Calibration, calibration_for
from plait.cost.comm import GroupShape
from plait.cost.layer import BlockContext
from plait.cost.pipeline import StageTimes, simulate_pipeline
from plait.cost.precision import PRECISIONS
from plait.cost.price import carried_bytes, price, price_edge, relayout_time, usable_memory
from plait.errors import PlaitError
from plait.executable import unsupported
from plait.layout import Layout
from plait.plan import Pipeline, Plan, Stage, Strategy, split_layers, validate_plan
from plait.planner.baselines import Candidate, run_baseline
from plait.planner.layerwise import solve_layers
from plait.planner.space import SpaceLimits, block_strategies, divisors, pareto_front
from plait.simulate import Report, simulate
from plait.spec.cluster import Cluster
from plait.spec.layers import Block
from plait.spec.model import ModelSpec

DEFAULT_LIMITS = SpaceLimits()
MEMORY_UNITS = 256
"""Steps of the discretised memory budget in the layer DP (Galvatron uses ~MB units; 256 steps of a
stage's budget keep rounding below 0.4% of it)."""
MAX_MICRO_BATCH_COUNTS = 6
"""Micro-batch counts tried per pipeline degree (spread geometrically over the useful range)."""
REBALANCE_ROUNDS = 8
"""Layer moves tried by the time-balancing step of the stage partitioner, per configuration."""
FIT_RETRIES = 2
"""Times a stage budget is tightened by the simulated overflow when an assembled plan does not fit."""

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass
class SearchResult:
    """Outcome of a search. `plan`/`report` are the best plan that fits (None when nothing does)."""

    plan: Plan | None
    report: Report | None
    best_uniform: Candidate | None
    best_layerwise: Candidate | None
    evaluated: int
    search_time_s: float
    closest: Candidate | None = None  # when nothing fits: the plan with the least peak memory


@dataclass(frozen=True)
class _Priced:
    """Cost-model prices of one strategy for one layer in one configuration."""

    strategy: Strategy
    mb_time: float  # seconds per micro-batch (forward + backward + recompute + exposed communication)
    sync: float  # seconds of exposed gradient synchronisation per iteration (estimate)
    states: float  # bytes of weights + gradients + optimizer
    activation: float  # bytes saved per micro-batch in flight
    working: float  # transient bytes while recomputing


def _micro_batch_counts(global_batch: int, pp: int) -> list[int]:
    """Micro-batch counts to try: divisors of the global batch from pp (or 1) up to ~16 x pp."""
    low = max(1, pp)
    counts = [m for m in divisors(global_batch) if low <= m <= max(16 * pp, 8)]
    if len(counts) > MAX_MICRO_BATCH_COUNTS:
        idx = np.unique(np.round(np.geomspace(1, len(counts), MAX_MICRO_BATCH_COUNTS)).astype(int) - 1)
        counts = [counts[i] for i in idx]
    return counts


@lru_cache(maxsize=1024)
def _in_flight(pp: int, m: int, schedule: str, chunks: int) -> tuple[int, ...]:
    """Peak (micro-batch, chunk) pairs alive on each device of the schedule."""
    unit = [StageTimes(1.0, 2.0)] * (pp * chunks)
    return simulate_pipeline(unit, m, schedule, chunks).peak_in_flight


class _Config:
    """One (pp, micro-batch count, schedule) configuration: prices strategies and solves stages."""

    def __init__(self, model: ModelSpec, cluster: Cluster, cal: Calibration, seq_len: int, global_batch: int,
                 pp: int, m: int, schedule: str, chunks: int, precision: str, limits: SpaceLimits) -> None:
        self.model, self.cluster, self.cal = model, cluster, cal
        self.seq_len, self.global_batch = seq_len, global_batch
        self.pp, self.m, self.schedule, self.chunks = pp, m, schedule, chunks
        self.precision = precision
        self.prec = PRECISIONS[precision]
        self.n = cluster.world_size // pp
        self.mb = global_batch // m  # sequences per pipeline micro-batch
        self.in_flight = _in_flight(pp, m, schedule, chunks)
        self.blocks = model.distinct_blocks
        self.block_index = {b: i for i, b in enumerate(self.blocks)}
        self.kind_of_layer = tuple(self.block_index[b] for b in model.stack)
        self.priced: list[list[_Priced]] = [
            [self._price(b, s) for s in block_strategies(b, cluster, self.n, self.mb, seq_len, limits)]
            for b in self.blocks]
        self.stage_group = GroupShape.of(tuple(range(self.n)), cluster.gpus_per_node)
        self.hidden_bytes = carried_bytes(model.layers - 1, self.mb, self._context(Strategy()))  # one micro-batch
        self._relayouts: dict[tuple[Layout, Layout], float] = {}
        self.uniform = False  # True: one strategy per stage (what the runtime executes today)
        self._solved: dict[tuple, tuple[float, list[Strategy]] | None] = {}

    @property
    def any_priced(self) -> bool:
        """Whether every layer kind has at least one strategy."""
        return all(self.priced)

    def relayout(self, a: Layout, b: Layout) -> float:
        """Seconds per iteration to re-layout the trunk's hidden state from `a` to `b` (forward and backward,
        every micro-batch); the simulator prices each boundary's own bytes when it judges the plan."""
        if (a, b) not in self._relayouts:
            ctx = self._context(Strategy())
            self._relayouts[a, b] = self.m * sum(relayout_time(a, b, self.hidden_bytes, self.stage_group, ctx))
        return self._relayouts[a, b]

    def restricted(self, layout: Layout) -> _Config:
        """A copy limited to one (dp, tp, cp, sp) layout and one strategy per stage."""
        other = copy.copy(self)
        other.priced = [[p for p in pool if Layout.of(p.strategy) == layout] for pool in self.priced]
        other.uniform = True
        other._solved = {}
        return other

    def layouts(self) -> list[Layout]:
        """Every layout some layer kind may use, sorted."""
        return sorted({Layout.of(p.strategy) for pool in self.priced for p in pool})

    def _context(self, s: Strategy) -> BlockContext:
        ranks = tuple(range(self.n))
        return BlockContext.for_ranks(self.model, self.cluster, self.cal, self.prec, self.seq_len, self.mb // s.dp,
                                      s, ranks, s.degrees.group(ranks, "data"))

    def _price(self, block: Block, s: Strategy) -> _Priced:
        c = price(block, s, self._context(s))
        return _Priced(s, c.micro_batch_s, c.exposed_sync(self.cal.overlap_efficiency), c.states, c.activation,
                       c.working)

    def cheapest(self) -> _Priced:
        """The trunk layer's strategy with the least model-state memory (prices the edges in budgets)."""
        pool = self.priced[self.kind_of_layer[-1]]
        return min(pool, key=lambda p: p.states)

    def budget(self, device: int, capacity: float) -> float:
        """Bytes a device group can give its layers: the usable memory less the embedding/head with their
        buffers (priced with the cheapest-memory strategy)."""
        cheapest = self.cheapest().strategy
        extra = 2 * self.hidden_bytes / self.n  # the pipeline's send and receive buffers
        ctx = self._context(cheapest)
        if device == 0:
            extra += price_edge("embedding", cheapest, ctx).states
        if device == self.pp - 1:
            head = price_edge("head", cheapest, ctx, self.pp > 1)
            extra += head.states + head.working
        return usable_memory(capacity, self.cal) - extra

    def device_layers(self, counts: list[int]) -> list[list[int]]:
        """The model layers of each device group, chunk by chunk (`counts` layers per group; chunks
        interleaved in model order), in the order `assemble` reads their strategies."""
        per_chunk = [split_layers(c, self.chunks) for c in counts]
        out: list[list[int]] = [[] for _ in counts]
        start = 0
        for chunk in range(self.chunks):
            for d in range(self.pp):
                out[d].extend(range(start, start + per_chunk[d][chunk]))
                start += per_chunk[d][chunk]
        return out

    def solve_stage(self, device: int, layers: list[int], budget: float) -> tuple[float, list[Strategy]] | None:
        """Best strategies for the model layers `layers` on device group `device` within `budget` bytes."""
        kinds = tuple(self.kind_of_layer[i] for i in layers)
        key = (device, kinds, device == 0, device == self.pp - 1, round(budget, -6))
        if key in self._solved:
            return self._solved[key]
        result = None
        if layers and budget > 0:
            act_mult = self.in_flight[device] / self.chunks
            # Recomputing a layer needs its full activations for a moment: solve once without
            # recompute strategies on the whole budget and once with all of them on the budget less the
            # largest such transient, and keep the faster.
            present = sorted(set(kinds))
            pools = {k: self.priced[k] for k in present}
            plain = {k: [p for p in pool if p.strategy.recompute == "none"] for k, pool in pools.items()}
            working = max((p.working for pool in pools.values() for p in pool), default=0.0)
            for pool, room in ((plain, budget), (pools, budget - working)):
                sol = self._solve(pool, kinds, room, act_mult)
                if sol is not None and (result is None or sol[0] < result[0]):
                    result = sol
        self._solved[key] = result
        return result

    def _solve(self, pools: dict[int, list[_Priced]], kinds: tuple[int, ...], budget: float, act_mult: float
               ) -> tuple[float, list[Strategy]] | None:
        """The layer DP over the layers `kinds` (each layer's kind index), each kind choosing among its
        strategies on its time/memory Pareto front, within `budget` bytes."""
        if budget <= 0 or any(not pools[k] for k in set(kinds)):
            return None
        costs = {k: [(p.mb_time * self.m + p.sync, p.states + p.activation * act_mult) for p in pool]
                 for k, pool in pools.items()}
        strategies: list[Strategy] = []  # every kept strategy of any kind, in first-seen order
        column: dict[Strategy, int] = {}
        for k, pool in pools.items():
            for i in pareto_front(costs[k]):
                column.setdefault(pool[i].strategy, len(column))
        strategies = list(column)
        unit = budget / MEMORY_UNITS
        rows = {}
        for k, pool in pools.items():
            t = np.full(len(strategies), np.inf)
            mem = np.zeros(len(strategies), dtype=np.int64)
            for p, (seconds, nbytes) in zip(pool, costs[k], strict=True):
                j = column.get(p.strategy)
                if j is not None:
                    t[j], mem[j] = seconds, math.ceil(nbytes / unit)
            rows[k] = (t, mem)
        times = np.stack([rows[k][0] for k in kinds])
        mems = np.stack([rows[k][1] for k in kinds])
        if self.uniform:  # switching strategy inside a stage is forbidden
            trans = np.array([[0.0 if a == b else np.inf for b in strategies] for a in strategies])
        else:
            layouts = [Layout.of(s) for s in strategies]
            trans = np.array([[self.relayout(a, b) for b in layouts] for a in layouts])
        sol = solve_layers(times, mems, trans, MEMORY_UNITS)
        if sol is None:
            return None
        return sol.time, [strategies[i] for i in sol.choice]

    def assemble(self, counts: list[int], choices: list[list[Strategy]]) -> Plan:
        """A Plan from layers per device group and their strategies (chunks interleaved in model order)."""
        per_chunk = [split_layers(c, self.chunks) for c in counts]
        stages = []
        start = 0
        for chunk in range(self.chunks):
            for d in range(self.pp):
                n_layers = per_chunk[d][chunk]
                offset = sum(per_chunk[d][:chunk])
                strategies = tuple(choices[d][offset: offset + n_layers])
                if len(set(strategies)) == 1:
                    strategies = strategies[:1]
                ranks = tuple(range(d * self.n, (d + 1) * self.n))
                stages.append(Stage(layers=(start, start + n_layers), ranks=ranks, strategies=strategies))
                start += n_layers
        return Plan(model=self.model.name, seq_len=self.seq_len, global_batch=self.global_batch,
                    schedule=self.schedule, chunks=self.chunks, precision=self.precision,  # type: ignore[arg-type]
                    pipelines=(Pipeline(stages=tuple(stages), micro_batches=self.m, micro_batch_sequences=self.mb),))


def _memory_balanced(cfg: _Config, capacity: float) -> list[int]:
    """Layers per device group with equal memory use under the cheapest-memory strategy."""
    layers = cfg.model.layers
    cheapest = [min(pool, key=lambda p: p.states + p.activation) for pool in cfg.priced]
    share = np.bincount(cfg.kind_of_layer, minlength=len(cheapest)) / layers  # layers of each kind, a fraction
    per_layer = [sum(f * (c.states + c.activation * cfg.in_flight[d] / cfg.chunks) for f, c in zip(share, cheapest))
                 for d in range(cfg.pp)]
    budgets = [max(cfg.budget(d, capacity), 1.0) for d in range(cfg.pp)]
    weights = np.array([b / w for b, w in zip(budgets, per_layer)])
    raw = weights / weights.sum() * layers
    counts = np.maximum(np.floor(raw).astype(int), cfg.chunks)
    while counts.sum() < layers:
        counts[int(np.argmax(raw - counts))] += 1
    while counts.sum() > layers:
        counts[int(np.argmax(counts))] -= 1
    return [int(c) for c in counts]


def _partition_search(cfg: _Config, capacity: float, evaluate: Callable[[Plan], Candidate]) -> Candidate | None:
    """Galvatron-BMW: memory-balanced start, then layer moves toward time balance; keep the best."""
    layers, pp = cfg.model.layers, cfg.pp
    if layers < pp * cfg.chunks:
        return None
    starts = [_memory_balanced(cfg, capacity), split_layers(layers, pp)]
    best: Candidate | None = None
    seen: set[tuple[int, ...]] = set()

    def attempt(counts: list[int]) -> tuple[Candidate | None, list[float]]:
        budgets = [cfg.budget(d, capacity) for d in range(pp)]
        for _ in range(FIT_RETRIES + 1):
            ids = cfg.device_layers(counts)
            solved = [cfg.solve_stage(d, ids[d], budgets[d]) for d in range(pp)]
            if any(s is None for s in solved):
                return None, []
            plan = cfg.assemble(counts, [s[1] for s in solved])  # type: ignore[index]
            cand = evaluate(plan)
            if cand.report.fits:
                return cand, [s[0] for s in solved]  # type: ignore[index]
            over = [max(0.0, d.memory.total - capacity) for d in cand.report.devices]  # type: ignore[attr-defined]
            budgets = [b - 1.05 * o - 0.01 * capacity if o > 0 else b for b, o in zip(budgets, over)]
        return None, []

    for counts in starts:
        if min(counts) < cfg.chunks or tuple(counts) in seen:
            continue
        seen.add(tuple(counts))
        cand, times = attempt(counts)
        if cand is None:
            continue
        if best is None or cand.key < best.key:
            best = cand
        # Time balancing: move one layer from the slowest stage to its faster neighbour.
        for _ in range(REBALANCE_ROUNDS if pp > 1 else 0):
            slow = int(np.argmax(times))
            neighbours = [d for d in (slow - 1, slow + 1) if 0 <= d < pp]
            target = min(neighbours, key=lambda d: times[d])
            trial = list(counts)
            trial[slow] -= 1
            trial[target] += 1
            if trial[slow] < cfg.chunks or tuple(trial) in seen:
                break
            seen.add(tuple(trial))
            new, new_times = attempt(trial)
            if new is None or not new.key < best.key:  # type: ignore[union-attr]
                break
            best, counts, times = new, trial, new_times
    return best


def _accept(plan: Plan, model: ModelSpec, runnable: bool, record: Callable[[Plan], None] | None) -> bool:
    """Whether the search may price `plan` (and tell `record` it does)."""
    if runnable and unsupported(plan, model) is not None:
        return False
    if record:
        record(plan)
    return True


def search(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int, *,
           precision: str = "bf16", limits: SpaceLimits = DEFAULT_LIMITS, cal: Calibration | None = None,
           include_uniform: bool = True, runnable: bool = False, progress: Progress | None = None,
           record: Callable[[Plan], None] | None = None) -> SearchResult:
    """Search the fastest plan for `model` on `cluster` (see the module docstring). With `runnable`, only
    plans this version's runtime executes (`plait.executable`). `record` sees every plan the search prices."""
    if seq_len <= 0 or global_batch <= 0:  # callers validate; this guards the Python API
        raise PlaitError(f"seq_len and global_batch must be positive, got {seq_len} and {global_batch}")
    cal = cal or calibration_for(cluster.gpu.name)
    t0 = time.perf_counter()
    capacity = cluster.gpu.memory_bytes
    evaluated = 0

    def evaluate(plan: Plan) -> Candidate:
        nonlocal evaluated
        validate_plan(plan, model, cluster)
        evaluated += 1
        if record:
            record(plan)
        return Candidate(plan, simulate(plan, model, cluster, cal=cal, validate=False), "layerwise")

    configs = []
    for pp in divisors(cluster.world_size):
        if pp > model.layers:
            continue
        for m in _micro_batch_counts(global_batch, pp):
            configs.append((pp, m, "1f1b", 1))
            if pp > 1 and m % pp == 0 and 2 * pp <= model.layers:
                configs.append((pp, m, "interleaved", 2))
    best_layerwise: Candidate | None = None
    closest: Candidate | None = None
    for i, (pp, m, schedule, chunks) in enumerate(configs):
        cfg = _Config(model, cluster, cal, seq_len, global_batch, pp, m, schedule, chunks, precision, limits)
        variants = [cfg]
        if runnable and model.tied_embeddings:  # fallbacks whose first and last layers share a layout
            variants += [cfg.restricted(lay) for lay in cfg.layouts()]
        for variant in variants:
            if not variant.any_priced:
                continue
            cand = _partition_search(variant, capacity, evaluate)
            if cand is not None and runnable and unsupported(cand.plan, model):
                continue
            if cand is not None and (best_layerwise is None or cand.key < best_layerwise.key):
                best_layerwise = cand
        if progress:
            progress("layerwise", i + 1, len(configs))
    best_uniform = None
    if include_uniform:
        best_uniform, n = run_baseline("megatron-grid", model, cluster, seq_len, global_batch,
                                       progress=(lambda d, t: progress("uniform", d, t)) if progress else None,
                                       cal=cal, accept=lambda p: _accept(p, model, runnable, record))
        evaluated += n
    fitting = [c for c in (best_layerwise, best_uniform) if c is not None and c.report.fits]
    best = min(fitting, key=lambda c: c.key) if fitting else None
    if best is None:
        pool = [c for c in (best_layerwise, best_uniform) if c is not None]
        closest = min(pool, key=lambda c: c.report.peak_memory_gib) if pool else None
    return SearchResult(plan=best.plan if best else None, report=best.report if best else None,
                        best_uniform=best_uniform, best_layerwise=best_layerwise, evaluated=evaluated,
                        search_time_s=time.perf_counter() - t0, closest=closest)


def fewest_gpus(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int, max_doublings: int = 6
                ) -> int | None:
    """The smallest cluster (doubling the nodes) on which a ZeRO-3 or Megatron layout fits, in GPUs."""
    nodes = cluster.nodes
    for _ in range(max_doublings):
        nodes *= 2
        bigger = Cluster(cluster.name, nodes, cluster.gpus_per_node, cluster.gpu, cluster.intra, cluster.inter)
        for kind in ("zero3", "megatron-grid"):
            best, _ = run_baseline(kind, model, bigger, seq_len, global_batch)
            if best is not None and best.report.fits:
                return bigger.world_size
    return None


__all__ = ["SearchResult", "fewest_gpus", "search"]
