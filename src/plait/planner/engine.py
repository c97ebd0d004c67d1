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

import gc
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache, partial

import numpy as np

from plait.cost.calibration import Calibration, calibration_for
from plait.cost.comm import GroupShape
from plait.cost.layer import BlockContext
from plait.cost.offload import host_optimizer_time
from plait.cost.pipeline import StageTimes, simulate_pipeline
from plait.cost.precision import PRECISIONS
from plait.cost.price import LayerCost, carried_bytes, price, price_edge, relayout_time, usable_memory
from plait.errors import PlaitError
from plait.layout import Layout
from plait.plan import Pipeline, Plan, Stage, Strategy, split_layers, stage_strategies, validate_plan
from plait.planner.background import Background, spare_core
from plait.planner.baselines import Candidate, Judge, run_baseline
from plait.planner.host_budget import within_host
from plait.planner.host_fill import fill_host
from plait.planner.layerwise import solve_layers_pareto
from plait.planner.space import SpaceLimits, block_strategies, divisors, pareto_front
from plait.simulate import Report, finish, price_plan, simulate
from plait.spec.cluster import Cluster
from plait.spec.degrees import Degrees
from plait.spec.layers import Block
from plait.spec.model import ModelSpec

DEFAULT_LIMITS = SpaceLimits()
DP_SLACK = 0.01
"""Fraction of a stage's memory budget the layer DP may leave unused to bound its work: the strategies it
picks are at least as fast as the exact optimum under (1 - DP_SLACK) of the budget, and their summed bytes
never exceed the budget."""
HOST_PROBE_SLACK = 0.2
"""DP_SLACK of the layer DPs that search the price of host memory (`planner.host_budget`): coarser, since the
stage is solved again at the price found with DP_SLACK."""
BOUND_SLACK = 0.05
"""Share of the pooled memory budget the configuration bound's knapsack may merge away (it is solved on the
budget enlarged by that share, so it stays a bound): coarser than DP_SLACK, since it only orders and skips."""
BUDGET_GRAIN = 1e6
"""Bytes a stage budget is floored to before the layer DP, so that nearby budgets share one cached solution
(which fits each of them)."""
MAX_MICRO_BATCH_COUNTS = 6
"""Micro-batch counts tried per pipeline degree (spread geometrically over the useful range)."""
REBALANCE_ROUNDS = 8
"""Layer moves the time-balancing step of the stage partitioner accepts at most, per configuration."""
FIT_RETRIES = 2
"""Times a stage budget is tightened by the simulated overflow when an assembled plan does not fit."""
OVERFLOW_MARGIN = 1.05
"""Multiple of a device's simulated overflow (bytes) taken off its stage budget before re-solving it."""
FIT_MARGIN = 0.01
"""Fraction of the device memory taken off an overflowing stage's budget on top of that."""

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
    host: float = 0.0  # host bytes: offloaded states, and swapped activations per micro-batch in flight
    nvme: float = 0.0  # NVMe bytes: states under offload="nvme"


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


def _block_bytes(p: _Priced, multiple: float) -> float:
    """Bytes of one block priced `p` on a device holding `multiple` micro-batches of its activations."""
    return p.states + p.activation * multiple


def _activation_multiple(cfg: _Config, device: int) -> float:
    """Micro-batches of activations each block on device group `device` holds at the schedule's peak."""
    return cfg.in_flight[device] / cfg.chunks


