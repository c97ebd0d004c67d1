"""`plait train --tasks`: one training step of Spindle's waves on gloo subgroups.

The planner's schedule (`plait.planner.multitask`) becomes a list of units in stage order: layers lo..hi-1
of one task's module on one device group, with the strategy the planner priced for that group (its
degrees tp, sp, cp; the rest of the ranks split the rows). Every rank runs the same list and does its part:

- forward, in order: the unit's input arrives from the group that produced it: each rank of the consuming
  group receives its piece (rows and, under cp or sp, tokens: `plait.layout.Layout.piece`; the producer's
  hidden width: a module of another width projects it on its own ranks, as its first op) from the ranks of
  the producing group that hold it (`plait.layout.transfer`'s blocks, one send/recv per pair of ranks; a
  rank in both groups keeps what it has). The group then runs the layers: data parallel on the master
  weights, or with tensor/context parallelism as a parallel copy (`plait.runtime.multitask_groups`);
- backward, in reverse: each unit's output gradient (summed over every unit that read it) runs back through
  its layers, and the input gradients go back to the producing ranks the way the activations came;
- gradients: every parameter is summed (all_reduce) over the ranks that ran it, so a shared module's
  gradient is summed across the groups of every task that used it; clipped to the global norm `clip` (each
  parameter counted once, after its sum); then one AdamW step.

Units of different groups in the same stage involve disjoint ranks and run at the same time. Every rank
builds the whole model from the seed and updates the parameters it runs; losses equal one process running
the tasks (`plait.runtime.multitask_model.reference_steps`) up to fp32 rounding. Checkpoints (DCP) hold the
whole model by name, each parameter written by the ranks that run it, so a run resumes under any plan.
ZeRO, recomputation and offloading in the planner's strategies change memory only and are not run.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from plait.errors import PlaitError
from plait.layout import Block, Layout, transfer
from plait.plan import Strategy, strategy_problem
from plait.runtime import checkpoint
from plait.runtime.loop import lr_at, step_optimizers, train_loop
from plait.runtime.multitask_groups import GroupLayers, group_mesh
from plait.runtime.multitask_model import TaskModel, batch, check_runnable, head_key, sinks, stack_key
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
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_mode: str = "ulysses"

    @property
    def layout(self) -> Layout:
        """How the group holds the unit's activations: tp x cp ranks per row block, the rest data parallel."""
        return Layout(len(self.ranks) // (self.tp * self.cp), self.cp, self.tp, self.sp and self.tp > 1)


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
    clip: float = 1.0  # global gradient-norm clip, as `plait train` (0: none)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only after the last step
    resume_from: str | None = None  # a checkpoint directory (step-N) to start from, instead of the newest

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
            units.append(Unit(op.name, index[op.task], op.module, lo, lo + p.layers, p.ranks, s,
                              **_degrees(plan.curves[p.op].strategy(p.devices), p.devices)))
    return units


def _degrees(s: Strategy | None, devices: int) -> dict:
    """A unit's tp, sp, cp and cp_mode from the planner's strategy for its group (plain data parallelism
    when there is none, or when its degrees do not divide the group: a count the curve does not list)."""
    if s is None or devices % (s.tp * s.cp):
        return {}
    return {"tp": s.tp, "sp": s.sp and s.tp > 1, "cp": s.cp, "cp_mode": s.cp_mode}


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
        _check_strategy(u, t.batch, t.seq_len, tasks.module(u.module).stack[u.lo:u.hi])
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
        last.append(u.module in sinks(t) and u.hi == len(tasks.module(u.module).stack))
    return Graph(units, sources, last)


def _check_strategy(u: Unit, rows: int, seq_len: int, blocks) -> None:
    """PlaitError unless the unit's group can run its layers with its degrees on the task's batch."""
    n = len(u.ranks)
    if n % (u.tp * u.cp):
        raise PlaitError(f"op {u.op} has tp={u.tp} x cp={u.cp} on {n} ranks; the degrees must divide the "
                         "group's ranks")
    layout = u.layout
    if layout.dp > rows:
        raise PlaitError(f"op {u.op} splits {rows} rows over {layout.dp} data-parallel ranks; a group needs a "
                         "sample per row block: raise the batch or use fewer ranks")
    if u.tp * u.cp == 1:
        return
    s = Strategy(dp=layout.dp, tp=u.tp, sp=layout.sp, cp=u.cp, cp_mode=u.cp_mode)  # type: ignore[arg-type]
    for block in set(blocks):
        why = strategy_problem(s, block, n, rows, seq_len)
        if why:
            raise PlaitError(f"op {u.op}: {why}")


class Handoff:
    """One unit's output moved to the ranks of a consuming unit, each receiving its piece in the consumer's
    layout, and its gradient moved back: `plait.layout.transfer`'s blocks between the two groups' positions
    (a piece that tp ranks hold as copies is sent by one of them; in backward each copy gets it whole)."""

    def __init__(self, batch_rows: int, tokens: int, source: Unit, target: Unit) -> None:
        self.batch, self.tokens = batch_rows, tokens
        self.sides = ((source.ranks, source.layout), (target.ranks, target.layout))

    def pieces(self, forward: bool) -> list[tuple[int, int, Block]]:
        """(sending rank, receiving rank, block) of one direction (forward: source to target)."""
        (have_ranks, have), (want_ranks, want) = self.sides if forward else self.sides[::-1]
        return [(have_ranks[b.sender], want_ranks[b.receiver], b)
                for b in transfer(have, want, self.batch, self.tokens)]

    def move(self, rank: int, held: Tensor | None, hidden: int, forward: bool) -> Tensor | None:
        """Forward: `held` is this rank's piece of the source's output; returns its piece for the target
        (None when not a target rank). Backward: the same from target to source. One message per pair of
        ranks and direction."""
        (have_ranks, have), (want_ranks, want) = self.sides if forward else self.sides[::-1]
        sends: dict[int, list[Tensor]] = defaultdict(list)
        incoming: dict[int, list[Block]] = defaultdict(list)
        if rank in have_ranks:
            (b0, _), (t0, _) = have.piece(have_ranks.index(rank), self.batch, self.tokens)
        for s, r, b in self.pieces(forward):
            if s == rank:
                sends[r].append(held[b.batch[0] - b0:b.batch[1] - b0, b.tokens[0] - t0:b.tokens[1] - t0])
            if r == rank:
                incoming[s].append(b)
        works, buffers = [], {}
        for r, parts in sorted(sends.items()):
            flat = torch.cat([p.detach().reshape(-1) for p in parts])
            if r == rank:
                buffers[r] = flat
            else:
                works.append(dist.isend(flat, r))
        for s, blocks in sorted(incoming.items()):
            if s != rank:
                buffers[s] = torch.empty(sum(b.cells for b in blocks) * hidden)
                works.append(dist.irecv(buffers[s], s))
        for w in works:
            w.wait()
        if rank not in want_ranks:
            return None
        (b0, b1), (t0, t1) = want.piece(want_ranks.index(rank), self.batch, self.tokens)
        out = torch.empty((b1 - b0, t1 - t0, hidden))
        for s, blocks in incoming.items():
            offset = 0
            for b in blocks:
                size = b.cells * hidden
                out[b.batch[0] - b0:b.batch[1] - b0, b.tokens[0] - t0:b.tokens[1] - t0] = buffers[s][
                    offset:offset + size].view(b.batch[1] - b.batch[0], b.tokens[1] - b.tokens[0], hidden)
                offset += size
        return out


@dataclass(frozen=True)
class TasksIdentity:
    """What a checkpoint records of the task file it holds (`plait.runtime.checkpoint.save`'s model)."""

    name: str
    fingerprint: str

    @staticmethod
    def of(tasks: TaskSet) -> TasksIdentity:
        shape = repr(tuple((f.name, getattr(tasks, f.name)) for f in fields(tasks) if f.name != "name"))
        return TasksIdentity(f"task file {tasks.name}", hashlib.sha256(shape.encode()).hexdigest()[:16])


class MultitaskStepper:
    """One rank's part of every step of the plan (a `plait.runtime.loop.Stepper`)."""

    def __init__(self, cfg: MultitaskConfig, tasks: TaskSet) -> None:
        self.cfg, self.tasks = cfg, tasks
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.graph = check_units(tasks, cfg.plan_units(), world)
        self.model = TaskModel(tasks, cfg.seed)
        g = self.graph
        self.handoffs = {(k, src): Handoff(tasks.tasks[u.task].batch, tasks.tasks[u.task].seq_len, g.units[src], u)
                         for k, u in enumerate(g.units) for src in g.sources[k]}
        self.parallel = self._group_layers()
        self.syncs = self._gradient_groups()
        self._optimizers = [make_optimizer(self.model.parameters(), cfg.lr)]
        self.identity = TasksIdentity.of(tasks)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    def _group_layers(self) -> dict[int, GroupLayers]:
        """This rank's tensor/context-parallel copies of its units' layers, by unit index (every rank builds
        every such unit's mesh, in order)."""
        out = {}
        meshes: dict[tuple, object] = {}
        for k, u in enumerate(self.graph.units):
            if u.tp * u.cp == 1:
                continue
            if (u.ranks, u.layout) not in meshes:
                meshes[u.ranks, u.layout] = group_mesh(u.ranks, u.layout)
            mesh = meshes[u.ranks, u.layout]
            if self.rank in u.ranks:
                stack = self.model.stacks[stack_key(self.tasks, self.tasks.tasks[u.task], u.module)]
                out[k] = GroupLayers(list(stack[u.lo:u.hi]), u.layout, mesh, u.cp_mode,
                                     self.tasks.tasks[u.task].seq_len)
        return out

    def _owners(self) -> dict[int, set[int]]:
        """Parameter id -> the ranks that run it."""
        owners: dict[int, set[int]] = defaultdict(set)
        g, m = self.graph, self.model
        for k, u in enumerate(g.units):
            stack = m.stacks[stack_key(self.tasks, self.tasks.tasks[u.task], u.module)]
            params = [p for layer in stack[u.lo:u.hi] for p in layer.parameters()]
            if not g.sources[k]:
                params += list(m.embed[str(u.task)].parameters())
            if u.lo == 0:
                params += [p for proj in m.projections(u.task, u.module) for p in proj.parameters()]
            if g.last[k]:
                params += list(m.head[head_key(self.tasks, self.tasks.tasks[u.task], u.module)].parameters())
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
        """A DCP checkpoint of the whole model and optimizer: each parameter written by the ranks that run it
        (the others' copies are stale)."""
        mine = {id(p) for ranks, params, _ in self.syncs if self.rank in ranks for p in params}
        names = {name for name, p in self.model.named_parameters() if id(p) in mine}
        every = {name for name, _ in self.model.named_parameters()}
        checkpoint.save(self.cfg.checkpoint_dir, done, [self.model], self._optimizers, self.identity,  # type: ignore[arg-type]
                        keep=lambda name: name in names or name not in every)

    def resume(self) -> int:
        """Load the checkpoint to start from (as `plait train`); the steps it was saved after (0: none)."""
        from plait.runtime.train import resume

        return resume(self.cfg, self.identity, [self.model], self._optimizers, self.rank)  # type: ignore[arg-type]

    def close(self) -> None:
        pass

    def _forward(self, step: int, log: list) -> tuple[dict, dict, Tensor]:
        g, m, r = self.graph, self.model, self.rank
        tokens = [batch(self.tasks, i, step, self.cfg.seed) for i in range(len(self.tasks.tasks))]
        outs: dict[int, Tensor] = {}
        leaves: dict[tuple[int, int], Tensor] = {}
        losses = torch.zeros(len(self.tasks.tasks))
        for k, u in enumerate(g.units):
            t = self.tasks.tasks[u.task]
            for src in g.sources[k]:
                produced = self.tasks.width(g.units[src].module)  # hands over the producer's width
                moved = self.handoffs[k, src].move(r, outs.get(src), produced, True)
                if moved is not None:
                    leaves[k, src] = moved.requires_grad_()
            if r not in u.ranks:
                continue
            t0 = time.time()
            (a, b), span = u.layout.piece(u.ranks.index(r), t.batch, t.seq_len)
            mine = tokens[u.task][a:b]
            weight = 1.0 / u.layout.copies  # tp ranks holding copies share edges' and projections' gradients
            inputs = ([leaves[k, s] for s in g.sources[k]] if g.sources[k]
                      else [m.embed_tokens(u.task, mine, span, weight)])
            x = m.enter(u.task, u.module, inputs, weight)  # the producers' widths, projected to the module's
            y = self.parallel[k](x) if k in self.parallel else m.layers(u.task, u.module, u.lo, u.hi, x)
            if g.last[k]:  # the group's pieces add up to the batch mean
                share = (b - a) * (span[1] - span[0]) / (t.batch * t.seq_len)
                y = m.loss(u.task, u.module, y, mine, span, weight) * share
                losses[u.task] += y.item() * weight
            outs[k] = y
            log.append((k, "forward", t0, time.time()))
        return outs, leaves, losses

    def _backward(self, outs: dict, leaves: dict, log: list) -> None:
        g, r = self.graph, self.rank
        grads: dict[int, Tensor] = {}
        for k in reversed(range(len(g.units))):
            u = g.units[k]
            if r in u.ranks:
                t0 = time.time()
                if g.last[k]:
                    outs[k].backward()
                else:
                    outs[k].backward(grads.pop(k))
                log.append((k, "backward", t0, time.time()))
            for src in reversed(g.sources[k]):
                leaf = leaves.get((k, src))
                back = self.handoffs[k, src].move(r, leaf.grad if leaf is not None else None,
                                                  self.tasks.width(g.units[src].module), False)
                if back is not None:
                    grads[src] = grads[src] + back if src in grads else back
        for k in sorted(self.parallel):  # every rank of a group in the same order
            self.parallel[k].fold_gradients()

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

    def _clip(self) -> float:
        """Clip every gradient to the global norm `cfg.clip` (as `torch.nn.utils.clip_grad_norm_` in one
        process): each parameter counted once, by the first rank that runs it; returns the norm before."""
        square = torch.zeros((), dtype=torch.float64)
        for ranks, params, _ in self.syncs:
            if ranks[0] == self.rank:
                square += torch.nn.utils.get_total_norm([p.grad for p in params]).double() ** 2
        dist.all_reduce(square)
        norm = square.sqrt().float()
        if self.cfg.clip > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in self.model.parameters() if p.grad is not None],
                                                 self.cfg.clip, norm)
        return float(norm)

    def train_step(self, step: int, t0: float) -> dict:
        log: list = []
        for layers in self.parallel.values():
            layers.refresh()
        dist.barrier()
        start = time.time()
        outs, leaves, losses = self._forward(step, log)
        self._backward(outs, leaves, log)
        self._sync_gradients()
        grad_norm = self._clip()
        step_optimizers(self._optimizers)
        dist.all_reduce(losses)
        logs: list = [None] * dist.get_world_size()
        dist.all_gather_object(logs, (start, log))
        seconds = time.perf_counter() - t0
        tokens = sum(t.batch * t.seq_len for t in self.tasks.tasks)
        return {"step": step, "loss": float(losses.sum()),
                "losses": {t.name: float(v) for t, v in zip(self.tasks.tasks, losses, strict=True)},
                "grad_norm": grad_norm, "step_time_s": seconds, "tokens_per_s": tokens / seconds,
                "lr": lr_at(step, self.cfg), "timeline": timeline(self.graph.units, logs)}


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
    return train_loop(cfg, stepper, start=stepper.resume(), report=report)
