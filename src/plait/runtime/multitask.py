"""`plait train --tasks`: one training step of Spindle's waves on gloo subgroups.

The planner's schedule (`plait.planner.multitask`) becomes a list of units in stage order: layers lo..hi-1
of one task's module on one device group. Every rank runs the same list and does its part of each unit:

- forward, in order: the unit's input arrives from the group that produced it (each rank of the consuming
  group receives its rows from the ranks of the producing group that hold them: send/recv over the union of
  the two groups; nothing moves when the groups are the same), then the group runs the layers. Inside a
  group the runtime is plain data parallelism: the task's batch is split in row blocks over the group's
  ranks (simple and correct; the planner's tensor/context-parallel choice inside a group is not run);
- backward, in reverse: each unit's output gradient (summed over every unit that read it) runs back through
  its layers, and the input gradients go back to the producing ranks the way the activations came;
- gradients: every parameter is summed (all_reduce) over the ranks that ran it, so a shared module's
  gradient is summed across the groups of every task that used it; then one AdamW step.

Units of different groups in the same stage involve disjoint ranks and run at the same time. Every rank
builds the whole model from the seed and updates the parameters it runs; losses equal one process running
the tasks (`plait.runtime.multitask_model.reference_losses`) up to fp32 rounding. Not done: the planner's
strategies inside a group, overlapping the handoffs with compute, gradient clipping, checkpoints.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from plait.errors import PlaitError
from plait.runtime.loop import lr_at, step_optimizers, train_loop
from plait.runtime.multitask_model import TaskModel, batch, check_runnable, sink, stack_key
from plait.runtime.optim import make_optimizer
from plait.spec.tasks import TaskSet, load_tasks


@dataclass(frozen=True)
class Unit:
    """Layers lo..hi-1 of `module` for task number `task` on `ranks`, as op `op` of stage `stage`."""

    op: str
    task: int
    module: str
    lo: int
    hi: int
    ranks: tuple[int, ...]
    stage: int


@dataclass(frozen=True)
class MultitaskConfig:
    """Options of one `plait train --tasks` run (JSON: the launcher hands it to every rank)."""

    tasks: str
    units: list[dict]
    steps: int = 3
    seed: int = 0
    lr: float = 3e-4
    warmup: int = 2
    metrics_out: str | None = None
    timeout_s: float = 300.0
    checkpoint_dir: str | None = None  # not supported; train_loop reads it
    checkpoint_every: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def plan_units(self) -> list[Unit]:
        return [Unit(**{**u, "ranks": tuple(u["ranks"])}) for u in self.units]


def units_of(plan) -> list[Unit]:
    """The units of a `MultitaskPlan`'s schedule in stage order (an op split over stages continues its layers
    where the previous stage stopped)."""
    ops, tasks = plan.graph.ops, plan.tasks
    index = {t.name: i for i, t in enumerate(tasks.tasks)}
    start: dict[int, int] = {}
    seen: dict[tuple[str, str], int] = defaultdict(int)  # layers of (task, module) in earlier ops
    for i, op in enumerate(ops):
        start[i] = seen[op.task, op.module]
        seen[op.task, op.module] += op.layers
    done: dict[int, int] = defaultdict(int)
    units = []
    for s, stage in enumerate(plan.schedule.stages):
        for p in stage.placements:
            if p.layers == 0:
                continue
            op = ops[p.op]
            lo = start[p.op] + done[p.op]
            done[p.op] += p.layers
            units.append(Unit(op.name, index[op.task], op.module, lo, lo + p.layers, p.ranks, s))
    return units


def rows(total: int, parts: int, i: int) -> tuple[int, int]:
    """Rows [start, stop) of part i when `total` rows split in `parts` near-equal blocks (the first
    total % parts blocks one row longer)."""
    q, r = divmod(total, parts)
    first = i * q + min(i, r)
    return first, first + q + (i < r)


@dataclass
class Graph:
    """The units, where each unit reads from (unit indices; empty: the task's embedding) and which units end
    a task (apply its head)."""

    units: list[Unit]
    sources: list[list[int]]
    last: list[bool]


def check_units(tasks: TaskSet, units: list[Unit], world: int) -> Graph:
    """The dataflow between units; PlaitError when they do not fit `world` ranks or do not run every layer
    of every task's module once."""
    check_runnable(tasks)
    ends: dict[tuple[int, str, int], int] = {}
    for k, u in enumerate(units):
        t = tasks.tasks[u.task]
        if not u.ranks or max(u.ranks) >= world or min(u.ranks) < 0:
            raise PlaitError(f"op {u.op} runs on ranks {u.ranks[0]}-{u.ranks[-1]}, more than the {world} ranks "
                             f"launched; plan for {world} ranks or launch more (--nproc)")
        if len(u.ranks) > t.batch:
            raise PlaitError(f"op {u.op} runs on {len(u.ranks)} ranks but task {t.name!r} has batch {t.batch}; a "
                             "group needs a sample per rank: raise the batch or use fewer ranks")
        ends[u.task, u.module, u.hi] = k
    sources, last = [], []
    for k, u in enumerate(units):
        t = tasks.tasks[u.task]
        if u.lo > 0:
            wanted = [(u.task, u.module, u.lo)]
        else:
            wanted = [(u.task, s, len(tasks.module(s).stack)) for s in t.inputs_of(u.module)]
        missing = [w for w in wanted if w not in ends or ends[w] >= k]
        if missing:
            raise PlaitError(f"op {u.op} reads layers that no earlier op ran ({missing[0][1]} up to layer "
                             f"{missing[0][2]}); use the plan `plait multitask` makes for this task file")
        sources.append([ends[w] for w in wanted])
        last.append(u.module == sink(t) and u.hi == len(tasks.module(u.module).stack))
    return Graph(units, sources, last)


class Handoff:
    """Rows of one unit's output moved to the ranks of a consuming unit, and its gradient moved back."""

    def __init__(self, batch_rows: int, source: tuple[int, ...], target: tuple[int, ...]) -> None:
        self.pieces = []  # (sending rank, receiving rank, start, stop) in the batch's rows
        for i, p in enumerate(source):
            a = rows(batch_rows, len(source), i)
            for j, c in enumerate(target):
                b = rows(batch_rows, len(target), j)
                lo, hi = max(a[0], b[0]), min(a[1], b[1])
                if lo < hi:
                    self.pieces.append((p, c, lo, hi))
        self.source, self.target, self.batch = source, target, batch_rows

    def _offset(self, ranks: tuple[int, ...], rank: int) -> int:
        return rows(self.batch, len(ranks), ranks.index(rank))[0]

    def move(self, rank: int, held: Tensor | None, shape: tuple[int, ...], from_source: bool) -> Tensor | None:
        """Forward (`from_source`): `held` is this rank's rows of the source; returns its rows for the target
        (None when not a target rank). Backward: the same from target to source."""
        send_ranks, recv_ranks = (self.source, self.target) if from_source else (self.target, self.source)
        works, received = [], []
        for p, c, lo, hi in self.pieces:
            s, r = (p, c) if from_source else (c, p)
            if s == rank:
                off = self._offset(send_ranks, rank)
                piece = held[lo - off:hi - off]
                if r == rank:
                    received.append(piece.detach().clone())
                else:
                    works.append(dist.isend(piece.detach().contiguous(), r))
            elif r == rank:
                buf = torch.empty((hi - lo, *shape))
                works.append(dist.irecv(buf, s))
                received.append(buf)
        for w in works:
            w.wait()
        return torch.cat(received) if rank in recv_ranks else None


class MultitaskStepper:
    """One rank's part of every step of the plan (a `plait.runtime.loop.Stepper`)."""

    def __init__(self, cfg: MultitaskConfig, tasks: TaskSet) -> None:
        self.cfg, self.tasks = cfg, tasks
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.graph = check_units(tasks, cfg.plan_units(), world)
        self.model = TaskModel(tasks, cfg.seed)
        self.syncs = self._gradient_groups()
        self._optimizers = [make_optimizer(self.model.parameters(), cfg.lr)]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    def _owners(self) -> dict[int, set[int]]:
        """Parameter id -> the ranks that run it."""
        owners: dict[int, set[int]] = defaultdict(set)
        g, m = self.graph, self.model
        for k, u in enumerate(g.units):
            stack = m.stacks[stack_key(self.tasks, self.tasks.tasks[u.task], u.module)]
            params = [p for layer in stack[u.lo:u.hi] for p in layer.parameters()]
            if not g.sources[k]:
                params += list(m.embed[str(u.task)].parameters())
            if g.last[k]:
                params += list(m.head[str(u.task)].parameters())
            for p in params:
                owners[id(p)].update(u.ranks)
        return owners

    def _gradient_groups(self) -> list[tuple[tuple[int, ...], list[torch.nn.Parameter], object]]:
        """(ranks, their parameters, process group) for every set of ranks that runs some parameters; every
        rank creates every group, in the same order."""
        owners = self._owners()
        by_ranks: dict[tuple[int, ...], list[torch.nn.Parameter]] = defaultdict(list)
        for p in self.model.parameters():
            by_ranks[tuple(sorted(owners[id(p)]))].append(p)
        out = []
        for ranks in sorted(by_ranks):
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            out.append((ranks, by_ranks[ranks], group))
        return out

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int, record: dict) -> None:
        pass

    def save(self, done: int) -> None:
        pass

    def close(self) -> None:
        pass

    def _forward(self, step: int, log: list) -> tuple[dict, dict, Tensor]:
        g, m, r = self.graph, self.model, self.rank
        hidden = self.tasks.modules[0].stack[0].hidden
        tokens = [batch(self.tasks, i, step, self.cfg.seed) for i in range(len(self.tasks.tasks))]
        outs: dict[int, Tensor] = {}
        leaves: dict[tuple[int, int], Tensor] = {}
        losses = torch.zeros(len(self.tasks.tasks))
        for k, u in enumerate(g.units):
            t = self.tasks.tasks[u.task]
            for src in g.sources[k]:
                moved = Handoff(t.batch, g.units[src].ranks, u.ranks).move(r, outs.get(src), (t.seq_len, hidden), True)
                if moved is not None:
                    leaves[k, src] = moved.requires_grad_()
            if r not in u.ranks:
                continue
            t0 = time.time()
            a, b = rows(t.batch, len(u.ranks), u.ranks.index(r))
            mine = tokens[u.task][a:b]
            x = sum(leaves[k, s] for s in g.sources[k]) if g.sources[k] else m.embed_tokens(u.task, mine)
            y = m.layers(u.task, u.module, u.lo, u.hi, x)
            if g.last[k]:
                y = m.loss(u.task, y, mine) * ((b - a) / t.batch)  # the group's parts add up to the batch mean
                losses[u.task] += y.item()
            outs[k] = y
            log.append((k, "forward", t0, time.time()))
        return outs, leaves, losses

    def _backward(self, outs: dict, leaves: dict, log: list) -> None:
        g, r = self.graph, self.rank
        hidden = self.tasks.modules[0].stack[0].hidden
        grads: dict[int, Tensor] = {}
        for k in reversed(range(len(g.units))):
            u, t = g.units[k], self.tasks.tasks[g.units[k].task]
            if r in u.ranks:
                t0 = time.time()
                if g.last[k]:
                    outs[k].backward()
                else:
                    outs[k].backward(grads.pop(k))
                log.append((k, "backward", t0, time.time()))
            for src in reversed(g.sources[k]):
                leaf = leaves.get((k, src))
                back = Handoff(t.batch, g.units[src].ranks, u.ranks).move(
                    r, leaf.grad if leaf is not None else None, (t.seq_len, hidden), False)
                if back is not None:
                    grads[src] = grads[src] + back if src in grads else back

    def _sync_gradients(self) -> None:
        """Sum every parameter's gradient over the ranks that ran it; drop the others'."""
        for ranks, params, group in self.syncs:
            if self.rank not in ranks:
                for p in params:
                    p.grad = None
                continue
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if group is not None:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat, group=group)
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def train_step(self, step: int, t0: float) -> dict:
        log: list = []
        dist.barrier()
        start = time.time()
        outs, leaves, losses = self._forward(step, log)
        self._backward(outs, leaves, log)
        self._sync_gradients()
        step_optimizers(self._optimizers)
        dist.all_reduce(losses)
        logs: list = [None] * dist.get_world_size()
        dist.all_gather_object(logs, (start, log))
        seconds = time.perf_counter() - t0
        tokens = sum(t.batch * t.seq_len for t in self.tasks.tasks)
        return {"step": step, "loss": float(losses.sum()),
                "losses": {t.name: float(v) for t, v in zip(self.tasks.tasks, losses, strict=True)},
                "step_time_s": seconds, "tokens_per_s": tokens / seconds, "lr": lr_at(step, self.cfg),
                "timeline": timeline(self.graph.units, logs)}


def timeline(units: list[Unit], logs: list) -> list[dict]:
    """Every unit's forward and backward on its group, measured: from the first of its ranks to start to
    the last to end (seconds from the step's start on the earliest rank)."""
    origin = min(start for start, _ in logs)
    spans: dict[tuple[int, str], list[float]] = {}
    for _, log in logs:
        for k, phase, a, b in log:
            s = spans.setdefault((k, phase), [a, b])
            s[0], s[1] = min(s[0], a), max(s[1], b)
    order = sorted(spans, key=lambda key: spans[key][0])
    return [{"op": units[k].op, "phase": phase, "stage": units[k].stage, "ranks": list(units[k].ranks),
             "layers": [units[k].lo, units[k].hi], "start_s": spans[k, phase][0] - origin,
             "end_s": spans[k, phase][1] - origin} for k, phase in order]


def run(cfg: MultitaskConfig, report=None) -> list[dict]:
    """Train `cfg.steps` steps of the plan on this rank; rank 0 returns one metrics record per step."""
    torch.set_num_threads(1)
    stepper = MultitaskStepper(cfg, load_tasks(cfg.tasks))
    return train_loop(cfg, stepper, report=report)
