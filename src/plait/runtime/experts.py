"""Expert parallelism and expert tensor parallelism of MoE layers (`plait.models.moe.MoE`) over the ranks
of a stage.

Megatron's parallel folding: the experts are laid out over the stage's ranks independently of the
attention's dp/cp/tp, expert tensor parallel (etp) fastest, then expert parallel (ep), then expert data
parallel (edp), as the dims ("edp", "ep", "etp") of the stage's expert mesh. Each rank holds E/ep
consecutive experts, and of each 1/etp of its width: w1/w3 [E, F, H] and w2 [E, H, F] are DTensors sharded
along the experts over "ep" and along F (w1/w3 column-wise, w2 row-wise) over "etp", so checkpoints
reshard across ep and etp degrees. Assignments travel to their expert's rank of the ep group (the ranks
sharing edp and etp) and back in two differentiable all-to-alls with uneven splits, after the per-expert
counts are exchanged. With etp > 1 the etp group all-gathers the routed tokens after that dispatch (each
etp rank computes its slice of F for every token of its experts, a partial sum of each output) and
reduce-scatters the outputs before the combine (each rank keeps the sum for its own tokens). Both are
differentiable (an all-gather's backward is a reduce-scatter and vice versa) and run as all-to-alls with
uneven splits moving the same bytes, since torch's all-gather and reduce-scatter take equal parts only.
Under `moe_comm=lsh` the assignments are first compressed to LSH-MoE centroids (`plait.runtime.lsh`), and
only those travel, through the etp group as well.

Gradients, with every rank's loss the mean over its own tokens (as dp and cp ranks have; sp ranks share one
loss and each holds a part of its tokens): the weights that see only this rank's tokens (router, shared
experts) sum over the stage's ranks and the experts over their expert-data-parallel replicas (the ranks
with the same ep and etp coordinates: every token reaches each expert slice once within an edp slice of
the stage), both divided by the data-parallel degree dp x cp, as the dense weights' average over the data
group is. By hand after the backward (zero=0), or with ZeRO by FSDP2 units over the stage's ranks and over
the edp group. Paged parameters (offload=params or nvme) make those units with FSDP2's CPUOffloadPolicy,
also without ZeRO (as ZeRO-3 over the same groups, whose sums equal the hand reductions).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from plait.cost.offload import PAGED
from plait.models.moe import AUX_LOSS_COEF, BIAS_UPDATE_RATE, MoE
from plait.runtime.lsh import LshCompressor
from plait.runtime.placement import Segment
from plait.runtime.ulysses import all_to_all
from plait.runtime.zero import paging, shard_unit
from plait.spec.model import ModelSpec

Sync = tuple[list[nn.Parameter], dist.ProcessGroup | None, float | None]
"""Gradients reduced by hand: (parameters, group, weight), see `parallelize.sync_gradients`."""


def by_expert(counts: Tensor) -> Tensor:
    """The order that sorts rows grouped by source rank, then expert (`counts` [sources, experts] rows of
    each) by expert, then source rank (stable)."""
    sources, local = counts.shape
    return torch.arange(local).repeat(sources).repeat_interleave(counts.flatten()).argsort(stable=True)


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
        order = by_expert(recv_counts)
        return got.index_select(0, order), recv_counts.sum(0), (order, send, recv)

    def gather(self, outputs: Tensor, handle: tuple[Tensor, list[int], list[int]]) -> Tensor:
        """The outputs of this rank's experts -> those of this rank's assignments, in `scatter`'s order."""
        order, send, recv = handle
        return all_to_all(outputs.index_select(0, order.argsort()), self.group, send, recv)


def all_gather_rows(x: Tensor, group: dist.ProcessGroup, rows: list[int]) -> Tensor:
    """Differentiable all-gather of uneven parts: x [rows[me], ...] -> every rank's part, by rank
    [sum(rows), ...]; its backward reduce-scatters the gradients."""
    n = dist.get_world_size(group)
    return all_to_all(x.expand(n, *x.shape).reshape(-1, *x.shape[1:]), group, rows, [x.shape[0]] * n)


def reduce_scatter_rows(x: Tensor, group: dist.ProcessGroup, rows: list[int]) -> Tensor:
    """Differentiable reduce-scatter of uneven parts: x [sum(rows), ...] (every rank's part, by rank) -> the
    sum over the ranks of this rank's part [rows[me], ...]; its backward all-gathers the gradients."""
    n, mine = dist.get_world_size(group), rows[dist.get_rank(group)]
    return all_to_all(x, group, [mine] * n, rows).view(n, mine, *x.shape[1:]).sum(0)


