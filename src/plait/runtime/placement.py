"""Where a rank sits in a plan, and the process groups it needs.

A rank runs one or more chunks (pipeline stages; several with interleaving). A chunk is cut into segments,
runs of consecutive layers with the same strategy; each segment has a DeviceMesh (dims dp, cp, tp over the
stage's ranks, Megatron order) and, for hand-synced gradients, a group of the ranks that share its weights.
Creating a process group is collective over the world, so every rank builds every stage's groups in the
same order. What the runtime cannot execute yet is refused before any group is created.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.errors import PlaitError
from plait.executable import holders, shard_shape, tied_copies, tied_ends_alike, unsupported
from plait.layout import Layout
from plait.plan import Plan, Strategy
from plait.spec.degrees import MESH_DIMS, Degrees

EXPERT_MESH_DIMS = ("edp", "ep", "etp")
"""Names of the device-mesh dimensions of an MoE layer's experts, slowest first (Megatron's order)."""
from plait.spec.model import ModelSpec

HSDP_MESH_DIMS = ("replicate", "shard", "tp")
"""Names of a stage's HSDP mesh dimensions, slowest first: shard groups of consecutive data-parallel ranks."""


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups for the MoE layers of a segment (Megatron's parallel folding over the stage's
    ranks, `Degrees.expert_group`)."""

    mesh: DeviceMesh | None  # dims ("edp", "ep", "etp") over the stage's ranks; None when the stage is one rank
    stage: DeviceMesh | None  # the stage's ranks as one dimension ("stage"), for ZeRO on the router and
    # shared experts; None when the stage is one rank
    edp: dist.ProcessGroup | None  # ranks holding the same expert shards (their gradients' reduction), None if
    # alone
    sequence: dist.ProcessGroup | None  # ranks holding parts of the same sequences (cp x sp), None if whole


@dataclass(frozen=True)
class Segment:
    """Consecutive layers [start, end) of a chunk that share one strategy, with this rank's groups for it."""

    layers: tuple[int, int]
    strategy: Strategy
    position: int  # this rank's index in the stage's rank list
    mesh: DeviceMesh  # dims ("dp", "cp", "tp") over the stage's ranks
    replica_group: dist.ProcessGroup | None  # ranks sharing this rank's weight shard (dp x cp), None if alone
    experts: ExpertGroups | None = None  # groups of the segment's MoE layers (None: it has none)
    hsdp: DeviceMesh | None = None  # HSDP (shard < dp*cp): dims ("replicate", "shard", "tp") over the stage's
    # ranks, the root of this segment's ZeRO and tensor-parallel meshes; None without HSDP

    @property
    def layout(self) -> Layout:
        return Layout.of(self.strategy)

    @property
    def weight_mesh(self) -> DeviceMesh:
        """The mesh whose ranks hold the same weights (data and context parallel) for FSDP/DDP: with a shard
        group (`hsdp`), FSDP2's HSDP mesh ("replicate", "shard"); else HSDP (replicate over dp, shard over cp)
        when both are > 1."""
        s = self.strategy
        if self.hsdp is not None:
            return self.hsdp["replicate", "shard"]
        if s.cp == 1:
            return self.mesh["dp"]
        return self.mesh["cp"] if s.dp == 1 else self.mesh["dp", "cp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The tensor-parallel mesh (under HSDP a dim of `hsdp`: FSDP2 needs its mesh and TP's to share a
        root mesh)."""
        return (self.hsdp if self.hsdp is not None else self.mesh)["tp"]

    def batch_rows(self, sequences: int) -> tuple[int, int]:
        """(first, count) of this rank's sequences in a micro-batch of `sequences`."""
        dp_index = self.layout.coords(self.position)[0]
        count = sequences // self.strategy.dp
        return dp_index * count, count

    def sequence_slice(self, seq_len: int) -> tuple[int, int] | None:
        """The token positions this rank keeps under context parallelism (None without it)."""
        cp = self.strategy.cp
        if cp == 1:
            return None
        cp_index = self.layout.coords(self.position)[1]
        part = seq_len // cp
        return (cp_index * part, (cp_index + 1) * part)


