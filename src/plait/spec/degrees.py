"""Parallel degrees: one object that owns how a layer's ranks split into named dimensions.

Like torchtitan's ParallelDims: a layer runs on a stage's ranks laid out in Megatron order (tensor parallel
fastest, then context parallel, then data parallel), and the plan stacks `pp` such stages. The planners,
the simulator, the layout of activations (plait.layout) and the runtime's device meshes all take their
coordinates and groups from here. MoE layers lay their experts out over the same ranks in a second way
(Megatron's "parallel folding"): expert tensor parallel `etp` fastest, then expert parallel `ep`, then the
expert data parallel rest (`edp` = stage ranks / (ep x etp)), independent of the attention's tp/cp/dp.
Hybrid sharded data parallelism (HSDP, `shard` > 0) cuts the data-parallel ranks (dp x cp, which hold the same
weights) into consecutive shard groups of `shard` ranks, over which ZeRO shards, and replicate groups (the
ranks holding the same shard in every shard group), which all-reduce the gradient shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from plait.cached_hash import cached_hash
from plait.errors import PlaitError

Dim = Literal["dp", "cp", "tp", "data", "shard", "replicate"]
ExpertDim = Literal["ep", "etp", "edp"]
MESH_DIMS: tuple[str, str, str] = ("dp", "cp", "tp")
"""Names of a stage's device-mesh dimensions, slowest first (Megatron order)."""


@cached_hash
@dataclass(frozen=True, order=True)
class Degrees:
    """Degrees of data, tensor, context, pipeline and expert parallelism."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    shard: int = 0  # ZeRO's shard group: 0 all data-parallel ranks, else that many of them (HSDP)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "cp", "pp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise PlaitError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.shard < 0 or (self.shard and self.data % self.shard):
            raise PlaitError(f"shard={self.shard} must divide the dp*cp = {self.data} data-parallel ranks (0: all "
                             "of them)")
        if self.stage_devices % (self.ep * self.etp):
            raise PlaitError(f"ep*etp = {self.ep}*{self.etp} must divide the stage's dp*cp*tp = {self.stage_devices} "
                             "ranks (experts are laid out over the same ranks as the attention)")

    @property
    def edp(self) -> int:
        """Expert data parallel degree: the replicas of each expert shard in a stage."""
        return self.stage_devices // (self.ep * self.etp)

    @property
    def stage_devices(self) -> int:
        """Ranks of one stage (dp x cp x tp)."""
        return self.dp * self.cp * self.tp

    @property
    def world(self) -> int:
        """Ranks of one pipeline (stage ranks x pp)."""
        return self.stage_devices * self.pp

    @property
    def data(self) -> int:
        """Replicas that average a weight's gradients (data and context parallel ranks hold the same weights)."""
        return self.dp * self.cp

    @property
    def shard_size(self) -> int:
        """Ranks that ZeRO shards a weight over: the shard group (all data-parallel ranks without HSDP)."""
        return self.shard or self.data

    @property
    def replicas(self) -> int:
        """Shard groups holding the same weights (1 without HSDP): the size of a replicate group."""
        return self.data // self.shard_size

    def split_data(self, data_ranks: Sequence[int], index: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(shard group, replicate group) of the member `index` of a data-parallel group `data_ranks` (ranks
        holding the same weights, in order): consecutive runs of `shard_size` ranks shard; the ranks at the
        same place in every run replicate. Sized by this object's shard, whatever the length of `data_ranks`
        (several pipelines add replicas)."""
        size = self.shard or len(data_ranks)
        start = index - index % size
        return tuple(data_ranks[start: start + size]), tuple(data_ranks[index % size:: size])

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """Shape of a stage's device mesh, dims `MESH_DIMS`."""
        return self.dp, self.cp, self.tp

    def coords(self, position: int) -> tuple[int, int, int]:
        """(dp, cp, tp) coordinates of a position in the stage's rank list."""
        return _coords(position, (self.dp, self.cp, self.tp))

    def group(self, ranks: Sequence[int], dim: Dim, position: int = 0) -> tuple[int, ...]:
        """The ranks of a stage (`ranks`, in Megatron order) that share every coordinate but `dim` with
        `position`: its tensor-, context- or data-parallel group, "data" (dp x cp: the ranks holding the
        same weight shard), or its HSDP "shard" or "replicate" group within "data" (`split_data`)."""
        if dim in MESH_DIMS:
            return _fold_group(ranks, (self.dp, self.cp, self.tp), MESH_DIMS.index(dim), position)
        data = tuple(ranks[position % self.tp:: self.tp])
        if dim == "data":
            return data
        shard, replicate = self.split_data(data, position // self.tp)
        return shard if dim == "shard" else replicate

    def expert_coords(self, position: int) -> tuple[int, int, int]:
        """(edp, ep, etp) coordinates of a position in the stage's rank list, for MoE layers' experts."""
        return _coords(position, (self.edp, self.ep, self.etp))

    def expert_group(self, ranks: Sequence[int], dim: ExpertDim, position: int = 0) -> tuple[int, ...]:
        """The ranks of a stage that share every expert coordinate but `dim` with `position`: its expert
        tensor-parallel group ("etp"), expert-parallel group ("ep", which exchanges tokens all-to-all) or
        expert data-parallel group ("edp", which reduces the experts' gradients)."""
        return _fold_group(ranks, (self.edp, self.ep, self.etp), ("edp", "ep", "etp").index(dim), position)


def _coords(position: int, sizes: tuple[int, int, int]) -> tuple[int, int, int]:
    """Coordinates of `position` in a three-dimensional layout of `sizes`, the last dimension fastest."""
    return position // (sizes[1] * sizes[2]), (position // sizes[2]) % sizes[1], position % sizes[2]


def _fold_group(ranks: Sequence[int], sizes: tuple[int, int, int], dim: int, position: int) -> tuple[int, ...]:
    """The members of `ranks` (laid out in `sizes`, the last dimension fastest) that share every coordinate
    but dimension `dim` with `position`."""
    strides = (sizes[1] * sizes[2], sizes[2], 1)
    coords = _coords(position, sizes)
    start = sum(c * stride for i, (c, stride) in enumerate(zip(coords, strides, strict=True)) if i != dim)
    return tuple(ranks[start: start + sizes[dim] * strides[dim]: strides[dim]])
