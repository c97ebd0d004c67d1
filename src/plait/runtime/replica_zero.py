"""ZeRO-1 over the pipelines: the optimizer state of a layer that every pipeline holds in the same shape with
ZeRO is split among its replicas across pipelines (`plait.runtime.placement.Replicas`), as the cost model
prices it (`plait.simulate._dp_ranks`: the data group of a layer spans every pipeline).

After the cross-pipeline gradient reduction every member of the replica group R has the same (weighted,
summed) gradient of its local shard. Each member steps only its 1/|R| slice of every such tensor (a view into
the parameter, so AdamW's moments exist for that slice alone), then the slices are all-gathered back into
the parameters: one `all_gather` per group and optimizer step. AdamW is elementwise, so the update equals
the whole-tensor one.

The gradients stay whole until the step (the pipelines run different micro-batch counts, so their gradients
meet once per step, after the last backward): ZeRO-2 and ZeRO-3 across pipelines hold what ZeRO-1 holds.
Layers whose holders shard them differently (`Replicas.whole`) keep their whole optimizer state.

Checkpoints and plan switches name optimizer state by parameter (`plait.runtime.checkpoint.local_state`):
they see a stand-in optimizer holding each sliced parameter's whole moments, all-gathered from its holders
for the save or switch alone (`whole_view`), and loading hands every holder its slice again (`load_whole`),
so a run saved under one layout of holders resumes or switches to any other.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.plan import Plan
from plait.runtime.placement import Placement, Replicas


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bounds(numel: int, members: int, index: int) -> tuple[int, int, int]:
    """(start, end, padded length) of member `index`'s slice of a flat tensor of `numel` elements."""
    size = -(-numel // members)
    start = min(index * size, numel)
    return start, min(start + size, numel), size


@dataclass
class ReplicaShards:
    """The parameters (this rank's local shards) whose optimizer state the ranks of `group` split, and the
    slice of each that this rank steps (`slices`: views into the parameters; empty slices left out)."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup

    def __post_init__(self) -> None:
        self.members = dist.get_world_size(self.group)
        self.index = dist.get_rank(self.group)
        self.slices: list[nn.Parameter] = []
        self._owned: list[tuple[nn.Parameter, nn.Parameter]] = []
        for p in self.params:
            start, end, _ = _bounds(_local(p).numel(), self.members, self.index)
            if end > start:
                view = nn.Parameter(_local(p).detach().view(-1)[start:end], requires_grad=False)
                self.slices.append(view)
                self._owned.append((p, view))

    @property
    def owned(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(parameter, this rank's slice of it) of every non-empty slice."""
        return self._owned

    def load_grads(self) -> None:
        """Give each slice its part of the parameter's reduced gradient (a view, before the step)."""
        for p, view in self._owned:
            start, end, _ = _bounds(_local(p).numel(), self.members, self.index)
            view.grad = None if p.grad is None else _local(p.grad).reshape(-1)[start:end]

    def gather(self) -> None:
        """All-gather every member's stepped slices into the parameters, then drop the whole gradients."""
        mine = [_local(p).detach().reshape(-1)[slice(*_bounds(_local(p).numel(), self.members, self.index)[:2])]
                for p in self.params]
        with torch.no_grad():
            for p, whole in zip(self.params, self.all_gather(mine)):
                _local(p).view(-1).copy_(whole)
        for p in self.params:
            p.grad = None

    def all_gather(self, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every member's slices put together (collective over the group): `mine` holds this member's slice
        of each parameter's flat local tensor (or of a tensor shaped like it); the whole flat tensors."""
        sizes = [_bounds(_local(p).numel(), self.members, 0)[2] for p in self.params]
        flat = torch.zeros(sum(sizes), dtype=mine[0].dtype if mine else _local(self.params[0]).dtype)
        at = 0
        for part, size in zip(mine, sizes):
            flat[at: at + part.numel()] = part
            at += size
        parts = [torch.empty_like(flat) for _ in range(self.members)]
        dist.all_gather(parts, flat, group=self.group)
        out, at = [], 0
        for p, size in zip(self.params, sizes):
            numel = _local(p).numel()
            out.append(torch.cat([part[at: at + end - start] for i, part in enumerate(parts)
                                  for start, end, _ in [_bounds(numel, self.members, i)]]))
            at += size
        return out

    def slice_of(self, p: nn.Parameter) -> slice:
        """This member's part of `p`'s flat local tensor."""
        return slice(*_bounds(_local(p).numel(), self.members, self.index)[:2])


def replica_shards(chunks: list[nn.Module], where: Placement, plan: Plan, layers: int) -> list[list[ReplicaShards]]:
    """For each chunk: the parameters of its layers (embedding -1, head `layers`) that several pipelines hold
    alike under ZeRO, grouped by replica group in model order (the same order on every member)."""
    stages = plan.pipelines[where.pipeline].stages
    out: list[list[ReplicaShards]] = []
    seen: set[int] = set()
    for model, chunk in zip(chunks, where.chunks):
        stage = stages[chunk.index]
        parts = [(-1, m) for m in (model.tok_embeddings, model.pos_embeddings) if m is not None]
        parts += [(int(name), block) for name, block in model.layers.items()]
        parts += [(layers, m) for m in model.head_modules]
        by_group: dict[Replicas, list[nn.Parameter]] = {}
        for key, module in parts:
            r = where.replicas.get(key)
            zero = stage.strategy(min(max(key, stage.layers[0]), stage.layers[1] - 1)).zero
            if r is None or r.group is None or r.whole or zero < 1:
                continue
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    by_group.setdefault(r, []).append(p)
        out.append([ReplicaShards(params, r.group) for r, params in by_group.items()])  # type: ignore[arg-type]
    return out


def optimizer_params(model: nn.Module, shards: list[ReplicaShards]) -> list[nn.Parameter]:
    """What a chunk's optimizer steps: its parameters, each sliced one replaced by this rank's slice."""
    sliced = {id(p) for s in shards for p in s.params}
    return [p for p in model.parameters() if id(p) not in sliced] + [v for s in shards for v in s.slices]


SHARDS = "_plait_replica_shards"
"""The attribute of an optimizer that steps slices: its `ReplicaShards`."""


def attach(optimizer: torch.optim.Optimizer, shards: list[ReplicaShards]) -> None:
    """Load the slices' gradients before `optimizer` steps, gather the slices after."""
    if not shards:
        return
    setattr(optimizer, SHARDS, shards)

    def before(*_: object) -> None:
        for s in shards:
            s.load_grads()

    def after(*_: object) -> None:
        for s in shards:
            s.gather()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-element state, which a member keeps for its slice alone."""


def _fresh(p: torch.Tensor) -> dict:
    """AdamW's state of a parameter before its first step (what its lazy initialisation makes)."""
    return {"step": torch.tensor(0.0), **{k: torch.zeros_like(p) for k in MOMENTS}}


def _as(p: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A whole local tensor shaped and placed like `p` (a DTensor for a DTensor parameter)."""
    local = local.view_as(_local(p))
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return local


def whole_view(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer as checkpoints and plan switches name it (`plait.runtime.checkpoint.local_state`): itself,
    or, when it steps slices (`attach`), a stand-in AdamW over `model`'s parameters holding their whole
    state: each sliced parameter's moments all-gathered from its replica group (collective), the others'
    state shared with `optimizer`. State not made yet is AdamW's initial state."""
    shards: list[ReplicaShards] = getattr(optimizer, SHARDS, [])
    if not shards:
        return optimizer
    accepted = inspect.signature(type(optimizer)).parameters
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    view = type(optimizer)(list(model.parameters()), **{k: v for k, v in group.items() if k in accepted})
    view.param_groups[0].update(group)
    sliced = {id(p) for s in shards for p in s.params}
    for p in model.parameters():
        if id(p) not in sliced:
            view.state[p] = optimizer.state[p] = optimizer.state.get(p) or _fresh(p)
    for s in shards:
        owned = {id(p): v for p, v in s._owned}
        states = [optimizer.state.get(owned[id(p)]) if id(p) in owned else None for p in s.params]
        states = [st or _fresh(owned[id(p)]) if id(p) in owned else None for p, st in zip(s.params, states)]
        steps = torch.tensor([float(st["step"]) if st else -1.0 for st in states])
        every = [torch.empty_like(steps) for _ in range(s.members)]
        dist.all_gather(every, steps, group=s.group)
        step = torch.stack(every).amax(0)
        moments = {k: s.all_gather([st[k] if st else torch.zeros(0) for st in states]) for k in MOMENTS}
        for i, p in enumerate(s.params):
            view.state[p] = {"step": step[i].clone(), **{k: _as(p, moments[k][i]) for k in MOMENTS}}
    return view


def load_whole(view: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """After `view` (from `whole_view`) was loaded: give `optimizer` its hyperparameters and each sliced
    parameter's slice of the loaded moments (the rest it shares with `view`)."""
    if view is optimizer:
        return
    for key, value in view.param_groups[0].items():
        if key != "params":
            optimizer.param_groups[0][key] = value
    shards: list[ReplicaShards] = getattr(optimizer, SHARDS)
    sliced = {id(p) for s in shards for p in s.params}
    for p in view.param_groups[0]["params"]:
        if id(p) not in sliced:
            optimizer.state[p] = view.state[p]
    for s in shards:
        owned = {id(p): v for p, v in s._owned}
        for p in s.params:
            if id(p) in owned:
                st = view.state[p]
                optimizer.state[owned[id(p)]] = {
                    "step": st["step"].clone(),
                    **{k: _local(st[k]).detach().reshape(-1)[s.slice_of(p)].clone() for k in MOMENTS}}
