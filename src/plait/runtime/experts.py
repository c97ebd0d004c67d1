"""Expert parallelism of MoE layers (`plait.models.moe.MoE`) over the ranks of a stage.

Megatron's parallel folding: the experts are laid out over the stage's ranks independently of the
attention's dp/cp/tp, expert-parallel fastest (etp = 1 here), then expert data parallel. Each rank of an ep
group holds E/ep consecutive experts (DTensors sharded along the expert dimension over the "ep" dimension
of an ("edp", "ep") mesh, so checkpoints reshard across ep degrees); assignments travel to their expert's rank and back in two
differentiable all-to-alls with uneven splits, after the per-expert counts are exchanged. Under
`moe_comm=lsh` the assignments are first compressed to LSH-MoE centroids (`plait.runtime.lsh`), and only
those travel.

Gradients, with every rank's loss the mean over its own tokens (as dp and cp ranks have; sp ranks share one
loss and each holds a part of its tokens): the weights that see only this rank's tokens (router, shared
experts) sum over the stage's ranks and the experts over their expert-data-parallel replicas, both divided
by the data-parallel degree dp x cp, as the dense weights' average over the data group is. By hand after
the backward (zero=0), or with ZeRO by FSDP2 units over the stage's ranks and over the edp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from plait.models.moe import AUX_LOSS_COEF, MoE
from plait.runtime.lsh import LshCompressor
from plait.runtime.placement import Segment
from plait.runtime.ulysses import all_to_all

Sync = tuple[list[nn.Parameter], dist.ProcessGroup | None, float | None]
"""Gradients reduced by hand: (parameters, group, weight), see `parallelize.sync_gradients`."""


class AllToAll:
    """`plait.models.moe.Exchange` over an expert-parallel group: rank j holds experts [j*E/ep, (j+1)*E/ep)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)

    def scatter(self, tokens: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, list[int], list[int]]]:
        """tokens [A, H] sorted by expert, counts [E] -> (the tokens of this rank's experts, sorted by local
        expert, their counts [E/ep], the handle `gather` needs)."""
        send_counts = counts.view(self.ep, -1)  # [destination rank, its expert]
        recv_counts = torch.empty_like(send_counts)  # [source rank, my expert]
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        got = all_to_all(tokens, self.group, recv, send)  # by source rank, then expert
        local = recv_counts.shape[1]
        expert = torch.arange(local).repeat(self.ep).repeat_interleave(recv_counts.flatten())
        order = expert.argsort(stable=True)
        return got.index_select(0, order), recv_counts.sum(0), (order, send, recv)

    def gather(self, outputs: Tensor, handle: tuple[Tensor, list[int], list[int]]) -> Tensor:
        """The outputs of this rank's experts -> those of this rank's assignments, in `scatter`'s order."""
        order, send, recv = handle
        return all_to_all(outputs.index_select(0, order.argsort()), self.group, send, recv)


def moe_layers(model: nn.Module, layers: list[str]) -> list[MoE]:
    """The MoE feed-forwards of the named layers of a model chunk."""
    return [m for name in layers for m in model.layers[name].modules() if isinstance(m, MoE)]


def shard_experts(moe: MoE, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's experts: each weight becomes a DTensor sharded along the experts over `ep_mesh`."""
    for name, param in list(moe.experts.named_parameters()):
        local = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(moe.experts, name, nn.Parameter(local))


def _zero(module: nn.Module, mesh: DeviceMesh, zero: int, data: int) -> None:
    """ZeRO (FSDP2) of one MoE part over `mesh`: gradients summed over it, divided by `data`."""
    fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3)
    if mesh.size() > 1:  # gloo has no pre-multiplied sum: sum, then divide (a one-rank mesh divides once
        module.set_force_sum_reduction_for_comms(True)  # in its copy, and would divide twice with this)
    module.set_gradient_divide_factor(float(data))


def apply_ep(model: nn.Module, seg: Segment, layers: list[str], stage_group: dist.ProcessGroup | None,
             grad_accumulation: int) -> list[Sync]:
    """Expert parallelism on the MoE layers among `layers` (segment `seg`'s strategy): shard their
    experts, route through all-to-alls (of LSH-MoE centroids under moe_comm=lsh), set the auxiliary loss's gradient weight (`grad_accumulation`
    micro-batches whose mean loss the caller backpropagates; 1 under a pipeline schedule, which scales
    gradients itself); with ZeRO, shard the router, shared experts and experts with FSDP2. Returns the
    MoE weights whose gradients are reduced by hand (zero=0)."""
    moes = moe_layers(model, layers)
    if not moes:
        return []
    s, groups = seg.strategy, seg.experts
    assert groups is not None, "the placement builds expert groups for every segment with MoE layers"
    data = s.dp * s.cp
    syncs: list[Sync] = []
    for moe in moes:
        if s.ep > 1:
            shard_experts(moe, groups.mesh["ep"])
            moe.exchange = AllToAll(groups.mesh.get_group("ep"))
        if s.moe_comm == "lsh":
            moe.compressor = LshCompressor()
        moe.sequence_group = groups.sequence
        moe.aux_scale = AUX_LOSS_COEF * s.cp / grad_accumulation
        dense = [moe.router] + ([moe.shared] if moe.shared is not None else [])
        if s.zero > 0 and groups.stage is not None:
            for part in dense:
                _zero(part, groups.stage, s.zero, data)
        else:
            syncs.append(([p for m in dense for p in m.parameters()], stage_group, 1.0 / data))
        if s.zero > 0 and groups.mesh is not None:  # also when edp == 1: the layer's FSDP unit must skip them
            _zero(moe.experts, groups.mesh["edp"], s.zero, data)
        else:
            syncs.append((list(moe.experts.parameters()), groups.edp, 1.0 / data))
    return syncs


def expert_params(model: nn.Module) -> set[int]:
    """ids of the parameters of a model's MoE feed-forwards (reduced by `apply_ep`'s syncs, not the data group's)."""
    return {id(p) for m in model.modules() if isinstance(m, MoE) for p in m.parameters()}
