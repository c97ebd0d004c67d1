"""Baseline planners: pure data parallel, ZeRO-3/FSDP only, and the best uniform Megatron-style grid.

Each baseline enumerates uniform `--strategy` layouts and lets the simulator judge them; the best plan
that fits wins (or, if none fits, the one closest to fitting).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import product
from dataclasses import dataclass

from plait.cost.calibration import Calibration, calibration_for
from plait.errors import PlaitError
from plait.plan import Plan, Strategy, strategy_problem, uniform_plan
from plait.planner.space import divisors, expert_layouts
from plait.simulate import Floor, PricedPlan, Report, finish, plan_floor, price_plan
from plait.spec.cluster import Cluster
from plait.spec.model import ModelSpec

BASELINES = ("dp", "zero3", "megatron-grid")
Progress = Callable[[int, int], None]  # (done, total)
PROGRESS_EVERY = 64
"""Layouts between two progress reports of a baseline."""


@dataclass(frozen=True)
class Candidate:
    """A simulated plan."""

    plan: Plan
    report: Report
    label: str

    @property
    def key(self) -> tuple[bool, float]:
        """Sort key: fitting plans first, then faster (or, among non-fitting ones, smaller)."""
        if self.report.fits:
            return (False, self.report.iteration_time_s)
        return (True, self.report.peak_memory_gib)


Judge = Callable[[Plan, float], "Candidate | None"]
"""Simulates a plan, or returns None when it fits and cannot take less than the given seconds."""


def micro_batch_sizes(global_batch: int, dp: int, limit: int = 64) -> list[int]:
    """Micro-batch sizes (sequences per replica) that split the global batch evenly over dp replicas."""
    if global_batch % dp:
        return []
    per_replica = global_batch // dp
    return [b for b in divisors(per_replica) if b <= limit]


def _splits_every_layer(model: ModelSpec, tp: int, sp: bool, seq_len: int) -> bool:
    """Whether tensor parallelism of degree `tp` (with sequence parallelism `sp`) runs every layer kind."""
    s = Strategy(tp=tp, sp=sp)
    return all(strategy_problem(s, b, tp, 1, seq_len) is None for b in model.distinct_blocks)


def _sp_choices(model: ModelSpec, tp: int, seq_len: int) -> tuple[int, ...]:
    """Sequence-parallel settings (0, 1) that tensor parallelism of degree `tp` runs every layer kind with
    (MoE layers need sp with tp > 1; sp means nothing without tp); empty when neither does."""
    return tuple(sp for sp in ((0, 1) if tp > 1 else (0,)) if _splits_every_layer(model, tp, bool(sp), seq_len))


def _expert_layouts(model: ModelSpec, devices: int, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs valid for every MoE layer of `model` on a stage of `devices` ranks ((1, 0) without)."""
    pools = [[(ep, etp) for ep, etp, _ in expert_layouts(b, devices, tp)]  # default limits: plain all-to-all
             for b in model.distinct_blocks if b.kind == "moe"]
    return [x for x in pools[0] if all(x in pool for pool in pools[1:])] if pools else [(1, 0)]