class ExpertTensorParallel:
    """`plait.models.moe.Exchange` with each expert's width split over an etp group: the tokens of this
    rank's experts (after `inner`, the ep all-to-all, if any) are all-gathered over the group, and the
    experts' partial outputs reduce-scattered back."""

    def __init__(self, group: dist.ProcessGroup, inner: AllToAll | None) -> None:
        self.group, self.inner = group, inner
        self.etp = dist.get_world_size(group)

    def scatter(self, tokens: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, tuple[object, Tensor, list[int]]]:
        """tokens [A, H] sorted by expert, counts [E] -> (the tokens of every etp rank for this rank's
        experts, sorted by local expert, their counts [E/ep], the handle `gather` needs)."""
        inner = None
        if self.inner is not None:
            tokens, counts, inner = self.inner.scatter(tokens, counts)
        every = [torch.empty_like(counts) for _ in range(self.etp)]
        dist.all_gather(every, counts, group=self.group)
        gathered = torch.stack(every)  # [etp rank, local expert]
        rows = gathered.sum(1).tolist()
        order = by_expert(gathered)
        mine = all_gather_rows(tokens, self.group, rows).index_select(0, order)
        return mine, gathered.sum(0), (inner, order, rows)

    def gather(self, outputs: Tensor, handle: tuple[object, Tensor, list[int]]) -> Tensor:
        """The partial outputs of this rank's expert slices -> the outputs of this rank's assignments."""
        inner, order, rows = handle
        mine = reduce_scatter_rows(outputs.index_select(0, order.argsort()), self.group, rows)
        return mine if self.inner is None else self.inner.gather(mine, inner)


def moe_layers(model: nn.Module, layers: list[str]) -> list[MoE]:
    """The MoE feed-forwards of the named layers of a model chunk."""
    return [m for name in layers for m in model.layers[name].modules() if isinstance(m, MoE)]


EXPERT_SHARDS = (("w1", 1), ("w3", 1), ("w2", 2), ("w1_bias", 1), ("w3_bias", 1), ("w2_bias", None))
"""Each expert tensor and its dimension of the expert's width F, split over the etp group (w1/w3 [E, F, H]
column-wise, w2 [E, H, F] row-wise, the biases of w1/w3 [E, F] with them); the down bias [E, H] is whole on
every etp rank, which adds 1/etp of it (`plait.models.moe.Experts.width_mesh`)."""


def shard_experts(moe: MoE, mesh: DeviceMesh) -> None:
    """Keep this rank's experts and its slice of their width: each tensor becomes a DTensor sharded along
    the experts over "ep" and along F over "etp" (the dims of the ("edp", "ep", "etp") `mesh` above 1)."""
    dims = tuple(d for d in ("ep", "etp") if mesh[d].size() > 1)
    for name, width in EXPERT_SHARDS:
        if (param := getattr(moe.experts, name)) is None:
            continue
        placements = [Shard(0) if d == "ep" else Replicate() if width is None else Shard(width) for d in dims]
        local = distribute_tensor(param.detach(), mesh[dims], placements, src_data_rank=None)
        setattr(moe.experts, name, nn.Parameter(local))
    if "etp" in dims:
        moe.experts.width_mesh = mesh["etp"]


def _zero(module: nn.Module, mesh: DeviceMesh, zero: int, data: int, reduce_dtype: torch.dtype | None,
          **policy: object) -> None:
    """ZeRO (FSDP2) of one MoE part over `mesh`: gradients summed over it (in `reduce_dtype`; None: their
    own), divided by `data`; `policy`: FSDP2's offload policy of paged parameters."""
    shard_unit(module, mesh, zero, reduce_dtype, **policy)
    if mesh.size() > 1:  # gloo has no pre-multiplied sum: sum, then divide (a one-rank mesh divides once
        module.set_force_sum_reduction_for_comms(True)  # in its copy, and would divide twice with this)
    module.set_gradient_divide_factor(float(data))


def apply_ep(model: nn.Module, seg: Segment, layers: list[str], stage_group: dist.ProcessGroup | None,
             grad_accumulation: int, reduce_dtype: torch.dtype | None = None) -> list[Sync]:
    """Expert (tensor) parallelism on the MoE layers among `layers` (segment `seg`'s strategy): shard their
    experts, route through all-to-alls and the etp group's all-gather and reduce-scatter (of LSH-MoE
    centroids under moe_comm=lsh), set the auxiliary loss's gradient weight (`grad_accumulation`
    micro-batches whose mean loss the caller backpropagates; 1 under a pipeline schedule, which scales
    gradients itself); with ZeRO, shard the router, shared experts and experts with FSDP2 (reducing in
    `reduce_dtype`). Returns the
    MoE weights whose gradients are reduced by hand (zero=0)."""
    moes = moe_layers(model, layers)
    if not moes:
        return []
    s, groups = seg.strategy, seg.experts
    assert groups is not None, "the placement builds expert groups for every segment with MoE layers"
    data = s.dp * s.cp
    zero = s.zero or (3 if s.offload in PAGED else 0)  # paged parameters: FSDP2 units even without ZeRO
    policy = paging(s.offload)
    syncs: list[Sync] = []
    for moe in moes:
        if s.ep > 1 or s.expert_tp > 1:
            shard_experts(moe, groups.mesh)
            moe.exchange = AllToAll(groups.mesh.get_group("ep")) if s.ep > 1 else None
        if s.expert_tp > 1:
            moe.exchange = ExpertTensorParallel(groups.mesh.get_group("etp"), moe.exchange)
        if s.moe_comm == "lsh":
            moe.compressor = LshCompressor()
        moe.sequence_group = groups.sequence
        moe.aux_scale = AUX_LOSS_COEF * s.cp / grad_accumulation
        dense = moe.dense_modules
        if zero > 0 and groups.stage is not None:
            for part in dense:
                _zero(part, groups.stage, zero, data, reduce_dtype, **policy)
        else:
            syncs.append(([p for m in dense for p in m.parameters()], stage_group, 1.0 / data))
        if zero > 0 and groups.mesh is not None:  # also when edp == 1: the layer's FSDP unit must skip them
            _zero(moe.experts, groups.mesh["edp"], zero, data, reduce_dtype, **policy)
        else:
            syncs.append((list(moe.experts.parameters()), groups.edp, 1.0 / data))
    return syncs


