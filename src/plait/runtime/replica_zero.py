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
"""

from __future__ import annotations

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
        sizes = [_bounds(_local(p).numel(), self.members, 0)[2] for p in self.params]
        mine = torch.zeros(sum(sizes), dtype=_local(self.params[0]).dtype)
        at = 0
        for p, size in zip(self.params, sizes):
            start, end, _ = _bounds(_local(p).numel(), self.members, self.index)
            mine[at: at + end - start] = _local(p).detach().reshape(-1)[start:end]
            at += size
        parts = [torch.empty_like(mine) for _ in range(self.members)]
        dist.all_gather(parts, mine, group=self.group)
        with torch.no_grad():
            for i, part in enumerate(parts):
                at = 0
                for p, size in zip(self.params, sizes):
                    start, end, _ = _bounds(_local(p).numel(), self.members, i)
                    if i != self.index and end > start:
                        _local(p).view(-1)[start:end].copy_(part[at: at + end - start])
                    at += size
        for p in self.params:
            p.grad = None


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
        parts += [(layers, m) for m in (model.norm, model.output) if m is not None]
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


def attach(optimizer: torch.optim.Optimizer, shards: list[ReplicaShards]) -> None:
    """Load the slices' gradients before `optimizer` steps, gather the slices after."""
    if not shards:
        return

    def before(*_: object) -> None:
        for s in shards:
            s.load_grads()

    def after(*_: object) -> None:
        for s in shards:
            s.gather()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
