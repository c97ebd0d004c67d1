"""A `plait train --tasks` unit's strategy inside its device group: tensor (with or without Megatron sequence
parallelism) and context parallelism, besides data parallelism.

A unit on n ranks with degrees tp and cp runs dp = n / (tp cp) row blocks; its ranks form a ("dp", "cp",
"tp") device mesh (tp fastest, as `plait.layout.Layout` numbers positions), and each rank holds its
`Layout.piece` of the unit's [batch, seq_len, hidden] activations. The task model keeps every weight whole
on every rank (the master copy the optimizer steps and gradients are summed on); a unit with tp or cp > 1
runs its layers as a copy parallelised with the runtime's own `apply_tp` and `apply_cp`
(`plait.runtime.parallelize`) on the group's mesh. Each step the copy is refreshed from the master weights
(each rank slices its shards locally) and its gradients go back whole (a DTensor's gathered over the tp
ranks), weighted 1/tp: the tp ranks of a row block each hold the same whole gradient, the cp ranks hold
sums over their own tokens.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.func import functional_call

from plait.layout import Layout
from plait.models.llama import copy_full_
from plait.runtime.parallelize import apply_cp, apply_tp, whole_gradient
from plait.spec.degrees import MESH_DIMS, Degrees


def group_mesh(ranks: tuple[int, ...], layout: Layout) -> DeviceMesh:
    """The unit's ("dp", "cp", "tp") mesh over its ranks (collective over the world: every rank builds every
    unit's mesh, in the same order)."""
    degrees = Degrees(dp=layout.dp, tp=layout.tp, cp=layout.cp)
    return DeviceMesh("cpu", torch.tensor(ranks).view(*degrees.mesh_shape), mesh_dim_names=MESH_DIMS)


class _Holder(nn.Module):
    """What `apply_tp` and `apply_cp` parallelise: blocks under `layers`, no embedding or head."""

    tok_embeddings = norm = output = None

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): copy.deepcopy(layer) for i, layer in enumerate(layers)})


class GroupLayers:
    """A unit's layers as this rank of its group runs them under tensor and/or context parallelism."""

    def __init__(self, layers: list[nn.Module], layout: Layout, mesh: DeviceMesh, cp_mode: str, seq_len: int
                 ) -> None:
        self.holder = _Holder(layers)
        names = list(self.holder.layers)
        if layout.cp > 1:
            apply_cp(self.holder, mesh["cp"].get_group(), names, cp_mode, seq_len)
        if layout.tp > 1:
            apply_tp(self.holder, mesh["tp"], layout.sp, names, embedding=False, head=False)
        self.tp = layout.tp
        self.pairs = [(p, dict(self.holder.layers[str(i)].named_parameters())[name])
                      for i, layer in enumerate(layers) for name, p in layer.named_parameters()]

    def refresh(self) -> None:
        """Copy the master weights into the parallel copy (each rank keeps its shards; no communication)."""
        for master, mine in self.pairs:
            copy_full_(mine, master.detach())

    def __call__(self, x: Tensor) -> Tensor:
        """This rank's piece of the unit's input -> its piece of the output."""
        for layer in self.holder.layers.values():
            x = layer(x)
        return x

    def fold_gradients(self) -> None:
        """Add the copy's gradients to the master weights' (whole, weighted 1/tp; collective over the tp
        ranks) and drop them."""
        for master, mine in self.pairs:
            if mine.grad is None:
                continue
            whole = whole_gradient(mine.grad) / self.tp
            master.grad = whole if master.grad is None else master.grad + whole
            mine.grad = None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def weighted_call(module: nn.Module, weight: float, *args: Tensor) -> Tensor:
    """`module(*args)` with the gradients its parameters get from this call scaled by `weight` (the
    gradient the call's inputs get is not): an embedding or head that the `copies` tp ranks of a row block
    each run whole counts 1/copies on each."""
    if weight == 1.0:
        return module(*args)
    params = {name: _ScaleGrad.apply(p, weight) for name, p in module.named_parameters()}
    return functional_call(module, params, args)
