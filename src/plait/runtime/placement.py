"""Where a rank sits in a plan, and the process groups it needs.

Every rank builds every stage's DeviceMesh (dims dp, cp, tp over the stage's ranks, Megatron order) and
every pipeline group in the same order, because creating a process group is collective over the world.
What the runtime cannot execute yet is refused here, before any group is created.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.errors import PlaitError
from plait.executable import unsupported
from plait.plan import Plan, Strategy
from plait.spec.model import ModelSpec


@dataclass(frozen=True)
class Placement:
    """This rank's share of a plan."""

    rank: int
    pipeline: int
    group: int  # device group (stage position) in its pipeline
    pp: int  # device groups per pipeline
    chunks: tuple[int, ...]  # global chunk (stage) indices this rank runs, in model order
    strategy: Strategy
    dp_index: int
    cp_index: int
    tp_index: int
    mesh: DeviceMesh  # dims ("dp", "cp", "tp") over this device group's ranks
    pp_group: dist.ProcessGroup | None  # ranks with the same (dp, cp, tp) coordinate along the pipeline
    replica_group: dist.ProcessGroup | None  # ranks sharing this rank's weight shard (dp x cp), None if alone

    @property
    def weight_mesh(self) -> DeviceMesh:
        """The mesh whose ranks hold the same weights (data and context parallel) for FSDP/DDP: HSDP
        (replicate over dp, shard over cp) when both are > 1."""
        s = self.strategy
        if s.cp == 1:
            return self.mesh["dp"]
        return self.mesh["cp"] if s.dp == 1 else self.mesh["dp", "cp"]

    def sequence_slice(self, seq_len: int) -> tuple[int, int] | None:
        """The token positions this rank keeps under context parallelism (None without it)."""
        cp = self.strategy.cp
        if cp == 1:
            return None
        part = seq_len // cp
        return (self.cp_index * part, (self.cp_index + 1) * part)

    @property
    def first(self) -> bool:
        return self.chunks[0] == 0

    def last(self, plan: Plan) -> bool:
        return self.chunks[-1] == len(plan.pipelines[self.pipeline].stages) - 1


def check_executable(plan: Plan, model: ModelSpec, world_size: int) -> None:
    """Refuse, with one clear line, plans (or parts of plans) the runtime cannot execute yet."""
    if sorted(plan.ranks) != list(range(world_size)):
        raise PlaitError(f"the plan uses ranks {plan.ranks[0]}..{plan.ranks[-1]} ({len(plan.ranks)} ranks) but "
                         f"{world_size} were launched; launch --nproc {len(plan.ranks)} or re-plan")
    if plan.model != model.name:
        raise PlaitError(f"the plan was made for model {plan.model!r}, not {model.name!r}; give the same --model")
    reason = unsupported(plan, model)
    if reason:
        raise PlaitError(reason)


def place(plan: Plan, rank: int) -> Placement:
    """Build all groups (collectively) and return this rank's placement."""
    pipe = plan.pipelines[0]
    pp = len(pipe.stages) // plan.chunks
    mine = None
    meshes = []
    for d in range(pp):
        stage = pipe.stages[d]
        s = stage.strategies[0]
        ranks = torch.tensor(stage.ranks).view(s.dp, s.cp, s.tp)
        meshes.append(DeviceMesh("cpu" if not torch.cuda.is_available() else "cuda", ranks,
                                 mesh_dim_names=("dp", "cp", "tp")))
        if rank in stage.ranks:
            mine = d
    if mine is None:
        raise PlaitError(f"rank {rank} has no stage in the plan")
    stage = pipe.stages[mine]
    s = stage.strategies[0]
    idx = stage.ranks.index(rank)
    coords = (idx // (s.tp * s.cp), (idx // s.tp) % s.cp, idx % s.tp)
    pp_group = None
    if pp > 1:
        per_group = len(stage.ranks)
        for i in range(per_group):
            members = [pipe.stages[d].ranks[i] for d in range(pp)]
            group = dist.new_group(members)
            if i == idx:
                pp_group = group
    replica_group = None
    for d in range(pp):  # the dp x cp groups of every stage, created by every rank in the same order
        st = pipe.stages[d]
        tp = st.strategies[0].tp
        for i in range(tp):
            members = list(st.ranks[i::tp])
            group = dist.new_group(members) if len(members) > 1 else None
            if d == mine and i == idx % tp:
                replica_group = group
    chunks = tuple(range(mine, len(pipe.stages), pp))
    return Placement(rank, 0, mine, pp, chunks, s, *coords, meshes[mine], pp_group, replica_group)