def grid_layouts(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int,
                 kind: str = "megatron-grid", expert_load: float = 1.0) -> Iterator[list[str]]:
    """Groups of uniform layouts (as --strategy text); within a group only the micro-batch size grows, so
    once one does not fit the rest of the group can be skipped. MoE models get every expert layout (ep,
    etp) the megatron grid's stages allow."""
    n = cluster.world_size
    if kind == "dp":
        shapes = [(1, 1, ("none", "selective", "full"), (0,))]
    elif kind == "zero3":
        shapes = [(1, 1, ("none", "selective", "full"), (3,))]
    elif kind == "megatron-grid":
        shapes = [(tp, pp, ("none", "selective", "full"), (0, 1))
                  for tp in divisors(min(n, cluster.gpus_per_node))
                  if _sp_choices(model, tp, seq_len)
                  for pp in divisors(n // tp) if pp <= model.layers]
    else:
        raise PlaitError(f"unknown baseline {kind!r}; choose one of {', '.join(BASELINES)}")
    for tp, pp, recomputes, zeros in shapes:
        dp = n // (tp * pp)
        experts = _expert_layouts(model, n // pp, tp) if kind == "megatron-grid" else [(1, 0)]
        for recompute in recomputes:
            for zero in zeros:
                if zero and dp == 1:
                    continue
                for (sp, vpp), (ep, etp) in product(product(
                        _sp_choices(model, tp, seq_len), (1, 2, 4) if pp > 1 else (1,)), experts):
                    if pp * vpp > model.layers:
                        continue
                    group = []
                    for mbs in micro_batch_sizes(global_batch, dp):
                        m = global_batch // (mbs * dp)
                        if (vpp > 1 and m % pp) or m < pp:  # a pipeline needs a micro-batch per stage
                            continue
                        moe = f",ep={ep},etp={etp},expert_load={expert_load:g}" if model.has_experts else ""
                        group.append(f"tp={tp},pp={pp},dp={dp},mbs={mbs},gbs={global_batch},"
                                     f"recompute={recompute},sp={sp},zero={zero},vpp={vpp}{moe}")
                    if group:
                        yield group


def run_baseline(kind: str, model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int,
                 progress: Progress | None = None, cal: Calibration | None = None,
                 accept: Callable[[Plan], bool] | None = None, expert_load: float = 1.0
                 ) -> tuple[Candidate | None, int]:
    """The best plan of a baseline (among those `accept` allows; it sees every layout) and the number of
    plans priced.

    Layouts are priced (stage costs and memory) in order of their time floor (`plan_floor`, far cheaper
    than pricing), skipping those whose memory floor cannot fit, and simulated when they fit and their
    lower bound can still win, until the floor passes the fastest simulated; this finds the plan a full
    enumeration would (ties go to the earlier layout). When nothing fits, the one of least peak memory is
    returned (a layout whose memory floor is above the least peak found is not priced)."""
    cal = cal or calibration_for(cluster.gpu.name)
    capacity = cluster.gpu.memory_bytes
    layouts: list[tuple[Floor, int, Plan, str]] = []  # (floor, enumeration order, plan, text)
    for group in grid_layouts(model, cluster, seq_len, global_batch, kind, expert_load):
        for text in group:
            plan = uniform_plan(text, model, cluster, seq_len, validate=False)  # valid by construction
            if accept is not None and not accept(plan):
                break
            floor = plan_floor(plan, model, cluster, cal)
            layouts.append((floor, len(layouts), plan, text))
            if floor.peak_bytes > capacity:
                break  # larger micro-batches need more memory
    layouts.sort(key=lambda x: (x[0].seconds, x[1]))
    best: tuple[float, int, PricedPlan, str] | None = None  # (seconds, order, priced, text) of the fastest
    leanest: tuple[float, int, PricedPlan, str] | None = None  # least peak memory of those that do not fit
    priced_count = 0

    def price(plan: Plan) -> PricedPlan:
        nonlocal priced_count
        priced_count += 1
        return price_plan(plan, model, cluster, cal, validate=False)

    for done, (floor, order, plan, text) in enumerate(layouts, start=1):
        if best is not None and floor.seconds > best[0]:
            break
        if floor.peak_bytes > capacity:
            continue  # cannot fit: priced below only if nothing fits
        priced = price(plan)
        if not priced.fits:
            if leanest is None or (priced.peak_bytes, order) < leanest[:2]:
                leanest = (priced.peak_bytes, order, priced, text)
        elif best is None or priced.lower_bound_s() <= best[0]:
            seconds = finish(priced, detail=False).iteration_time_s
            if best is None or (seconds, order) < best[:2]:
                best = (seconds, order, priced, text)
        if progress and done % PROGRESS_EVERY == 0:
            progress(done, len(layouts))
    if best is None:  # nothing fits: the closest to fitting, of every layout
        for floor, order, plan, text in layouts:
            if floor.peak_bytes > capacity and (leanest is None or floor.peak_bytes < leanest[0]):
                priced = price(plan)
                if leanest is None or (priced.peak_bytes, order) < leanest[:2]:
                    leanest = (priced.peak_bytes, order, priced, text)
    if progress:
        progress(len(layouts), len(layouts))
    chosen = best or leanest  # the fastest that fits, else the closest to fitting
    if chosen is None:
        return None, priced_count
    _, _, priced, text = chosen
    return Candidate(priced.plan, finish(priced), f"{kind}: {text}"), priced_count
