"""Parallel degrees: one object that owns how a layer's ranks split into named dimensions.

Like torchtitan's ParallelDims: a layer runs on a stage's ranks laid out in Megatron order (tensor parallel
fastest, then context parallel, then data parallel), and the plan stacks `pp` such stages. The planners,
the simulator, the layout of activations (plait.layout) and the runtime's device meshes all take their
coordinates and groups from here. `ep` (expert parallelism) is carried for MoE layers: it divides the
ranks that share the attention weights (dp x cp).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from plait.errors import PlaitError

Dim = Literal["dp", "cp", "tp", "data"]
MESH_DIMS: tuple[str, str, str] = ("dp", "cp", "tp")
"""Names of a stage's device-mesh dimensions, slowest first (Megatron order)."""


@dataclass(frozen=True, order=True)
class Degrees:
    """Degrees of data, tensor, context, pipeline and expert parallelism."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise PlaitError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if (self.dp * self.cp) % self.ep:
            raise PlaitError(f"ep={self.ep} must divide dp*cp = {self.dp * self.cp} (experts are spread over the "
                             "ranks that share the attention weights)")

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
    def mesh_shape(self) -> tuple[int, int, int]:
        """Shape of a stage's device mesh, dims `MESH_DIMS`."""
        return self.dp, self.cp, self.tp

    def coords(self, position: int) -> tuple[int, int, int]:
        """(dp, cp, tp) coordinates of a position in the stage's rank list."""
        return position // (self.tp * self.cp), (position // self.tp) % self.cp, position % self.tp

    def group(self, ranks: Sequence[int], dim: Dim, position: int = 0) -> tuple[int, ...]:
        """The ranks of a stage (`ranks`, in Megatron order) that share every coordinate but `dim` with
        `position`: its tensor-, context- or data-parallel group, or "data" (dp x cp: the ranks holding the
        same weight shard)."""
        d, c, t = self.coords(position)
        if dim == "tp":
            start = (d * self.cp + c) * self.tp
            return tuple(ranks[start: start + self.tp])
        if dim == "cp":
            start = d * self.cp * self.tp + t
            return tuple(ranks[start: start + self.cp * self.tp: self.tp])
        if dim == "dp":
            return tuple(ranks[c * self.tp + t:: self.cp * self.tp])
        return tuple(ranks[t:: self.tp])
