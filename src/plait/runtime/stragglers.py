"""Straggler handling while training (Malleus): time every rank's compute, detect a change in any rank's
speed, re-plan in the background, and switch plans between two steps without stopping the job.

* `ComputeClock` times this rank's compute in a step (each micro-batch's forward and backward, or each
  pipeline stage's forward and backward ops), the part of a step that a slow device stretches; with an
  injected slowdown (`--inject-slow RANK:FACTOR@STEP`, a simulated straggler) every timed piece is followed
  by a sleep of (FACTOR - 1) times its duration. Gradients are reduced after the backward (not inside it),
  so a fast rank's clock never includes waiting for a slow one.
* Speed: each rank's compute seconds over what the cost model predicts for its share of the plan, relative
  to the median rank, as the median of the last `WINDOW` steps. In a stage with collectives inside its
  compute (tensor or context parallelism, ZeRO) every member waits for the slowest, so the stage's
  slowness goes to its members by a local probe (one GEMM each, `attribute`). A rank the plan leaves out
  runs a probe (one sequence through the whole model) so that its recovery is seen too.
* A shift is a rank whose speed factor (factors below `plait.spec.cluster.SNAP_FACTOR` snapped to 1) moved by at least
  `SHIFT` from the factor the current plan was made for. Rank 0 then runs the straggler planner
  (`plait.planner.straggler`) in a background thread while training goes on, and when it is done every
  rank learns the new plan at the next step boundary (if it is predicted `MIN_GAIN` faster). The planner
  may change the tensor- and pipeline-parallel degrees, shrink a tensor-parallel unit to its healthy
  members and give slow pipelines fewer micro-batches (any plan the runtime executes); it prices plans with
  the profile of this machine (`--profile`), else with the analytic cost model. With `--replan-degrees
  keep` it keeps the current degrees (shrunk units and uneven micro-batches still allowed).
* Switching: the new plan's model and process groups are built, and the model and optimizer state move
  from the old plan's owners to the new ones over the network (`plait.runtime.migrate`, the default), or,
  with `--switch-via dcp`, through a DCP save and a resharded load from a directory that every rank must
  see (one machine, or a shared file system). The data and learning rate depend only on the step, so the
  loss continues as if nothing happened.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from plait.errors import PlaitError
from plait.plan import Pipeline, Plan, Stage, Strategy
from plait.spec.cluster import snap
from plait.spec.model import ModelSpec

WINDOW = 3
"""Steps whose median speed decides (one slow step is noise, three are a straggler)."""
SHIFT = 0.3
"""Change of a rank's speed factor that triggers re-planning (Malleus: 0.3x)."""
MIN_GAIN = 0.1
"""A new plan must be predicted this much faster than the current one to be switched to (a switch costs a
state transfer, and speed estimates are noisy)."""


@dataclass(frozen=True)
class Injection:
    """From `step` on, rank `rank` computes `factor` times slower (1.0: recovered)."""

    step: int
    rank: int
    factor: float


def parse_injections(text: str | None, world: int) -> list[Injection]:
    """`RANK:FACTOR@STEP[,RANK:FACTOR@STEP...]` -> injections, sorted by step."""
    out = []
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        head, at, step = item.partition("@")
        rank, colon, factor = head.partition(":")
        try:
            inj = Injection(int(step), int(rank), float(factor))
        except ValueError:
            inj = None
        if not at or not colon or inj is None:
            raise PlaitError(f"--inject-slow: cannot read {item!r}; use RANK:FACTOR@STEP such as 3:5@4")
        if not 0 <= inj.rank < world or inj.factor < 1.0 or inj.step < 0:
            raise PlaitError(f"--inject-slow {item!r}: need a rank in 0..{world - 1}, a factor >= 1 and a step >= 0")
        out.append(inj)
    return sorted(out, key=lambda i: i.step)


PROBE_GEMM = 384
"""Side of the square fp32 GEMM every rank of a stage with collectives inside its compute times each step
(about 10 ms on one CPU core): its own speed, free of waits for the stage's other ranks."""