@dataclass(frozen=True)
class Replicas:
    """The ranks one layer's gradients are reduced over across pipelines. When every pipeline holds the layer
    in the same shape (`shard_shape`), the ranks holding this rank's shard (`whole` False); otherwise every
    holder in every pipeline (`whole`), each reducing the whole gradient, of which `copies` ranks of this
    rank's pipeline hold one."""

    group: dist.ProcessGroup | None  # None: this rank alone
    whole: bool = False
    copies: int = 1


@dataclass(frozen=True)
class Chunk:
    """One pipeline stage of the model on this rank."""

    index: int  # stage index in the pipeline, in model order
    ranks: tuple[int, ...]
    position: int
    segments: tuple[Segment, ...]
    group: dist.ProcessGroup | None  # all ranks of the stage (for re-layouts), None if alone
    input_layout: Layout | None  # layout of the hidden state the previous stage hands over (None: embedding)


@dataclass(frozen=True)
class Placement:
    """This rank's share of a plan (no chunks: the plan leaves this rank out)."""

    rank: int
    pipeline: int
    group: int  # device group (stage position) in its pipeline
    pp: int  # device groups per pipeline
    chunks: tuple[Chunk, ...]  # the stages this rank runs, in model order
    pp_group: dist.ProcessGroup | None  # ranks at the same position of every device group along the pipeline
    # (stages of different widths: every rank of the pipeline)
    tied_group: dist.ProcessGroup | None  # first- and last-stage ranks at this position, when they share weights
    replicas: dict[int, Replicas] = field(default_factory=dict)  # several pipelines: layer -> the ranks its
    # gradients are reduced over across pipelines (layer -1: the embedding, layers: the head)
    tied_whole: float | None = None  # the ends of the pipeline lay a tied table out differently: the weight of
    # this rank's whole gradient in the sum over `tied_group` (1 / its stage's ranks; 1 with no group: a
    # stage that holds both copies sums them on each rank); None: shard by shard
    norm_share: float = 1.0  # weight of this rank's squared gradient norm in the sum over `pp_group` (1 / the
    # stage's ranks when that group holds every rank of the pipeline: each of them has the stage's whole norm)

    @property
    def idle(self) -> bool:
        return not self.chunks

    @property
    def first(self) -> bool:
        return self.chunks[0].index == 0

    def last(self, plan: Plan) -> bool:
        return self.chunks[-1].index == len(plan.pipelines[self.pipeline].stages) - 1

    @property
    def input_segment(self) -> Segment:
        """The segment that embeds the tokens (meaningful on the first stage)."""
        return self.chunks[0].segments[0]

    @property
    def output_segment(self) -> Segment:
        """The segment that computes the logits and the loss (meaningful on the last stage)."""
        return self.chunks[-1].segments[-1]


def check_executable(plan: Plan, model: ModelSpec, world_size: int) -> None:
    """Refuse, with one clear line, plans (or parts of plans) the runtime cannot execute yet."""
    if plan.ranks[-1] >= world_size:
        raise PlaitError(f"the plan uses ranks {plan.ranks[0]}..{plan.ranks[-1]} ({len(plan.ranks)} ranks) but "
                         f"{world_size} were launched; launch --nproc {plan.ranks[-1] + 1} or re-plan")
    if plan.model != model.name:
        raise PlaitError(f"the plan was made for model {plan.model!r}, not {model.name!r}; give the same --model")
    reason = unsupported(plan, model)
    if reason:
        raise PlaitError(reason)


