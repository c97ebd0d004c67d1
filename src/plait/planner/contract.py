"""The planners' contract with the runtime: every plan the search prices, and every plan the straggler
planner chooses, for tiny models on a few local ranks, each with the reason the runtime refuses it
(`plait.executable.unsupported`) or None. `tests/test_contract.py` runs a sample of them."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace

from plait.executable import tied_ends_alike, unsupported
from plait.plan import Plan
from plait.planner.engine import DEFAULT_LIMITS, search
from plait.planner.space import HIERARCHY
from plait.planner.straggler import plan_around_stragglers
from plait.spec.cluster import Cluster, local_ranks
from plait.spec.model import PRESETS

MODELS = ("tiny-llama", "tiny-gpt")
"""The smallest presets of the families whose stacks every planner splits (one kind of decoder layer)."""
RANKS = 4
"""Ranks of the local cluster the plans are made for (gloo processes in the contract test)."""
SEQ_LEN = 64
"""Tokens per sequence (the runtime tests' sequence length)."""
GLOBAL_BATCHES = (4, 8)
"""Sequences per step the plans are made for."""
SLOWDOWNS: tuple[dict[int, float], ...] = ({0: 2.0}, {1: 5.0}, {1: 3.0, 2: 3.0}, {3: 1.5})
"""Straggler cases (rank -> time relative to a healthy device): one rank 2x, one 5x, two 3x, one 1.5x."""
MEMORY_GIB = (80.0, 0.809, 0.811, 0.817)
"""Device memory the search plans for (GiB): roomy (uniform layouts win), and just above the tiny models'
priced peak (about 0.81 GiB, mostly the fixed runtime reserve), where per-layer mixes of ZeRO, recompute and
tensor parallelism fit a stage (found by sweeping the budget)."""
OFFLOAD_LIMITS = replace(DEFAULT_LIMITS, offload=HIERARCHY["offload"])
"""The search space with optimizer offload and parameter paging (what `plait plan --host-memory` adds
besides swapping), searched again at the tight budgets, where they pay."""


@dataclass(frozen=True)
class Emitted:
    """One plan a planner emitted, where it came from, and why the runtime refuses it (None: it runs)."""

    plan: Plan
    source: str  # "search" or "straggler"
    refusal: str | None


def _search_plans(model: str, cluster: Cluster, global_batch: int, limits=DEFAULT_LIMITS) -> list[Plan]:
    seen: list[Plan] = []
    search(PRESETS[model], cluster, SEQ_LEN, global_batch, precision="fp32", limits=limits, record=seen.append)
    return seen


def emitted_plans() -> list[Emitted]:
    """Every distinct plan the search prices and the straggler planner chooses (search first), in a
    deterministic order."""
    found: dict[str, tuple[Plan, str]] = {}
    for model in MODELS:
        for gbs in GLOBAL_BATCHES:
            for gib, limits in [(gib, DEFAULT_LIMITS) for gib in MEMORY_GIB] + \
                    [(gib, OFFLOAD_LIMITS) for gib in MEMORY_GIB[1:]]:
                for plan in _search_plans(model, local_ranks(RANKS).with_memory(gib), gbs, limits):
                    found.setdefault(plan.model_dump_json(), (plan, "search"))
            for slow in SLOWDOWNS:
                result = plan_around_stragglers(PRESETS[model], local_ranks(RANKS).with_slow(slow), SEQ_LEN, gbs,
                                                precision="fp32")
                if result.plan is not None:
                    found.setdefault(result.plan.model_dump_json(), (result.plan, "straggler"))
    return [Emitted(plan, source, unsupported(plan, PRESETS[plan.model])) for plan, source in found.values()]


def reason_class(refusal: str) -> str:
    """A refusal without its model, numbers and strategies: the class of plans it stands for."""
    text = re.sub(r"^\S+ ties", "the model ties", refusal)
    text = re.sub(r" \((dp|tp)\d[^)]*\)", "", text)  # "(dp1 tp2 sp vs ...)": the two strategies
    return re.sub(r"\b(pipeline|layer|rank)s? \d+\b|\b\S*\d\S*\b", "#", text)


def refusal_table(plans: list[Emitted]) -> Counter[str | None]:
    """How many plans each class of refusal refuses (None: how many run)."""
    return Counter(reason_class(e.refusal) if e.refusal else None for e in plans)


def shape_class(plan: Plan) -> tuple:
    """The runtime paths a plan takes: several pipelines or one (and its stages), interleaved chunks,
    whether a stage mixes layer strategies, whether a tied embedding and head are laid out differently at the
    two ends of a pipeline, the offload choices its layers make, and the ZeRO, tensor-, context- and
    sequence-parallel features any layer uses
    (not their degrees, recompute, micro-batch sizes or layer cuts: recompute changes no gradient path, and
    the class count bounds the contract test's time)."""
    strategies = [s for p in plan.pipelines for st in p.stages for s in st.strategies]
    mixed = any(len({s.model_copy(update={"recompute": "none"}) for s in st.strategies}) > 1
                for p in plan.pipelines for st in p.stages)
    pipes = "several" if len(plan.pipelines) > 1 else len(plan.pipelines[0].stages) // plan.chunks
    tied_apart = PRESETS[plan.model].tied_embeddings and not all(tied_ends_alike(p) for p in plan.pipelines)
    offloads = tuple(sorted({s.offload for s in strategies} - {"none"}))
    return (pipes, plan.chunks, mixed, tied_apart, offloads, max(s.zero for s in strategies) > 0,
            max(s.tp for s in strategies) > 1, max(s.cp for s in strategies) > 1, any(s.sp for s in strategies))


def sample(plans: list[Emitted]) -> list[Emitted]:
    """One plan the runtime accepts of every shape class (`shape_class`), classes in order of first
    appearance: the first of the class for the model `MODELS` names in turn (class 0 the first model's,
    class 1 the second's, ...), else the class's first plan."""
    classes: dict[tuple, list[Emitted]] = {}
    for e in plans:
        if e.refusal is None:
            classes.setdefault(shape_class(e.plan), []).append(e)
    chosen = []
    for i, members in enumerate(classes.values()):
        model = MODELS[i % len(MODELS)]
        chosen.append(next((e for e in members if e.plan.model == model), members[0]))
    return chosen


__all__ = ["Emitted", "emitted_plans", "reason_class", "refusal_table", "sample", "shape_class"]