class ComputeClock:
    """This rank's compute seconds in the current step, with an optional injected slowdown."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.factor = 1.0
        self._gemm = torch.randn(PROBE_GEMM, PROBE_GEMM, generator=torch.Generator().manual_seed(0))

    @contextmanager
    def _slowed(self):
        t0 = time.perf_counter()
        yield
        if self.factor > 1.0:
            time.sleep((self.factor - 1.0) * (time.perf_counter() - t0))

    @contextmanager
    def compute(self):
        t0 = time.perf_counter()
        with self._slowed():
            yield
        self.busy += time.perf_counter() - t0

    def local_speed(self) -> float:
        """Seconds of one GEMM on this rank alone (slowed like its compute), not counted as busy."""
        t0 = time.perf_counter()
        with self._slowed():
            self._gemm @ self._gemm
        return time.perf_counter() - t0

    def wrap_stage(self, stage) -> None:
        """Time a pipeline stage's forward and backward ops (not its sends and receives)."""
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, self._timed(method))

    def _timed(self, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            with self.compute():
                return fn(*args, **kwargs)
        return wrapper


def speed_factors(busy: list[float], predicted: list[float]) -> list[float]:
    """Each rank's time per predicted second, relative to the median rank (stragglers are a minority)."""
    ratios = [b / p if p > 0 else 0.0 for b, p in zip(busy, predicted)]
    working = [r for r in ratios if r > 0]
    if not working:
        return [1.0] * len(busy)
    reference = statistics.median(working)
    return [r / reference if r > 0 else 1.0 for r in ratios]


def waiting_groups(plan: Plan) -> list[tuple[int, ...]]:
    """The ranks of each stage whose compute includes collectives over the stage (tensor or context
    parallelism, ZeRO's gathers and reductions inside the backward): their compute clocks all wait for the
    slowest member, so only a local probe tells which member is slow."""
    out = []
    for pipe in plan.pipelines:
        for st in pipe.stages:
            strategies = [s for s, _ in st.layer_strategies()]
            if len(st.ranks) > 1 and any(s.tp * s.cp > 1 or (s.zero and s.dp > 1) for s in strategies):
                out.append(st.ranks)
    return out


def attribute(factors: list[float], probes: list[float], groups: list[tuple[int, ...]]) -> list[float]:
    """Speed factors with each waiting group's slowness (its slowest member's factor) given to its members
    in proportion to their local probes' seconds (`ComputeClock.local_speed`)."""
    out = list(factors)
    for ranks in groups:
        slowest, probe = max(factors[r] for r in ranks), max(probes[r] for r in ranks)
        if probe > 0:
            for r in ranks:
                out[r] = slowest * probes[r] / probe
    return out


def shifted(now: list[float], planned: list[float]) -> bool:
    """Whether any rank's (snapped) speed factor moved by at least `SHIFT` from the planned one."""
    return any(abs(a - b) >= SHIFT for a, b in zip(snap(now), snap(planned)))


class Adaptive:
    """Detection, background re-planning and plan switching for one training run (every rank has one)."""

    def __init__(self, cfg, spec: ModelSpec, world: int) -> None:
        self.cfg, self.spec, self.world = cfg, spec, world
        self.rank = dist.get_rank()
        self.clock = ComputeClock()
        self.injections = parse_injections(cfg.inject_slow, world)
        from plait.cost.measured import local_cost

        self.cluster, self.cal = local_cost(cfg.profile, world)
        self.window: deque[list[float]] = deque(maxlen=WINDOW)
        self.planned = [1.0] * world
        self.predicted: dict[str, list[float]] = {}
        self.pending: Future | None = None
        self.pending_factors: list[float] | None = None
        self.executor = ThreadPoolExecutor(1) if self.rank == 0 and cfg.adaptive else None
        self.replans: list[dict] = []  # rank 0: every re-plan, its factors and solver time
        self.collected: dict | None = None  # the re-plan collected in this step
        self._probe: tuple[torch.nn.Module, torch.Tensor] | None = None
        self.probes: dict[int, list[float]] = {}  # left-out rank -> its probe's raw factors since left out
        self.switch_record: dict | None = None  # the record of the switch under way
        self.directory: Path | None = None  # --switch-via dcp: where switches save and load
        if cfg.switch_via == "dcp":
            box = [tempfile.mkdtemp(prefix="plait-switch-") if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            self.directory = Path(box[0])

    # ---- every step ------------------------------------------------------------------------------------

    def before_step(self, step: int) -> None:
        for inj in self.injections:
            if inj.step == step and inj.rank == self.rank:
                self.clock.factor = inj.factor
        self.clock.busy = 0.0

    def probe(self) -> None:
        """A rank the plan leaves out: one sequence through the whole model, timed (seen recovering)."""
        from plait.models.mtp import next_token_kwargs
        from plait.runtime.train import loss_function

        if self._probe is None:
            from plait.models import build_model

            model = build_model(self.spec)
            model.init_weights(self.cfg.seed)
            plan = Plan.model_validate(self.cfg.plan)
            tokens = torch.randint(0, self.spec.vocab, (1, plan.seq_len + 1), generator=torch.Generator().manual_seed(0))
            self._probe = (model, tokens)
        model, tokens = self._probe
        with self.clock.compute():
            loss_function(self.spec, tokens.shape[1] - 1)(model(tokens[:, :-1], **next_token_kwargs(
                model, tokens[:, 1:])), tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    def after_step(self, step: int, placed, record: dict) -> Plan | None:
        """Gather every rank's compute time, update the speed estimate, start or collect a re-plan; returns
        the plan to switch to (the same on every rank), or None."""
        groups = waiting_groups(placed.plan)
        local = self.clock.local_speed() if groups else 0.0
        busy = torch.tensor([self.clock.busy, local], dtype=torch.float64)
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(gathered, busy)
        busy_by_rank = [float(t[0]) for t in gathered]
        factors = speed_factors(busy_by_rank, self._predicted(placed.plan))
        factors = attribute(factors, [float(t[1]) for t in gathered], groups)
        factors = self._calibrate_probes(factors, placed.plan)
        self.window.append(factors)
        record["compute_s"] = busy_by_rank
        estimate = [statistics.median(f[r] for f in self.window) for r in range(self.world)]
        record["speed"] = estimate
        if not self.cfg.adaptive:
            return None
        decision: list[str | None] = [None]
        if self.rank == 0:
            decision[0] = self._decide(placed.plan, estimate)
            if self.collected is not None:
                record["replan"], self.collected = self.collected, None
        dist.broadcast_object_list(decision, src=0)
        if decision[0] is None:
            return None
        new = Plan.model_validate_json(decision[0])
        record["switch"] = {"to": _describe(new), "plan": json.loads(decision[0]), "via": self.cfg.switch_via}
        self.switch_record = record["switch"]  # `switch` adds its seconds and the bytes sent over the network
        return new

    def _calibrate_probes(self, factors: list[float], plan: Plan) -> list[float]:
        """A left-out rank's factor from its probe, relative to the probe's own time when it was left out
        (at the factor it was left out for): the cost model prices a probe and a share of a plan with
        different accuracy, and this ratio needs none. The first probe (cold) is not counted; until
        `WINDOW` more have run, the rank keeps its planned factor."""
        used = set(plan.ranks)
        out = list(factors)
        for r in range(self.world):
            if r in used:
                self.probes.pop(r, None)
                continue
            seen = self.probes.setdefault(r, [])
            seen.append(factors[r])
            if len(seen) <= WINDOW:
                out[r] = self.planned[r]
            else:
                out[r] = self.planned[r] * factors[r] / statistics.median(seen[1: WINDOW + 1])
        return out

    def _decide(self, plan: Plan, estimate: list[float]) -> str | None:
        """Rank 0: start a re-plan on a shift, and hand out a finished one that differs from `plan`."""
        if self.pending is not None and self.pending.done():
            result, factors = self.pending.result(), self.pending_factors
            self.pending = None
            self.collected = self.replans[-1]
            self.planned = factors or self.planned
            self.window.clear()
            if result is not None and result != plan:
                return result.model_dump_json()
            return None
        if self.pending is None and len(self.window) == WINDOW and shifted(estimate, self.planned):
            self.pending_factors = snap(estimate)
            self.pending = self.executor.submit(self._replan, plan, self.pending_factors)
        return None

    def _replan(self, plan: Plan, factors: list[float]) -> Plan | None:
        """The straggler planner's plan for `factors` (None if it found none; the job goes on as it is)."""
        from plait.planner.straggler import plan_around_stragglers  # scipy's MILP: loaded on first use

        slow = {r: f for r, f in enumerate(factors) if f > 1.0}
        cluster = self.cluster.with_slow(slow) if slow else self.cluster
        t0 = time.perf_counter()
        try:
            result = plan_around_stragglers(self.spec, cluster, plan.seq_len, plan.global_batch,
                                            precision=plan.precision, cal=self.cal, current=plan,
                                            keep_degrees=self.cfg.replan_degrees == "keep", min_gain=MIN_GAIN,
                                            also=(Plan.model_validate(self.cfg.plan),))
        except Exception as exc:  # noqa: BLE001 -- a failed re-plan must not stop training
            self.replans.append({"factors": factors, "error": str(exc).splitlines()[0][:200]})
            return None
        self.replans.append({"factors": factors, "solve_time_s": time.perf_counter() - t0, "plan": result.label})
        return result.plan

    def _predicted(self, plan: Plan) -> list[float]:
        """Predicted compute seconds of every rank under `plan` on a healthy cluster (left-out ranks: the
        probe's)."""
        key = plan.model_dump_json()
        if key not in self.predicted:
            from plait.simulate import BUSY_KEYS, simulate

            report = simulate(plan, self.spec, self.cluster, cal=self.cal, validate=False)
            out = [0.0] * self.world
            for d in report.devices:
                for r in d.ranks:
                    out[r] = sum(d.parts.get(k, 0.0) for k in BUSY_KEYS)  # what a rank's compute clock covers
            probe = Plan(model=plan.model, seq_len=plan.seq_len, global_batch=1, precision=plan.precision,
                         pipelines=(Pipeline(stages=(Stage(layers=(0, self.spec.layers), ranks=(0,),
                                                           strategies=(Strategy(),)),),
                                             micro_batches=1, micro_batch_sequences=1),))
            probe_parts = simulate(probe, self.spec, self.cluster, cal=self.cal, validate=False).devices[0].parts
            probe_s = sum(probe_parts.get(k, 0.0) for k in BUSY_KEYS)
            used = set(plan.ranks)
            self.predicted[key] = [out[r] if r in used else probe_s for r in range(self.world)]
        return self.predicted[key]

    # ---- switching ---------------------------------------------------------------------------------------

    def switch(self, placed, new: Plan, done: int, build: Callable[[Plan], object]):
        """Build `new` and move the state of `placed` to its owners (over the network, or a DCP save and
        resharded load with `--switch-via dcp`); collective."""
        from plait.runtime import checkpoint, migrate

        t0 = time.perf_counter()
        if self.directory is None:
            fresh = build(new)
            built = time.perf_counter() - t0
            sent = torch.tensor([migrate.move(placed.chunks, placed.optimizers, fresh.chunks, fresh.optimizers)],
                                dtype=torch.float64)
            dist.all_reduce(sent)
            details = {"sent_bytes": int(sent)}
        else:
            path = checkpoint.save(self.directory, done, placed.chunks, placed.optimizers)
            t1 = time.perf_counter()
            fresh = build(new)
            built = time.perf_counter() - t1
            checkpoint.load(path, fresh.chunks, fresh.optimizers)
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            details = {}
        if self.switch_record is not None:  # seconds: rank 0's
            state_s = time.perf_counter() - t0 - built
            self.switch_record |= details | {"build_seconds": built, "state_seconds": state_s}
        self.window.clear()
        self.probes.clear()
        return fresh

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self.rank == 0 and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _describe(plan: Plan) -> str:
    """`3 pipeline(s), pp 1, tp 2,1,1, micro-batches 5,5,6, ranks 0,1,2,3` style summary (tp: each pipeline's
    first layer's)."""
    micro = ",".join(str(p.micro_batches) for p in plan.pipelines)
    tp = ",".join(str(p.stages[0].strategies[0].tp) for p in plan.pipelines)
    return (f"{len(plan.pipelines)} pipeline(s), pp {len(plan.pipelines[0].stages)}, tp {tp}, "
            f"micro-batches {micro}, ranks {','.join(map(str, plan.ranks))}")
