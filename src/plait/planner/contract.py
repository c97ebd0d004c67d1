"""The planners' contract with the runtime: every output of every planner for tiny models on 4 local ranks,
each in a shape class (the runtime paths it takes) and with the one line the runtime refuses it with, or None.

Planners swept (as the command line calls them, `plait.cli`): the search (`plait plan`) at budgets from
roomy down to the tightest, with the memory hierarchy (`--host-memory`) and LSH-MoE (`--lsh`); the dp and
ZeRO-3 baselines (`--baseline`; megatron-grid is part of the search); the straggler planner (`--slow`, and
the live re-planner's call with the current plan) on slowed and mixed-speed clusters; the variable-length
planner (`plait varlen`, `train --varlen`: FlexSP, ByteScale, static) and the multitask planner (`plait
multitask`, `train --tasks`). Plans are judged by `plait.executable.unsupported`; the variable-length runs
and multitask units by the judges the caller passes (the runtime's own load-time checks, which the planner
does not import: `tests/test_contract.py`). Pricing only, no training; deterministic (fixed seeds)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from importlib.resources import files
from pathlib import Path

import numpy as np

from plait.errors import PlaitError
from plait.executable import tied_ends_alike, unsupported
from plait.plan import Plan, uniform_plan
from plait.planner.baselines import run_baseline
from plait.planner.engine import DEFAULT_LIMITS, search
from plait.planner.multitask.plan import plan_multitask
from plait.planner.space import HIERARCHY, SpaceLimits
from plait.planner.straggler import plan_around_stragglers
from plait.planner.varlen import BatchPlan, SequenceCost, load_lengths, plan_batch, sample_batches
from plait.simulate import simulate
from plait.spec.cluster import Cluster, load_cluster, local_ranks
from plait.spec.model import ModelSpec, load_model
from plait.spec.tasks import load_tasks

WINDOWED = "llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=384,vocab=512,seq=256,window=16"
"""tiny-llama's shape with a sliding window of 16 tokens on every layer (Mistral's kind of stack)."""
ALTERNATING = WINDOWED + ",global_every=2"
"""The same with every other layer global (Gemma-2's alternation)."""
MODELS = ("tiny-llama", "tiny-gpt", "tiny-moe", "tiny-t5", "tiny-llava", WINDOWED, ALTERNATING)
"""The tiny model of every family the planners price: GPT and Llama decoders, Llama with MoE layers (a dense
first layer, shared experts), a T5 encoder-decoder, a LLaVA vision tower before Llama layers, and Llama
layers with sliding windows (all, or every other one)."""
RANKS = 4
"""Ranks of the local cluster the plans are made for (gloo processes in the contract test)."""
SEQ_LEN = 64
"""Tokens per sequence (the runtime tests' sequence length)."""
GLOBAL_BATCHES = (4, 8)
"""Sequences per step the search plans for."""
STRAGGLER_BATCHES = (2, 4, 8)
"""Sequences per step the straggler planner plans for (2: pipelines with fewer micro-batches than stages)."""
ROOMY_GIB = 80.0
"""The roomy budget (GiB per device), where uniform layouts win."""
BUDGET_QUANTILES = (0.0, 0.25, 0.5, 0.75)
"""Tighter budgets: the peak memory of the plans the roomy search prices, at these quantiles (0: the
tightest plan, below which nothing fits without host memory), plus `BUDGET_MARGIN_GIB`, so that the plan at
the quantile just fits and per-layer mixes of ZeRO, recompute and tensor parallelism pay."""
BUDGET_MARGIN_GIB = 1e-4
"""Added to each quantile's peak (GiB): the plan there fits."""
HOST_QUANTILES = (0.5, 0.6, 0.75)
"""Budget quantiles at which the search runs again with the memory hierarchy (`plait plan --host-memory`):
where full recompute is what else fits, swapping (and paging parameters in) pays; below, the tiny models'
peak is the fixed runtime reserve, which host memory does not shrink."""
BASELINES = ("dp", "zero3")
"""`plait plan --baseline` planners beside the search (megatron-grid is part of the search)."""
SLOWDOWNS: tuple[dict[int, float], ...] = (
    {0: 2.0}, {1: 5.0}, {1: 3.0, 2: 3.0}, {3: 1.5},  # stragglers: one rank 2x, one 5x, two 3x, one 1.5x
    {2: 2.0, 3: 2.0}, {0: 1.6, 2: 1.6}, {0: 1.3, 1: 1.3, 2: 3.0, 3: 3.0})  # mixed GPU types: half the ranks
"""Speed factors (rank -> time relative to a healthy device): stragglers, then mixed GPU types (an older
GPU 2x slower on one half or on alternate ranks; three generations)."""
CURRENT_STRATEGIES = ("tp=2,pp=2", "dp=2,pp=2", "tp=2,dp=2", "pp=4", "dp=2,zero=1,pp=2")
"""Plans running when devices slow down (`--strategy` text), which the live re-planner re-plans: pipelines
of tensor-parallel units (shrunk around a straggler), several pipelines, short pipelines."""
LSH_MODELS = ("tiny-moe",)
"""Models the search also plans with LSH-MoE (`plait plan --lsh`)."""
VARLEN_METHODS = (("flexsp", "ulysses"), ("bytescale", "ring"), ("static", "ulysses"), ("static", "ring"))
"""(method, attention across a group) pairs of `plait varlen` / `train --varlen` (ByteScale: ring)."""
VARLEN_STATES = ("sharded", "replicated")
VARLEN_OFFLOAD_ABOVE = (0, 128)
"""ByteScale's selective offloading: none, or documents of at least this many tokens."""
VARLEN_CAPACITY = 128
"""Tokens a rank holds at once (the tiny models' 256 positions fit 2 ranks)."""
VARLEN_BATCHES = 2
"""Global batches sampled per variable-length run (seed `SEED`)."""
VARLEN_GLOBAL_BATCH = 8
SEED = 0
TASK_FILES = ("tiny-tasks.yaml", "tiny-bind-tasks.yaml")
"""The shipped tiny task files the multitask planner plans (`plait.data`): a shared trunk after two encoders,
and tasks that end in two towers (ImageBind's shape, at a size CPU ranks train)."""
TASK_GPUS = ("A100-80GB", "H100-80GB")
"""Device types the waves are planned for (`train --tasks` plans for the A100)."""
PRECISION = "fp32"


@dataclass(frozen=True)
class VarlenRun:
    """A variable-length run as `train --varlen` would start it, and the step layouts the planner gives
    its first sampled batches."""

    model: str
    method: str
    cp_mode: str
    states: str
    offload_above: int
    capacity: int
    global_batch: int
    batches: tuple[BatchPlan, ...]


@dataclass(frozen=True)
class TaskRun:
    """The multitask planner's plan for one task file on `RANKS` ranks of one device type."""

    tasks: Path
    gpu: str
    plan: object  # plait.planner.multitask.plan.MultitaskPlan


Output = Plan | VarlenRun | TaskRun
Judge = Callable[[Output], str | None]


@dataclass(frozen=True)
class Emitted:
    """One output a planner emitted, where it came from, its shape class, and why the runtime refuses it
    (None: it runs)."""

    output: Output
    source: str
    parts: tuple[str, ...]  # the shape class: the model's kind, then the runtime paths it takes
    refusal: str | None

    @property
    def shape(self) -> str:
        return " ".join(self.parts)

    @property
    def plan(self) -> Plan:
        assert isinstance(self.output, Plan)
        return self.output


@dataclass(frozen=True)
class Declined:
    """A planner that plans nothing for a model (its own one-line reason): no output, so no contract."""

    source: str
    model: str
    reason: str


@cache
def spec(model: str) -> ModelSpec:
    """The model a plan names (a preset or an inline spec)."""
    return load_model(model)


def _cluster(gib: float | None = None, slow: dict[int, float] | None = None) -> Cluster:
    c = local_ranks(RANKS)
    c = c.with_memory(gib) if gib is not None else c
    return c.with_slow(slow) if slow else c


@cache
def _searched(model: str, gbs: int, gib: float, limits: SpaceLimits = DEFAULT_LIMITS
              ) -> tuple[list[Plan], Plan | None]:
    """Every plan the search prices for `model` under `gib` GiB per device, and the plan it returns."""
    seen: list[Plan] = []
    result = search(spec(model), _cluster(gib), SEQ_LEN, gbs, precision=PRECISION, limits=limits,
                    record=seen.append)
    return seen, result.plan


def budgets(model: str, roomy: list[Plan], quantiles: tuple[float, ...]) -> list[float]:
    """Budgets (GiB): the peaks of the plans the roomy search priced at `quantiles`, plus
    `BUDGET_MARGIN_GIB`."""
    peaks = [simulate(p, spec(model), _cluster(), validate=False).peak_memory_gib for p in roomy]
    return [round(float(np.quantile(peaks, q)) + BUDGET_MARGIN_GIB, 4) for q in quantiles]


def _search_outputs(model: str) -> Iterator[tuple[Plan, str]]:
    """The search's priced plans at every budget (and with host memory, LSH-MoE), and the baselines'."""
    host = replace(DEFAULT_LIMITS, **HIERARCHY)
    for gbs in GLOBAL_BATCHES:
        roomy, _ = _searched(model, gbs, ROOMY_GIB)
        yield from ((p, "search") for p in roomy)
        for gib in budgets(model, roomy, BUDGET_QUANTILES):
            yield from ((p, "search") for p in _searched(model, gbs, gib)[0])
        for gib in budgets(model, roomy, HOST_QUANTILES):
            yield from ((p, "search --host-memory") for p in _searched(model, gbs, gib, host)[0])
        if model in LSH_MODELS:
            lsh = replace(DEFAULT_LIMITS, moe_comm=("alltoall", "lsh"))
            yield from ((p, "search --lsh") for p in _searched(model, gbs, ROOMY_GIB, lsh)[0])
        for kind in BASELINES:
            priced: list[Plan] = []
            run_baseline(kind, spec(model), _cluster(), SEQ_LEN, gbs,
                         accept=lambda p: priced.append(p) or True)
            yield from ((p, f"baseline {kind}") for p in priced)


def _straggler_outputs(model: str, declined: list[Declined]) -> Iterator[tuple[Plan, str]]:
    """The straggler planner's picks for every slowdown: from scratch (`plait plan --slow`), from the healthy
    search's plan (`plait plan --slow` re-plans it), and as the live re-planner calls it from a running plan
    (`CURRENT_STRATEGIES`; its degrees kept, `--replan-degrees keep`, or free); and every plan it prices on
    the way (`record`), any of which it may pick under other speeds. The running plan itself, when the planner
    keeps it, is the caller's, not an output."""
    m = spec(model)
    try:  # the planner splits stacks of one layer kind only
        plan_around_stragglers(m, _cluster(slow=SLOWDOWNS[0]), SEQ_LEN, STRAGGLER_BATCHES[0],
                               precision=PRECISION)
    except PlaitError as exc:
        declined.append(Declined("straggler", model, str(exc)))
        return
    for gbs in STRAGGLER_BATCHES:
        currents = [uniform_plan(f"{text},gbs={gbs}", m, _cluster(), SEQ_LEN) for text in CURRENT_STRATEGIES]
        calls: list[dict] = [{}] + [{"current": c, "keep_degrees": keep}
                                    for c in currents for keep in (True, False)]
        if gbs in GLOBAL_BATCHES and (healthy := _searched(model, gbs, ROOMY_GIB)[1]) is not None:
            calls.append({"current": healthy})
        for slow in SLOWDOWNS:
            for kw in calls:
                priced: list[Plan] = []
                result = plan_around_stragglers(m, _cluster(slow=slow), SEQ_LEN, gbs, precision=PRECISION,
                                                record=priced.append, **kw)
                if result.plan is not None and result.label not in ("current plan", "given plan"):
                    yield result.plan, "straggler"
                current = kw.get("current")
                yield from ((p, "straggler") for p in priced if current is None or p != current)


def _varlen_outputs(model: str, declined: list[Declined]) -> Iterator[VarlenRun]:
    """The variable-length planner's step layouts for `VARLEN_BATCHES` sampled batches of Wikipedia lengths
    (clipped to the model's positions), for every method, state placement and offload threshold."""
    m = spec(model)
    pool = np.clip(load_lengths(files("plait") / "data" / "wikipedia-lengths-10k.txt"), 1, m.max_seq_len)
    sampled = sample_batches(pool, VARLEN_BATCHES, VARLEN_GLOBAL_BATCH, SEED)
    for method, mode in VARLEN_METHODS:
        for above in VARLEN_OFFLOAD_ABOVE:
            try:
                cost = SequenceCost(m, _cluster(), precision=PRECISION, cp_mode=mode, offload_above=above)
                layouts = tuple(plan_batch(b, RANKS, cost, VARLEN_CAPACITY, method) for b in sampled)
            except PlaitError as exc:
                declined.append(Declined("varlen", model, str(exc)))
                return
            for states in VARLEN_STATES:
                yield VarlenRun(model, method, mode, states, above, VARLEN_CAPACITY, VARLEN_GLOBAL_BATCH,
                                layouts)


def _task_outputs() -> Iterator[TaskRun]:
    for name in TASK_FILES:
        path = Path(str(files("plait") / "data" / name))
        tasks = load_tasks(path)
        for gpu in TASK_GPUS:
            yield TaskRun(path, gpu, plan_multitask(tasks, load_cluster(f"1x{RANKS}x{gpu}"), PRECISION))


def model_kind(model: ModelSpec) -> str:
    """The family, with MoE layers and sliding windows named."""
    kinds = model.kind_counts()
    windowed = [bool(b.window) for b in model.stack]
    windows = "all" if all(windowed) else "some" if any(windowed) else ""
    return model.family + ("+moe" if "moe" in kinds else "") + (f"+window({windows})" if windows else "")


def shape_parts(plan: Plan) -> tuple[str, ...]:
    """The runtime paths a plan takes: the model's kind; several pipelines or one (and its stages),
    interleaved chunks, stages of different widths, fewer micro-batches than stages, whether a stage mixes
    layer strategies, whether a tied embedding and head are laid out differently at the two ends of a
    pipeline; and the features any layer uses (ZeRO, HSDP, tensor, sequence, Ulysses and ring context
    parallelism, expert and expert-tensor parallelism, LSH-MoE, swapping (with selective recompute), offload
    kinds). Not their degrees, recompute, micro-batch sizes or layer cuts: recompute changes no gradient
    path, and the class count bounds the contract test's time."""
    model = spec(plan.model)
    strategies = [s for p in plan.pipelines for st in p.stages for s in st.strategies]
    pipes = plan.pipelines
    parts = [model_kind(model)]
    parts.append(f"{len(pipes)} pipelines" if len(pipes) > 1 else f"pp{len(pipes[0].stages) // plan.chunks}")
    if plan.chunks > 1:
        parts.append(f"vpp{plan.chunks}")
    if not all(p.even_widths for p in pipes):
        parts.append("uneven widths")
    if any(1 < len(p.stages) // plan.chunks > p.micro_batches for p in pipes):
        parts.append("short")
    if any(len({s.without_recompute() for s in st.strategies}) > 1
           for p in pipes for st in p.stages):
        parts.append("mixed")
    if model.tied_embeddings and not all(tied_ends_alike(p) for p in pipes):
        parts.append("tied apart")
    features = {"zero": any(s.zero for s in strategies), "hsdp": any(s.shard for s in strategies),
                "tp": any(s.tp > 1 for s in strategies), "sp": any(s.sp for s in strategies),
                "cp": any(s.cp > 1 and s.cp_mode == "ulysses" for s in strategies),
                "ring": any(s.ring for s in strategies),
                "ep": any(s.ep > 1 for s in strategies),
                "etp": any(s.etp and s.etp != s.tp for s in strategies),
                "lsh": any(s.moe_comm == "lsh" for s in strategies), "swap": any(s.swap for s in strategies),
                "swap+selective": any(s.swap and s.recompute == "selective" for s in strategies)}
    parts += [name for name, used in features.items() if used]
    parts += sorted(f"offload={o}" for o in {s.offload for s in strategies} - {"none"})
    return tuple(parts)


def shape_class(plan: Plan) -> str:
    """`shape_parts` in one line."""
    return " ".join(shape_parts(plan))


def varlen_parts(run: VarlenRun) -> tuple[str, ...]:
    """A variable-length run's runtime paths: the model's kind, the method and attention, the states,
    whether documents swap to host."""
    return (model_kind(spec(run.model)), f"varlen {run.method}/{run.cp_mode}", run.states) + \
        (("offload",) if run.offload_above else ())


def task_parts(run: TaskRun) -> tuple[str, ...]:
    """A multitask plan's runtime paths: its task file (the modules it builds) and the device-group sizes."""
    sizes = sorted({len(p.ranks) for st in run.plan.schedule.stages for p in st.placements if p.layers})
    return "multitask", run.tasks.stem, f"groups of {'/'.join(map(str, sizes))} ranks"


def _parts(output: Output) -> tuple[str, ...]:
    return shape_parts(output) if isinstance(output, Plan) else \
        varlen_parts(output) if isinstance(output, VarlenRun) else task_parts(output)


def _family(e: Emitted) -> tuple[str, str]:
    """(model kind, kind of output): the group a refusal of every member collapses to one class."""
    return e.parts[0], type(e.output).__name__


def emitted(judges: dict[type, Judge] | None = None) -> tuple[list[Emitted], list[Declined]]:
    """Every distinct output of every planner (search, baselines, straggler, variable-length, multitask, in
    that order, deterministic), judged: plans by `plait.executable.unsupported`, the other outputs by
    `judges` (by type; without one, an output is listed as not judged), and the planners' own refusals.
    Where the runtime refuses every output of a model kind for one reason (a model it does not build), they
    share one shape class, "<kind> <output type>: every output"."""
    judges = {Plan: lambda p: unsupported(p, spec(p.model)), **(judges or {})}
    found: dict[str, tuple[Output, str]] = {}
    declined: list[Declined] = []
    for model in MODELS:
        for plan, source in _search_outputs(model):
            found.setdefault(plan.model_dump_json(), (plan, source))
    for model in MODELS:
        for plan, source in _straggler_outputs(model, declined):
            found.setdefault(plan.model_dump_json(), (plan, source))
    for model in MODELS:
        for run in _varlen_outputs(model, declined):
            found.setdefault(repr(run), (run, "varlen"))
    for task_run in _task_outputs():
        found.setdefault(f"{task_run.tasks.name} {task_run.gpu}", (task_run, "multitask"))
    out = []
    for output, source in found.values():
        judge = judges.get(type(output))
        out.append(Emitted(output, source, _parts(output),
                           judge(output) if judge else f"not judged ({type(output).__name__})"))
    reasons: dict[tuple[str, str], set[str | None]] = {}
    for e in out:
        reasons.setdefault(_family(e), set()).add(reason_class(e.refusal) if e.refusal else None)
    whole = {f for f, r in reasons.items() if len(r) == 1 and None not in r}
    out = [replace(e, parts=(f"{e.parts[0]} {_family(e)[1]}: every output",)) if _family(e) in whole else e
           for e in out]
    return out, list(dict.fromkeys(declined))


def emitted_plans() -> list[Emitted]:
    """The plans alone (search, baselines, straggler), judged by `plait.executable.unsupported` (no judge of
    the runtime needed)."""
    return [e for e in emitted()[0] if isinstance(e.output, Plan)]


def reason_class(refusal: str) -> str:
    """A refusal without its model, numbers and strategies: the class of outputs it stands for."""
    text = re.sub(r"^\S+ ties", "the model ties", refusal)
    text = re.sub(r"^model '[^']*'", "model #", text)
    text = re.sub(r"\((dp|tp|cp|ep)\d[^)]*\)", "(#)", text)  # "(dp1 tp2 sp vs ...)": the strategies
    text = re.sub(r"\([^()]*\d[^()]*\)", "(#)", text)  # "(4 decoder)", "(tiny-moe)": counts, names
    text = re.sub(r"^(dp|tp|cp)\d\S*( \S+)*?: ", "#: ", text)  # "dp2 zero1 swap0.5: ...": the strategy
    return re.sub(r"\b(pipeline|layer|rank)s? \d+\b|\b\S*\d\S*\b", "#", text)


def refused_classes(outputs: list[Emitted]) -> Counter[tuple[str, str]]:
    """(shape class, refusal class) -> how many outputs of that shape the runtime refuses for that reason."""
    return Counter((e.shape, reason_class(e.refusal)) for e in outputs if e.refusal)


def atoms(e: Emitted) -> set[tuple[str, ...]]:
    """What training `e` exercises: its model kind, each of its paths on that kind, and each pair of paths."""
    kind, rest = e.parts[0], e.parts[1:]
    return {(kind,)} | {(kind, p) for p in rest} | {(p, q) for i, p in enumerate(rest) for q in rest[i + 1:]}


def sample(outputs: list[Emitted]) -> list[Emitted]:
    """Outputs the runtime accepts that together exercise every atom (`atoms`) of every accepted output:
    greedily the one adding the most atoms not yet exercised (ties: the first emitted), until none adds
    any. Deterministic; far fewer runs than one per shape class."""
    pool = [e for e in outputs if e.refusal is None]
    left = set().union(*(atoms(e) for e in pool)) if pool else set()
    chosen: list[Emitted] = []
    while left:
        best = max(pool, key=lambda e: len(atoms(e) & left))
        chosen.append(best)
        left -= atoms(best)
    return chosen


def summary(outputs: list[Emitted], declined: list[Declined]) -> str:
    """The sweep in lines: outputs per source, classes that run, each refused (class, reason) with its count
    and one refusal line as the runtime gives it, and what the planners decline."""
    sources = Counter(e.source for e in outputs)
    lines = [f"{len(outputs)} outputs: " + ", ".join(f"{n} {s}" for s, n in sources.items())]
    shapes = {e.shape for e in outputs}
    running = {e.shape for e in outputs if e.refusal is None}
    refused = refused_classes(outputs)
    lines.append(f"{len(shapes)} shape classes: {len(running)} with outputs that run, "
                 f"{len({s for s, _ in refused})} with refused outputs; "
                 f"{sum(e.refusal is None for e in outputs)} outputs run, {sum(refused.values())} refused")
    example: dict[tuple[str, str], str] = {}
    for e in outputs:
        if e.refusal:
            example.setdefault((e.shape, reason_class(e.refusal)), e.refusal)
    for (shape, reason), n in sorted(refused.items()):
        lines.append(f"REFUSED {n:4d}  {shape}\n    {example[shape, reason]}")
    lines += [f"DECLINED {d.source} {d.model}: {d.reason}" for d in declined]
    return "\n".join(lines)


__all__ = ["Declined", "Emitted", "TaskRun", "VarlenRun", "atoms", "emitted", "emitted_plans", "reason_class",
           "refused_classes", "sample", "shape_class", "shape_parts", "spec", "summary"]