class _Groups:
    """Process groups and meshes built once per distinct set of ranks (collective, same order everywhere)."""

    def __init__(self) -> None:
        self.meshes: dict[tuple, DeviceMesh] = {}
        self.groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        key = tuple(sorted(ranks))
        if key not in self.groups:
            self.groups[key] = dist.new_group(list(key)) if len(key) > 1 else None
        return self.groups[key]

    def experts(self, ranks: tuple[int, ...], strategy: Strategy, position: int) -> ExpertGroups:
        """The expert groups of `position` in a stage, after building those of every position."""
        degrees = strategy.degrees
        mesh = stage = None
        if len(ranks) > 1:
            grid = torch.tensor(ranks).view(degrees.edp, degrees.ep, degrees.etp)
            mesh = self.named_mesh(grid, EXPERT_MESH_DIMS)
            stage = self.named_mesh(torch.tensor(ranks), ("stage",))
        split = degrees.cp * degrees.tp if strategy.sp or degrees.cp > 1 else 1
        shards = degrees.ep * degrees.etp  # positions 0..shards-1 hold every (ep, etp) shard once
        edp = [self.group(degrees.expert_group(ranks, "edp", i)) for i in range(shards)]
        sequence = [self.group(ranks[i: i + split]) for i in range(0, len(ranks), split)]
        return ExpertGroups(mesh, stage, edp[position % shards], sequence[position // split])

    def named_mesh(self, grid: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
        """A device mesh of the ranks in `grid` with dimension `names`, built once."""
        key = (tuple(grid.flatten().tolist()), tuple(grid.shape), names)
        if key not in self.meshes:
            self.meshes[key] = DeviceMesh(self.meshes_device(), grid, mesh_dim_names=names)
        return self.meshes[key]

    @staticmethod
    def meshes_device() -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def mesh(self, ranks: tuple[int, ...], degrees: Degrees) -> DeviceMesh:
        key = (ranks, degrees)
        if key not in self.meshes:
            grid = torch.tensor(ranks).view(*degrees.mesh_shape)
            self.meshes[key] = DeviceMesh(self.meshes_device(), grid, mesh_dim_names=MESH_DIMS)
            for i in range(degrees.tp):  # the dp x cp groups that share a weight shard
                self.group(degrees.group(ranks, "data", i))
        return self.meshes[key]

    def hsdp_mesh(self, ranks: tuple[int, ...], degrees: Degrees) -> DeviceMesh | None:
        """HSDP's mesh of a stage (`Degrees.split_data`): dims ("replicate", "shard", "tp"), consecutive runs
        of `shard` data-parallel ranks sharding; None without a shard group smaller than dp*cp."""
        if degrees.replicas == 1:
            return None
        grid = torch.tensor(ranks).view(degrees.replicas, degrees.shard_size, degrees.tp)
        return self.named_mesh(grid, HSDP_MESH_DIMS)


def _segments(stage_layers: tuple[int, int], strategies: list[tuple[Strategy, int]]) -> list[tuple[tuple[int, int], Strategy]]:
    out, start = [], stage_layers[0]
    for strategy, count in strategies:
        out.append(((start, start + count), strategy))
        start += count
    return out


def place(plan: Plan, rank: int, tied_embeddings: bool = False, expert_layers: frozenset[int] = frozenset()
          ) -> Placement:
    """Build all groups (collectively) and return this rank's placement. With `tied_embeddings` and
    several stages (or one that lays them out differently, `tied_copies`), the first stage's embedding and
    the last stage's head (or multi-token-prediction modules' table, `plait.models.mtp`) are copies of one
    weight whose gradients are summed over the tied groups (Megatron's embedding group). With several
    pipelines, each
    layer's gradients are also reduced over the ranks that hold its shard in every pipeline (`replicas`).
    Segments holding any of `expert_layers` (MoE layers) get their expert groups."""
    groups = _Groups()
    mine: Placement | None = None
    for pi, pipe in enumerate(plan.pipelines):
        where = _place_in(plan, pi, rank, groups, tied_embeddings, expert_layers)
        if where is not None:
            mine = where
    replicas = _replica_groups(plan, rank, groups) if len(plan.pipelines) > 1 else {}
    if mine is None:
        return Placement(rank, -1, 0, 0, (), None, None)
    return replace(mine, replicas=replicas)


def _place_in(plan: Plan, pi: int, rank: int, groups: _Groups, tied_embeddings: bool,
              expert_layers: frozenset[int]) -> Placement | None:
    """Build pipeline `pi`'s groups (collectively); this rank's placement in it, or None."""
    pipe = plan.pipelines[pi]
    pp = len(pipe.stages) // plan.chunks
    own = plan.own_schedule(pi)
    chunks: list[Chunk] = []
    previous: Layout | None = None
    for j, stage in enumerate(pipe.stages):
        segments = []
        for layers, strategy in _segments(stage.layers, stage.layer_strategies()):
            degrees = strategy.degrees
            mesh = groups.mesh(stage.ranks, degrees)
            hsdp = groups.hsdp_mesh(stage.ranks, degrees)
            position = stage.ranks.index(rank) if rank in stage.ranks else 0
            experts = groups.experts(stage.ranks, strategy, position) if expert_layers.intersection(
                range(*layers)) else None
            if rank in stage.ranks:
                replica = groups.group(degrees.group(stage.ranks, "data", position))
                segments.append(Segment(layers, strategy, position, mesh, replica, experts, hsdp))
        stage_group = groups.group(stage.ranks)
        if own and previous is not None:  # the boundary hands over this stage's own layout
            previous = Layout.of(stage.strategy(stage.layers[0]))
        if rank in stage.ranks:
            chunks.append(Chunk(j, stage.ranks, stage.ranks.index(rank), tuple(segments), stage_group, previous))
        previous = Layout.of(stage.strategy(stage.layers[1] - 1))
    pp_group = None
    position = chunks[0].position if chunks else -1
    norm_share = 1.0
    if own:  # the runtime's own schedule: one group over the whole pipeline
        pp_group = dist.new_group(sorted({r for stage in pipe.stages for r in stage.ranks}))
        norm_share = 1 / len(chunks[0].ranks) if chunks else 1.0
    elif pp > 1:  # its own groups: pipeline sends must not queue behind a stage's collectives
        for i in range(len(pipe.stages[0].ranks)):
            group = dist.new_group(sorted(pipe.stages[d].ranks[i] for d in range(pp)))
            if i == position:
                pp_group = group
    tied_group, tied_whole = None, None
    if tied_embeddings and len(pipe.stages) == 1 and tied_copies(plan):  # every rank holds both copies
        tied_whole = 1.0
    elif tied_embeddings and len(pipe.stages) > 1 and tied_ends_alike(pipe):
        for i, (a, b) in enumerate(zip(pipe.stages[0].ranks, pipe.stages[-1].ranks)):
            group = dist.new_group(sorted((a, b)))
            if rank in (a, b) and i == position:
                tied_group = group
    elif tied_embeddings and len(pipe.stages) > 1:  # the ends lay the table out differently: whole gradients
        ends = (pipe.stages[0].ranks, pipe.stages[-1].ranks)
        group = groups.group(ends[0] + ends[1])
        mine = next((e for e in ends if rank in e), None)
        if mine is not None:
            tied_group, tied_whole = group, 1 / len(mine)
    if not chunks:
        return None
    return Placement(rank, pi, chunks[0].index % pp, pp, tuple(chunks), pp_group, tied_group, norm_share=norm_share,
                     tied_whole=tied_whole)


def _replica_groups(plan: Plan, rank: int, groups: _Groups) -> dict[int, Replicas]:
    """For every layer this rank holds: the ranks its gradients are reduced over across pipelines (built
    collectively, layer by layer): those holding the same shard of it in every pipeline when every pipeline
    shards it alike, else all its holders (`Replicas`). Key -1 is the embedding, `layers` the head."""
    layers = plan.pipelines[0].stages[-1].layers[1]
    out: dict[int, Replicas] = {}
    for layer in [-1, *range(layers), layers]:
        at = min(max(layer, 0), layers - 1)
        holding = holders(plan, at)
        if len({shard_shape(st, at) for st in holding}) > 1:
            group = groups.group(tuple(r for st in holding for r in st.ranks))
            mine = next((st for st in holding if rank in st.ranks), None)
            if mine is not None:
                out[layer] = Replicas(group, whole=True, copies=len(mine.ranks))
            continue
        for i in range(len(holding[0].ranks)):
            ranks = tuple(st.ranks[i] for st in holding)
            group = groups.group(ranks)
            if rank in ranks and group is not None:
                out[layer] = Replicas(group)
    return out
