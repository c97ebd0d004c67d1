"""Baseline planners: pure data parallel, ZeRO-3/FSDP only, and the best uniform Megatron-style grid.

Each baseline enumerates uniform `--strategy` layouts and lets the simulator judge them; the best plan
that fits wins (or, if none fits, the one closest to fitting).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import product
from dataclasses import dataclass

from plait.cost.calibration import Calibration
from plait.errors import PlaitError
from plait.plan import Plan, Strategy, strategy_problem, uniform_plan
from plait.planner.space import divisors, expert_layouts
from plait.simulate import PricedPlan, Report, finish, price_plan
from plait.spec.cluster import Cluster
from plait.spec.model import ModelSpec

BASELINES = ("dp", "zero3", "megatron-grid")
Progress = Callable[[int, int], None]  # (done, total)


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
    """The best plan of a baseline (among those `accept` allows) and the number of plans priced.

    Every layout is priced (stage costs and memory, no schedule simulated); the fitting ones are then
    simulated in order of their lower bound until the bound passes the fastest simulated, which finds the
    plan a full enumeration would (ties go to the earlier layout)."""
    groups = list(grid_layouts(model, cluster, seq_len, global_batch, kind, expert_load))
    fitting: list[tuple[float, int, PricedPlan, str]] = []
    leanest: tuple[float, int, PricedPlan, str] | None = None  # least peak memory of those that do not fit
    order = 0  # enumeration order of the layouts priced
    for i, group in enumerate(groups):
        for text in group:
            plan = uniform_plan(text, model, cluster, seq_len)
            if accept is not None and not accept(plan):
                break
            priced = price_plan(plan, model, cluster, cal, validate=False)
            order += 1
            if not priced.fits:
                if leanest is None or priced.peak_bytes < leanest[0]:
                    leanest = (priced.peak_bytes, order, priced, text)
                break  # larger micro-batches need more memory
            fitting.append((priced.lower_bound_s(), order, priced, text))
        if progress:
            progress(i + 1, len(groups))
    best: tuple[float, int, PricedPlan, str] | None = None  # (seconds, order, priced, text) of the fastest
    for bound, index, priced, text in sorted(fitting, key=lambda f: (f[0], f[1])):
        if best is not None and bound > best[0]:
            break
        seconds = finish(priced, detail=False).iteration_time_s
        if best is None or (seconds, index) < best[:2]:
            best = (seconds, index, priced, text)
    chosen = best or leanest  # the fastest that fits, else the closest to fitting
    if chosen is None:
        return None, order
    _, _, priced, text = chosen
    return Candidate(priced.plan, finish(priced), f"{kind}: {text}"), order