def ep_group(moe: MoE) -> dist.ProcessGroup | None:
    """The expert-parallel group `moe`'s exchange spreads its experts over (None: ep 1)."""
    exchange = moe.exchange.inner if isinstance(moe.exchange, ExpertTensorParallel) else moe.exchange
    return exchange.group if isinstance(exchange, AllToAll) else None


def expert_load(models: list[nn.Module], layers: int) -> list[float]:
    """Each layer's routed rows on its busiest expert-parallel rank over their mean across the ep group
    since the last call (the `expert_load` a plan prices; 1 without expert parallelism, 0 for a layer
    without experts), the busiest of its replicas, the same on every rank; resets the counts. Every rank
    calls it (collectives over each ep group, then over all ranks)."""
    load = torch.zeros(layers, dtype=torch.float64)
    by_group: dict[dist.ProcessGroup | None, list[tuple[int, MoE]]] = {}
    for model in models:
        for name, layer in model.layers.items():
            for m in layer.modules():
                if isinstance(m, MoE):
                    by_group.setdefault(ep_group(m), []).append((int(name), m))
    for group, moes in by_group.items():  # in layer order: the same on every rank of a group
        rows = torch.tensor([float(m.experts.rows) for _, m in moes], dtype=torch.float64)
        for _, m in moes:
            m.experts.rows = 0
        ratio = torch.ones_like(rows)
        if group is not None:
            busiest = rows.clone()
            dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(rows, group=group)
            ratio = busiest * dist.get_world_size(group) / rows.clamp(min=1.0)
        load[[i for i, _ in moes]] = ratio
    dist.all_reduce(load, op=dist.ReduceOp.MAX)
    return load.tolist()


def _biased(models: list[nn.Module]) -> dict[int, MoE]:
    """The MoE modules with a choice bias (DeepSeek-V3's router) among `models`' layers, by layer index."""
    return {int(name): m for model in models for name, layer in model.layers.items() for m in layer.modules()
            if isinstance(m, MoE) and m.choice_bias is not None}


def count_choices(models: list[nn.Module]) -> None:
    """Start counting the routers' choices in the MoE layers with a choice bias (`update_choice_biases`)."""
    for moe in _biased(models).values():
        moe.choice_counts = torch.zeros(moe.n_experts, dtype=torch.float64)


def update_choice_biases(models: list[nn.Module], spec: ModelSpec, rate: float = BIAS_UPDATE_RATE) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after a step: each layer's choice bias moves by `rate`
    towards balance, up for the experts picked fewer times than the mean over the step's tokens and down for
    those picked more (the sign of mean - count), the counts summed over every rank (tensor-parallel ranks
    that route the same tokens count them alike, which leaves the signs), as Megatron-LM's
    get_updated_expert_bias; the counts restart. Every rank calls it (one all-reduce over all ranks)."""
    layers = [i for i, b in enumerate(spec.stack) if b.kind == "moe" and b.gating.choice_bias]
    if not layers:
        return
    held = {i: m for i, m in _biased(models).items() if m.choice_counts is not None}
    sizes = [spec.stack[i].experts for i in layers]
    counts = torch.cat([held[i].choice_counts if i in held else torch.zeros(n, dtype=torch.float64)  # type: ignore[misc]
                        for i, n in zip(layers, sizes, strict=True)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    with torch.no_grad():
        for i, part in zip(layers, counts.split(sizes), strict=True):
            if (moe := held.get(i)) is not None:
                moe.choice_bias += rate * torch.sign(part.mean() - part).to(moe.choice_bias.dtype)  # type: ignore[operator]
                moe.choice_counts.zero_()  # type: ignore[union-attr]


def expert_params(model: nn.Module) -> set[int]:
    """ids of the parameters of a model's MoE feed-forwards (reduced by `apply_ep`'s syncs, not the data group's)."""
    return {id(p) for m in model.modules() if isinstance(m, MoE) for p in m.parameters()}