class _Config:
    """One (pp, micro-batch count, schedule) configuration: prices strategies and solves stages."""

    def __init__(self, model: ModelSpec, cluster: Cluster, cal: Calibration, seq_len: int, global_batch: int,
                 pp: int, m: int, schedule: str, chunks: int, precision: str, limits: SpaceLimits,
                 expert_load: float = 1.0) -> None:
        self.model, self.cluster, self.cal = model, cluster, cal
        self.seq_len, self.global_batch = seq_len, global_batch
        self.pp, self.m, self.schedule, self.chunks = pp, m, schedule, chunks
        self.precision = precision
        self.expert_load = expert_load
        self.prec = PRECISIONS[precision]
        self.n = cluster.world_size // pp
        self.mb = global_batch // m  # sequences per pipeline micro-batch
        self.in_flight = _in_flight(pp, m, schedule, chunks)
        self.blocks = model.distinct_blocks
        self.block_index = {b: i for i, b in enumerate(self.blocks)}
        self.kind_of_layer = tuple(self.block_index[b] for b in model.stack)
        self._contexts: dict[Degrees, BlockContext] = {}
        self.priced: list[list[_Priced]] = [self._pool(b, limits) for b in self.blocks]
        self.stage_group = GroupShape.of(tuple(range(self.n)), cluster.gpus_per_node)
        self.hidden_bytes = carried_bytes(model.layers - 1, self.mb, self._context(Strategy()))  # one micro-batch
        self._relayouts: dict[tuple[Layout, Layout], float] = {}
        self.uniform = False  # True: one strategy per stage (what the runtime executes today)
        self._solved: dict[tuple, tuple[float, list[Strategy]] | None] = {}
        self._host_price: dict[int, float] = {}  # device group -> seconds per host byte its last priced stage
        # fitted at
        self._fronts: dict[tuple[int, int, float], list[_Priced]] = {}  # see _undominated

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

    def _context(self, s: Strategy) -> BlockContext:
        """The run as a layer of strategy `s` sees it; one object for every strategy of the same degrees."""
        d = s.degrees
        ctx = self._contexts.get(d)
        if ctx is None:
            ranks = tuple(range(self.n))
            ctx = self._contexts[d] = BlockContext.for_ranks(
                self.model, self.cluster, self.cal, self.prec, self.seq_len, self.mb // s.dp, s, ranks,
                d.group(ranks, "data"), self.expert_load)
        return ctx

    def _price(self, block: Block, s: Strategy) -> _Priced:
        """`block` under `s`; an offloaded layer's share of the host CPU's optimizer step counts with its
        gradient synchronisation (the simulator runs that step beside the device's, over all such layers)."""
        c = price(block, s, self._context(s))
        host_step = host_optimizer_time(c.updated, self.cluster, c.nvme) if s.offload != "none" else 0.0
        return _Priced(s, c.micro_batch_s, c.exposed_sync(self.cal.overlap_efficiency) + host_step, c.states,
                       c.activation, c.working, c.host + c.swapped * max(self.in_flight) / self.chunks, c.nvme)

    def _pool(self, block: Block, limits: SpaceLimits) -> list[_Priced]:
        """`block`'s strategies, priced, whose host and NVMe bytes a node can hold (host memory: for one layer
        a device; the stage's layers share it in `_solve`); paging from NVMe only where paging the same layout
        from host memory fits every layer a device may get (NVMe is slower, with the same device memory)."""
        pool: list[_Priced] = []
        hosted: set[Strategy] = set()  # host-paged strategies every layer can take: NVMe twins not priced
        for s in block_strategies(block, self.cluster, self.n, self.mb, self.seq_len, limits):
            if s.offload == "nvme" and s.model_copy(update={"offload": "params"}) in hosted:
                continue
            if self._host_fits(p := self._price(block, s), 1):
                pool.append(p)
                if s.offload == "params" and self._host_fits(p, self._most_layers):
                    hosted.add(s)
        return pool

    @property
    def _most_layers(self) -> int:
        """The most layers a device may get: its even share plus one."""
        return -(-self.model.layers // self.pp) + 1

    def _host_fits(self, p: _Priced, layers: int) -> bool:
        """Whether a node's host memory holds `p`'s host bytes for `layers` layers on every device of the node,
        and its NVMe the NVMe bytes of the most layers a device may get (the simulator checks the assembled
        plan's own)."""
        if p.host == 0 and p.nvme == 0:
            return True
        side, gpn = self.cluster.host_side, self.cluster.gpus_per_node
        return layers * gpn * p.host <= side.memory_bytes and self._most_layers * gpn * p.nvme <= side.nvme_bytes

    def lower_bound_s(self) -> float:
        """Seconds every plan of this configuration takes at least: its layers at their fastest strategies
        (memory aside), C seconds per micro-batch in all, cut into stages in the best way. With stage times
        c_d a device's last backward ends no earlier than sum(c_j, j < d) + m c_d; a weighted mean of these
        over the devices bounds the largest by C / (1 - (1 - 1/m)^pp) for any cut (interleaved: m C / pp,
        and C). 0 where stages may price differently (ranks not aligned to nodes, slowed devices) or
        CPU ranks share cores."""
        if not self._bounded:
            return 0.0
        fastest = [min((p.mb_time for p in pool), default=math.inf) for pool in self.priced]
        return self._pipelined(sum(fastest[k] for k in self.kind_of_layer))

    def fitting_bound_s(self, capacity: float) -> float:
        """`lower_bound_s` with each layer's strategy chosen to fit memory: the least summed seconds per
        micro-batch of strategies whose bytes (at the smallest activation multiple of any device) fit the
        device groups' budgets pooled, a relaxation of what every stage's layer DP must fit (never below
        `lower_bound_s`)."""
        if not self._bounded:
            return 0.0
        least = self._pooled_least(capacity, lambda p: p.mb_time)
        return math.inf if least is None else max(self._pipelined(least), self.lower_bound_s())

    def host_holds(self, capacity: float) -> bool:
        """Whether the least host memory its layers can take while fitting the device groups' budgets pooled
        (the relaxation of `fitting_bound_s`) is within the devices' shares of host memory pooled: where it
        is not, no plan of this configuration fits the host."""
        if not any(p.host for pool in self.priced for p in pool):
            return True
        least = self._pooled_least(capacity, lambda p: p.host)
        side = self.cluster.host_side
        return least is not None and least <= self.pp * side.memory_bytes / self.cluster.gpus_per_node

    def _pooled_least(self, capacity: float, value: Callable[[_Priced], float]) -> float | None:
        """The least summed `value` of the layers' strategies whose bytes (at the smallest activation multiple
        of any device) fit the device groups' budgets pooled; None when none fit. Solved with BOUND_SLACK on
        the budget enlarged by that share, so the answer is at most the exact least under the pooled budget."""
        multiple = min(_activation_multiple(self, d) for d in range(self.pp))
        pooled = sum(self.budget(d, capacity) for d in range(self.pp))
        if pooled <= 0:
            return None
        pools = dict(enumerate(self.priced))
        costs = {k: [(value(p), _block_bytes(p, multiple)) for p in pool] for k, pool in pools.items()}
        strategies, values, nbytes = _cost_rows(pools, costs, {k: range(len(c)) for k, c in costs.items()},
                                                self.kind_of_layer)
        free = np.zeros((len(strategies), len(strategies)))
        sol = solve_layers_pareto(values, nbytes, free, pooled / (1 - BOUND_SLACK), slack=BOUND_SLACK)
        return None if sol is None else sol.time

    @property
    def _bounded(self) -> bool:
        """Whether the bounds hold: stages priced alike (ranks aligned to nodes, no slowed devices) and
        CPU ranks not sharing cores."""
        gpn = self.cluster.gpus_per_node
        return self.cal.measured is None and not self.cluster.speed and not (self.n % gpn and gpn % self.n)

    def _pipelined(self, total: float) -> float:
        """Seconds an iteration takes at least with `total` seconds of layers per micro-batch (see
        `lower_bound_s`)."""
        if self.chunks == 1:
            return total / (1 - (1 - 1 / self.m) ** self.pp)
        return max(total, self.m * total / self.pp)

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
            head = self.head()
            extra += head.states + head.working
        return usable_memory(capacity, self.cal) - extra

    def head(self) -> LayerCost:
        """The head with its loss, priced with the cheapest-memory strategy (as in budgets)."""
        cheapest = self.cheapest().strategy
        return price_edge("head", cheapest, self._context(cheapest), self.pp > 1)

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
        budget = math.floor(budget / BUDGET_GRAIN) * BUDGET_GRAIN  # a cached solution fits all it serves
        kinds = tuple(self.kind_of_layer[i] for i in layers)
        key = (device, kinds, device == 0, device == self.pp - 1, budget)
        if key in self._solved:
            return self._solved[key]
        result = None
        if layers and budget > 0:
            act_mult = _activation_multiple(self, device)
            # Recomputing a layer needs its full activations for a moment: solve once without
            # recompute strategies on the whole budget and once with all of them on the budget less the
            # largest such transient, and keep the faster.
            present = sorted(set(kinds))
            pools = {k: self.priced[k] for k in present}
            working = max((p.working for pool in pools.values() for p in pool), default=0.0)
            # the budget keeps room for the loss's logits; a recomputed layer's transient comes at another
            # moment, so only what it needs beyond them is taken off (the simulator counts the larger)
            logits = self.head().working if device == self.pp - 1 else 0.0
            # (recompute modules keep no transient of note: they are with the plain strategies)
            plain = {k: [p for p in pool if p.strategy.recompute == "none"] for k, pool in pools.items()}
            for pool, room in ((plain, budget), (pools, budget + logits - max(working, logits))):
                sol = self._solve(device, pool, kinds, room, act_mult)
                if sol is not None and (result is None or sol[0] < result[0]):
                    result = sol
        self._solved[key] = result
        return result

    def _solve(self, device: int, pools: dict[int, list[_Priced]], kinds: tuple[int, ...], budget: float,
               act_mult: float) -> tuple[float, list[Strategy]] | None:
        """The layer DP over the layers `kinds` (each layer's kind index) of device group `device`, each kind
        choosing among its strategies on its time/memory Pareto front, within `budget` bytes of device memory
        and the device's share of its node's host memory (`planner.host_budget`)."""
        if budget <= 0 or any(not pools[k] for k in set(kinds)):
            return None
        if any(p.host for pool in pools.values() for p in pool):
            pools = {k: self._undominated(k, pool, act_mult) for k, pool in pools.items()}
        hosts = {(k, p.strategy): p.host for k, pool in pools.items() for p in pool}
        if not any(hosts.values()):
            return self._solve_at(pools, kinds, budget, act_mult, 0.0)
        side, gpn = self.cluster.host_side, self.cluster.gpus_per_node

        def host_bytes(strategies: list[Strategy]) -> float:
            edges = self._edge_host("embedding", strategies[0]) if device == 0 else 0.0
            if device == self.pp - 1:
                edges += self._edge_host("head", strategies[-1])
            return edges + sum(hosts[k, s] for k, s in zip(kinds, strategies, strict=True))

        # the price to start from: the one this device's last priced stage fitted at, or one at which a layer's
        # host bytes cost as much as the slowest layer
        slowest = max(p.mb_time * self.m + p.sync for pool in pools.values() for p in pool)
        price = self._host_price.get(device) or slowest / max(hosts.values())
        solve = partial(self._solve_at, pools, kinds, budget, act_mult)
        share = side.memory_bytes / gpn
        found = within_host(solve, partial(solve, slack=HOST_PROBE_SLACK, relayouts=False), host_bytes, share,
                            price)
        if found is None:
            return None
        answer, at = found
        if not at:  # it fitted unpriced
            return answer
        self._host_price[device] = at
        fine = solve(at, relayouts=False)  # the price found, at the layer DP's own slack
        return fine if fine is not None and host_bytes(fine[1]) <= share and fine[0] < answer[0] else answer

    def _undominated(self, kind: int, pool: list[_Priced], act_mult: float) -> list[_Priced]:
        """The strategies of `pool` (of layer kind `kind`) that no other beats on seconds a step, device bytes
        and host bytes at once: whatever a host byte costs, the layer DP's front is among them."""
        key = (kind, len(pool), act_mult)
        if key not in self._fronts:
            cost = np.array([(p.mb_time * self.m + p.sync, _block_bytes(p, act_mult), p.host) for p in pool])
            order = np.lexsort((cost[:, 2], cost[:, 1], cost[:, 0]))
            kept: list[int] = []
            for i in order:  # a point is dominated only by one sorted before it
                if not kept or not np.any(np.all(cost[kept] <= cost[i], axis=1)):
                    kept.append(int(i))
            self._fronts[key] = [pool[i] for i in sorted(kept)]
        return self._fronts[key]

    def _edge_host(self, edge: str, s: Strategy) -> float:
        """Host bytes of the embedding or the head on a device when its stage's edge layer takes `s`."""
        return price_edge(edge, s, self._context(s), edge == "head" and self.pp > 1).host  # type: ignore[arg-type]

    def _solve_at(self, pools: dict[int, list[_Priced]], kinds: tuple[int, ...], budget: float, act_mult: float,
                  per_host_byte: float, slack: float = DP_SLACK, relayouts: bool = True
                  ) -> tuple[float, list[Strategy]] | None:
        """The layer DP with each host byte priced at `per_host_byte` seconds: the stage's seconds (without that
        price) and its strategies, or None when nothing fits `budget` bytes (`slack`: see DP_SLACK; without
        `relayouts`, the DP switches layouts for free: faster, and its answer's seconds count the switches it
        makes)."""
        costs = {k: [(p.mb_time * self.m + p.sync + per_host_byte * p.host, _block_bytes(p, act_mult))
                      for p in pool] for k, pool in pools.items()}
        strategies, times, mems = _cost_rows(pools, costs, {k: pareto_front(c) for k, c in costs.items()}, kinds)
        if self.uniform:  # switching strategy inside a stage is forbidden
            trans = np.array([[0.0 if a == b else np.inf for b in strategies] for a in strategies])
        elif not relayouts:
            trans = np.zeros((len(strategies), len(strategies)))
        else:  # priced once per pair of distinct layouts
            index: dict[Layout, int] = {}
            of = np.array([index.setdefault(Layout.of(s), len(index)) for s in strategies])
            distinct = list(index)
            trans = np.array([[self.relayout(a, b) for b in distinct] for a in distinct])[of][:, of]
        sol = solve_layers_pareto(times, mems, trans, budget, slack=slack)
        if sol is None:
            return None
        chosen = [strategies[i] for i in sol.choice]
        seconds = sol.time
        if per_host_byte:
            hosts = {(k, p.strategy): p.host for k, pool in pools.items() for p in pool}
            seconds -= per_host_byte * sum(hosts[k, s] for k, s in zip(kinds, chosen, strict=True))
        if not relayouts:
            seconds += sum(self.relayout(Layout.of(a), Layout.of(b)) for a, b in itertools.pairwise(chosen)
                           if Layout.of(a) != Layout.of(b))
        return seconds, chosen

    def assemble(self, counts: list[int], choices: list[list[Strategy]]) -> Plan:
        """A Plan from layers per device group and their strategies (chunks interleaved in model order)."""
        per_chunk = [split_layers(c, self.chunks) for c in counts]
        stages = []
        start = 0
        for chunk in range(self.chunks):
            for d in range(self.pp):
                n_layers = per_chunk[d][chunk]
                offset = sum(per_chunk[d][:chunk])
                strategies = stage_strategies(choices[d][offset: offset + n_layers])
                ranks = tuple(range(d * self.n, (d + 1) * self.n))
                stages.append(Stage(layers=(start, start + n_layers), ranks=ranks, strategies=strategies))
                start += n_layers
        return Plan(model=self.model.name, seq_len=self.seq_len, global_batch=self.global_batch,
                    schedule=self.schedule, chunks=self.chunks, precision=self.precision,  # type: ignore[arg-type]
                    expert_load=self.expert_load,
                    pipelines=(Pipeline(stages=tuple(stages), micro_batches=self.m, micro_batch_sequences=self.mb),)
                    ).with_runtime_p2p()


def _cost_rows(pools: dict[int, list[_Priced]], costs: dict[int, list[tuple[float, float]]],
               keep: dict[int, Iterable[int]], kinds: Sequence[int]
               ) -> tuple[list[Strategy], np.ndarray, np.ndarray]:
    """The layer DP's columns and rows: the strategies `keep` names of any kind (indices into its pool, first
    seen first), and for each layer of `kinds` the (seconds, bytes) of its kind's `costs` in those columns
    (inf seconds where its kind has no such strategy)."""
    column: dict[Strategy, int] = {}
    for k, pool in pools.items():
        for i in keep[k]:
            column.setdefault(pool[i].strategy, len(column))
    rows = {}
    for k, pool in pools.items():
        t, mem = np.full(len(column), np.inf), np.zeros(len(column))
        for p, (seconds, nbytes) in zip(pool, costs[k], strict=True):
            if (j := column.get(p.strategy)) is not None:
                t[j], mem[j] = seconds, nbytes
        rows[k] = (t, mem)
    return list(column), np.stack([rows[k][0] for k in kinds]), np.stack([rows[k][1] for k in kinds])


def _least_layer_bytes(cfg: _Config, device: int) -> float:
    """Bytes a layer needs on device group `device` with its least-memory strategy, averaged over the
    model's layers (each kind counted as often as it occurs)."""
    multiple = _activation_multiple(cfg, device)
    least = [min(_block_bytes(p, multiple) for p in pool) for pool in cfg.priced]
    return sum(least[k] for k in cfg.kind_of_layer) / len(cfg.kind_of_layer)


def _stage_bytes(cfg: _Config, device: int, layers: list[int], strategies: list[Strategy]) -> float:
    """Bytes the layer DP counts for the model layers `layers` with `strategies` on device group `device`."""
    multiple = _activation_multiple(cfg, device)
    priced = [{p.strategy: p for p in pool} for pool in cfg.priced]
    return sum(_block_bytes(priced[cfg.kind_of_layer[i]][s], multiple) for i, s in zip(layers, strategies,
                                                                                      strict=True))


def _memory_balanced(cfg: _Config, capacity: float) -> list[int]:
    """Layers per device group that minimise the largest device memory when every block takes its device's
    least-memory strategy. A device holds what its budget leaves out (embedding, head, buffers) plus its
    blocks, whose activations grow with the micro-batches in flight there. Greedy: each layer goes to the
    device it leaves with the least memory, which is optimal for this min-max."""
    fixed = np.array([-cfg.budget(d, capacity) for d in range(cfg.pp)])  # bytes, up to a shared constant
    per_layer = np.array([_least_layer_bytes(cfg, d) for d in range(cfg.pp)])
    counts = np.full(cfg.pp, cfg.chunks)
    for _ in range(cfg.model.layers - int(counts.sum())):
        counts[int(np.argmin(fixed + (counts + 1) * per_layer))] += 1
    return [int(c) for c in counts]


def _retry_budget(cfg: _Config, device: int, budget: float, layers: list[int], strategies: list[Strategy],
                  over: float, capacity: float) -> float:
    """Stage budget (bytes) for the next try after the simulator put device group `device` `over` bytes
    above `capacity`: the budget less the overflow and a margin, and less than what the stage's blocks used
    (the DP may have left room), so that the DP picks leaner strategies."""
    if over <= 0:
        return budget
    return min(budget - OVERFLOW_MARGIN * over - FIT_MARGIN * capacity,
               _stage_bytes(cfg, device, layers, strategies) - BUDGET_GRAIN)


def _fit(cfg: _Config, capacity: float, counts: list[int], judge: Judge, bar: float = math.inf
         ) -> tuple[Candidate, list[float]] | None:
    """The simulated plan with `counts` layers per device group and the DP's strategies, with the DP's stage
    times (seconds); an overflowing device's stage is re-solved on a smaller budget (FIT_RETRIES times at
    most). None when no stage solution or no plan fits, or the plan that fits cannot beat `bar` seconds."""
    budgets = [cfg.budget(d, capacity) for d in range(cfg.pp)]
    ids = cfg.device_layers(counts)
    for _ in range(FIT_RETRIES + 1):
        solved = [cfg.solve_stage(d, ids[d], budgets[d]) for d in range(cfg.pp)]
        if any(s is None for s in solved):
            return None
        choices = [s[1] for s in solved]  # type: ignore[index]
        cand = judge(cfg.assemble(counts, choices), bar)
        if cand is None:
            return None
        if cand.report.fits:
            return cand, [s[0] for s in solved]  # type: ignore[index]
        budgets = [_retry_budget(cfg, d, budgets[d], ids[d], choices[d], device.memory.total - capacity, capacity)
                   for d, device in enumerate(cand.report.devices)]
    return None


def _time_balancing_moves(counts: list[int], times: list[float], chunks: int) -> list[list[int]]:
    """Partitions to try next: `counts` with layers moved from the slowest stage (by DP stage time, seconds)
    to its faster neighbour, first as many as would even out their times at their present seconds per layer,
    then half as many, down to one; none that would leave the slowest stage fewer than `chunks` layers."""
    slow = int(np.argmax(times))
    neighbours = [d for d in (slow - 1, slow + 1) if 0 <= d < len(counts)]
    target = min(neighbours, key=lambda d: times[d])
    per_layer = times[slow] / counts[slow] + times[target] / counts[target]
    layers = min(max(1, round((times[slow] - times[target]) / per_layer)), counts[slow] - chunks)
    trials = []
    while layers >= 1:
        trial = list(counts)
        trial[slow] -= layers
        trial[target] += layers
        trials.append(trial)
        layers //= 2
    return trials


_Partition = tuple[Candidate, list[float], list[int]]
"""A fitting plan, its DP stage times (seconds) and its layers per device group."""


def _best_start(cfg: _Config, capacity: float, judge: Judge, seen: set[tuple[int, ...]]) -> _Partition | None:
    """The faster plan of the memory-balanced start and the even split (None if neither fits); both join
    `seen`."""
    best: _Partition | None = None
    for counts in (_memory_balanced(cfg, capacity), split_layers(cfg.model.layers, cfg.pp)):
        if min(counts) < cfg.chunks or tuple(counts) in seen:
            continue
        seen.add(tuple(counts))
        bar = best[0].report.iteration_time_s if best is not None else math.inf
        fitted = _fit(cfg, capacity, counts, judge, bar)
        if fitted is not None and (best is None or fitted[0].key < best[0].key):
            best = (*fitted, counts)
    return best


def _improving_move(cfg: _Config, capacity: float, judge: Judge, current: _Partition,
                    seen: set[tuple[int, ...]]) -> _Partition | None:
    """The first time-balancing move from `current` not in `seen` whose plan beats current's (None if none);
    every partition tried goes in `seen`."""
    best, times, counts = current
    for trial in _time_balancing_moves(counts, times, cfg.chunks):
        if tuple(trial) in seen:
            continue
        seen.add(tuple(trial))
        fitted = _fit(cfg, capacity, trial, judge, best.report.iteration_time_s)
        if fitted is not None and fitted[0].key < best.key:
            return (*fitted, trial)
    return None


def _partition_search(cfg: _Config, capacity: float, judge: Judge) -> Candidate | None:
    """Galvatron-BMW: the faster of a memory-balanced start and the even split, then layer moves toward time
    balance while the simulated iteration improves (REBALANCE_ROUNDS moves at most); the best plan seen."""
    if cfg.model.layers < cfg.pp * cfg.chunks:
        return None
    seen: set[tuple[int, ...]] = set()
    current = _best_start(cfg, capacity, judge, seen)
    if current is None:
        return None
    for _ in range(REBALANCE_ROUNDS if cfg.pp > 1 else 0):
        moved = _improving_move(cfg, capacity, judge, current, seen)
        if moved is None:
            break
        current = moved
    return current[0]


def _allowed(plan: Plan, restrict: Callable[[Plan], bool] | None) -> bool:
    """Whether the search may return `plan`: one that `restrict` accepts."""
    return restrict is None or restrict(plan)


def _accept(plan: Plan, restrict: Callable[[Plan], bool] | None, record: Callable[[Plan], None] | None) -> bool:
    """Whether the search may price `plan` (and tell `record` it does)."""
    if not _allowed(plan, restrict):
        return False
    if record:
        record(plan)
    return True


def search(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int, *,
           precision: str = "bf16", limits: SpaceLimits = DEFAULT_LIMITS, cal: Calibration | None = None,
           include_uniform: bool = True, progress: Progress | None = None,
           record: Callable[[Plan], None] | None = None, expert_load: float = 1.0,
           restrict: Callable[[Plan], bool] | None = None) -> SearchResult:
    """Search the fastest plan for `model` on `cluster` (see the module docstring); with `restrict`, only
    plans it accepts (give
    `limits` whose layer strategies it accepts, e.g. `plait.galvatron.galvatron_limits`, so that the layer
    DP searches among them). `record` sees every plan the search prices."""
    with _collector_paused():
        return _search(model, cluster, seq_len, global_batch, precision=precision, limits=limits, cal=cal,
                       include_uniform=include_uniform, progress=progress, record=record, expert_load=expert_load,
                       restrict=restrict)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """CPython's cyclic garbage collector paused: a search allocates millions of short-lived objects that form
    no cycles to speak of (a few hundred are left for the next collection), while its caches hold some 10^5
    that each full collection would trace again (5-15% of a search's time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _search(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int, *, precision: str,
            limits: SpaceLimits, cal: Calibration | None, include_uniform: bool, progress: Progress | None,
            record: Callable[[Plan], None] | None, expert_load: float, restrict: Callable[[Plan], bool] | None
            ) -> SearchResult:
    """`search` with the collector paused."""
    if seq_len <= 0 or global_batch <= 0:  # callers validate; this guards the Python API
        raise PlaitError(f"seq_len and global_batch must be positive, got {seq_len} and {global_batch}")
    cal = cal or calibration_for(cluster.gpu.name)
    t0 = time.perf_counter()
    evaluated = 0

    def judge(plan: Plan, bar: float) -> Candidate | None:
        nonlocal evaluated
        validate_plan(plan, model, cluster)
        evaluated += 1
        if record:
            record(plan)
        priced = price_plan(plan, model, cluster, cal, validate=False)
        if priced.fits and priced.lower_bound_s() >= bar:
            return None
        return Candidate(plan, finish(priced, detail=False), "layerwise")

    # The uniform grid shares nothing with the layer-wise search but its inputs: it runs beside it on another
    # core, unless `record` must see its plans (then after it, here, with its progress shown).
    grid = partial(run_baseline, "megatron-grid", model, cluster, seq_len, global_batch, cal=cal,
                   accept=lambda p: _accept(p, restrict, record), expert_load=expert_load)
    uniform = Background(grid) if include_uniform and record is None and spare_core() else None
    try:
        best_layerwise = _layerwise(model, cluster, seq_len, global_batch, precision, limits, cal, expert_load,
                                    judge, restrict, progress)
    except BaseException:
        if uniform is not None:
            uniform.cancel()
        raise
    closest: Candidate | None = None
    best_uniform = None
    if uniform is not None:
        best_uniform, n = uniform.result()
        evaluated += n
        if progress:
            progress("uniform", n, n)
    elif include_uniform:
        best_uniform, n = grid(progress=(lambda d, t: progress("uniform", d, t)) if progress else None)
        evaluated += n
    if best_layerwise is not None:  # the report with its p2p time apart from the bubble
        best_layerwise = replace(best_layerwise, report=simulate(best_layerwise.plan, model, cluster, cal=cal,
                                                                 validate=False))
    fitting = [c for c in (best_layerwise, best_uniform) if c is not None and c.report.fits]
    winner = min(fitting, key=lambda c: c.key) if fitting else None
    if winner is None:
        pool = [c for c in (best_layerwise, best_uniform) if c is not None]
        closest = min(pool, key=lambda c: c.report.peak_memory_gib) if pool else None
    return SearchResult(plan=winner.plan if winner else None, report=winner.report if winner else None,
                        best_uniform=best_uniform, best_layerwise=best_layerwise, evaluated=evaluated,
                        search_time_s=time.perf_counter() - t0, closest=closest)


def _layerwise(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int, precision: str,
               limits: SpaceLimits, cal: Calibration, expert_load: float,
               judge: Callable[[Plan, float], Candidate | None], restrict: Callable[[Plan], bool] | None,
               progress: Progress | None) -> Candidate | None:
    """The best plan of the layer-wise search over every (pp, micro-batch count, schedule) configuration, each
    assembled plan judged by `judge` (None when no configuration gives one)."""
    capacity = cluster.gpu.memory_bytes
    configs = []
    for pp in divisors(cluster.world_size):
        if pp > model.layers:
            continue
        for m in _micro_batch_counts(global_batch, pp):
            configs.append((pp, m, "1f1b", 1))
            if limits.interleaved and pp > 1 and m % pp == 0 and 2 * pp <= model.layers:
                configs.append((pp, m, "interleaved", 2))
    cfgs = [_Config(model, cluster, cal, seq_len, global_batch, pp, m, schedule, chunks, precision, limits,
                    expert_load) for pp, m, schedule, chunks in configs]
    bounds = [cfg.fitting_bound_s(capacity) if cfg.any_priced else math.inf for cfg in cfgs]
    # Configurations in order of their lower bound; one whose bound exceeds the fastest plan found cannot
    # give the result. Ties between equally fast plans go to the earlier configuration, as in plain order.
    best: tuple[tuple[bool, float], int, Candidate] | None = None
    for done, i in enumerate(sorted(range(len(cfgs)), key=lambda i: (bounds[i], i)), start=1):
        cfg = cfgs[i]
        if best is None or not best[2].report.fits or bounds[i] <= best[2].report.iteration_time_s:
            cand = _partition_search(cfg, capacity, judge) if cfg.any_priced and cfg.host_holds(capacity) \
                else None
            if cand is not None:  # NVMe layers that the nodes' host memory can take after all
                cand = fill_host(cand, judge)
            if cand is not None and _allowed(cand.plan, restrict) and \
                    (best is None or (cand.key, i) < best[:2]):
                best = (cand.key, i, cand)
        if progress:
            progress("layerwise", done, len(configs))
    return best[2] if best is not None else None


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
