"""The one place that prices: a layer (or the embedding, or the head) under a strategy on its ranks.

`price(block, strategy, ctx)` gives the seconds of one micro-batch on one device by cause, the bytes the
device holds for it (model states after ZeRO, saved activations, transients, gather buffers) and the
once-per-step gradient synchronisation; `price_edge` does the same for the embedding and the head;
`usable_memory` is what a device can give its model. The simulator, the search engine, the straggler
planner and the variable-length planner all price through these functions and compute no term of their own.
`BlockContext` (cost/layer.py) carries the run: model, cluster, calibration, precision, sequence length,
sequences per micro-batch and the shapes of the tensor, context and data-parallel groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

from plait.cost import comm, experts, offload
from plait.cost.calibration import Calibration
from plait.cost.compute import elementwise_time
from plait.cost.head import EdgeTime, embedding_time, head_activation_bytes, head_time
from plait.cost.layer import (
    BlockContext,
    BlockTime,
    block_activation_bytes,
    block_time,
    hsdp_all_reduce,
    runtime_kinds,
    zero_sync_time,
)
from plait.cost.memory import FRAGMENTATION_FRACTION, GRAD_BUCKET_BYTES, context_bytes, model_state_bytes
from plait.layout import Layout, received_fraction, transfer_fraction
from plait.plan import Strategy
from plait.spec.layers import Block

Edge = Literal["embedding", "head"]
NO_TIME = BlockTime(forward=0.0, backward=0.0, recompute=0.0, tp_comm=0.0, cp_comm=0.0, zero_comm=0.0,
                    forward_comm=0.0)
"""No seconds: the time of `_held_states`, which prices bytes and synchronisation only."""


@dataclass(frozen=True)
class LayerCost:
    """One layer (or edge) under one strategy, one micro-batch on one device. Seconds and bytes."""

    time: BlockTime
    params: float  # parameters this device holds before ZeRO sharding (its tensor-parallel shard)
    weights: float  # bytes after ZeRO over the data-parallel group
    gradients: float
    optimizer: float
    activation: float  # bytes kept for backward per micro-batch in flight
    working: float  # transient bytes: a recomputed layer's full activations, the loss's logits
    buffers: float  # ZeRO-3 keeps the current and the prefetched layer unsharded
    grad_reduce: float  # seconds per step reducing gradients before the optimizer (whole, not overlapped)
    param_gather: float  # seconds per step gathering ZeRO-1/2 parameters (and offloaded weights) after the step
    host: float = 0.0  # bytes in host memory: offloaded optimizer state and fp32 gradients (cost/offload.py)
    swapped: float = 0.0  # bytes of saved activations swapped to host per micro-batch in flight
    nvme: float = 0.0  # bytes on the node's NVMe: model states under offload="nvme" (cost/offload.py)
    updated: float = 0.0  # parameters this device's optimizer steps: each part's ZeRO shard (an MoE layer's
    # routed experts over the expert data-parallel group, the rest over the data-parallel group)

    @property
    def states(self) -> float:
        """Bytes of weights, gradients and optimizer state."""
        return self.weights + self.gradients + self.optimizer

    @property
    def micro_batch_s(self) -> float:
        """Seconds of forward and backward with exposed communication, one micro-batch."""
        return self.time.forward_total + self.time.backward_total

    def exposed_sync(self, overlap_efficiency: float) -> float:
        """Seconds per step of gradient synchronisation left after overlapping the reduction with this
        layer's backward (the search's estimate; the simulator overlaps with the whole stage)."""
        return max(0.0, self.grad_reduce - self.time.backward * overlap_efficiency) + self.param_gather


def _states_and_sync(params: float, s: Strategy, ctx: BlockContext, group: comm.GroupShape | None = None
                     ) -> tuple[float, float, float, float, float]:
    """(weights, gradients, optimizer bytes, reduce seconds, gather seconds) of `params` shared by `group`
    (default: `ctx.dp_group`, under HSDP its shard group; ZeRO-1's gradient shards are then all-reduced over
    the replicas once per step, ZeRO-2/3's every micro-batch in `zero_sync_time`). Across pipelines only the
    optimizer state of a layer held alike shards over every pipeline (`BlockContext.pipeline_dp`)."""
    group = group or ctx.dp_group
    w, g, o = model_state_bytes(params, group.size, s.zero, ctx.prec, offload=s.offload != "none")
    if _pipeline_sharded(ctx, group):
        w, g, own_o = model_state_bytes(params, ctx.pipeline_dp, s.zero, ctx.prec, offload=s.offload != "none")
        o = o if ctx.states_alike else own_o
    reduce_t, gather_t = comm.gradient_sync(params, s.zero, group, ctx.prec.reduce_bytes, ctx.prec.param,
                                            ctx.cluster, ctx.cal)
    if s.zero == 1 and group == ctx.dp_group:
        reduce_t += hsdp_all_reduce(params, ctx)
    return w, g, o, reduce_t, gather_t


def _pipeline_sharded(ctx: BlockContext, group: comm.GroupShape) -> bool:
    """Whether several pipelines shard `group`'s parameters within each pipeline's stage
    (`_states_and_sync`)."""
    return bool(ctx.pipeline_dp) and group == ctx.dp_group and ctx.pipeline_dp < group.size


def updated_params(params: float, s: Strategy, ctx: BlockContext, group: comm.GroupShape | None = None
                   ) -> float:
    """Parameters of `params` shared by `group` (default: the data-parallel group) that this device's
    optimizer steps: its optimizer-state shard from ZeRO-1 on, as `_states_and_sync` lays the state out."""
    group = group or ctx.dp_group
    if s.zero < 1:
        return params
    shards = ctx.pipeline_dp if _pipeline_sharded(ctx, group) and not ctx.states_alike else group.size
    return params / shards


@lru_cache(maxsize=16384)
def price(block: Block, s: Strategy, ctx: BlockContext) -> LayerCost:
    """Time and memory terms of `block` under `s` in the run `ctx` (see LayerCost). An MoE layer's routed
    experts are held experts/ep per rank, 1/etp of each, and shared by the expert data-parallel group."""
    kept = s.without_recompute()
    states = _held_states(block, kept, ctx)
    working = _whole_activation_bytes(block, kept, ctx) if s.recompute != "none" else 0.0
    activation = block_activation_bytes(block, s, ctx)
    return replace(states, time=block_time(block, s, ctx), activation=offload.resident_activation(activation, s),
                   working=working, swapped=offload.swapped_activation(activation, s))


@lru_cache(maxsize=8192)
def _held_states(block: Block, s: Strategy, ctx: BlockContext) -> LayerCost:
    """`price`'s model states, buffers and synchronisation of `block` under `s` (which recomputes nothing:
    every recompute mode of a layout holds the same), its time and activations left empty."""
    parts = experts.held_params(block, s, ctx)
    params = sum(held for held, _ in parts)
    w = g = o = reduce_t = gather_t = gathered = 0.0
    for held, group in parts:
        terms = _states_and_sync(held, s, ctx, group)
        w, g, o, reduce_t, gather_t = (a + b for a, b in zip((w, g, o, reduce_t, gather_t), terms, strict=True))
        if s.zero == 3 and group.size > 1:  # ZeRO-3 keeps the current and the prefetched layer unsharded
            gathered += 2 * held * (ctx.prec.param + ctx.prec.grad)
    w, g, o = (x * _measured_states(block.kind, s, ctx) for x in (w, g, o))
    g, o, states = offload.offloaded_states(g, o, s, ctx.prec)
    gathered += offload.paged_buffers(params, s, ctx.prec, gathered)
    w, paged = offload.paged_weights(w, s)
    host, nvme = offload.placed(states + paged, s)
    gather_t += offload.weights_back_time(params, s, ctx.cluster, ctx.prec, _shards(s, ctx))
    return LayerCost(time=NO_TIME, params=params, weights=w, gradients=g, optimizer=o, activation=0.0,
                     working=0.0, buffers=gathered, grad_reduce=reduce_t, param_gather=gather_t, host=host,
                     nvme=nvme, updated=sum(updated_params(held, s, ctx, group) for held, group in parts))


@lru_cache(maxsize=8192)
def _whole_activation_bytes(block: Block, s: Strategy, ctx: BlockContext) -> float:
    """Bytes `block` keeps for backward under `s` without recompute: a recomputing layer's transient."""
    return block_activation_bytes(block, s, ctx, "none")


def _shards(s: Strategy, ctx: BlockContext) -> int:
    """Devices the optimizer state of a layer is sharded over under `s` (ZeRO-1 and up: the data group)."""
    return ctx.dp_group.size if s.zero >= 1 else 1


def edge_params(edge: Edge, ctx: BlockContext, copy: bool) -> float:
    """Parameters of the embedding or the head (`copy`: a head tied to the embedding, or whose stage runs
    multi-token-prediction modules, keeps its own copy of the table, `plait.executable.tied_copies`)."""
    m = ctx.model
    if edge == "embedding":
        return m.embedding_params
    return m.head_params + (m.vocab * m.hidden if m.shares_table and copy else 0)


@lru_cache(maxsize=4096)
def price_edge(edge: Edge, s: Strategy, ctx: BlockContext, pipelined: bool = False, copy: bool | None = None
               ) -> LayerCost:
    """The embedding (first stage) or the head with its loss (last stage) under `s`; `pipelined`: the head
    is on another stage than the embedding; `copy`: the head holds its own copy of a tied table (default:
    `pipelined`; a stage holding both may too, `plait.executable.tied_copies`)."""
    et: EdgeTime = embedding_time(s, ctx) if edge == "embedding" else head_time(s, ctx)
    params = edge_params(edge, ctx, pipelined if copy is None else copy) / s.tp
    zero_fwd, zero_bwd = _edge_zero_sync(edge, params, s, et, ctx)
    time = BlockTime(forward=et.forward, backward=et.backward, recompute=0.0, tp_comm=et.tp_comm, cp_comm=0.0,
                     zero_comm=zero_fwd + zero_bwd, forward_comm=et.tp_comm / 2 + zero_fwd)
    w, g, o, reduce_t, gather_t = _states_and_sync(params, s, ctx)
    w, g, o = (x * _measured_states(ctx.model.block.kind, s, ctx) for x in (w, g, o))
    working = _edge_working(edge, s, ctx, pipelined)
    g, o, states = offload.offloaded_states(g, o, s, ctx.prec)
    w, paged = offload.paged_weights(w, s)
    host, nvme = offload.placed(states + paged, s)
    gather_t += offload.weights_back_time(params, s, ctx.cluster, ctx.prec, _shards(s, ctx))
    return LayerCost(time=time, params=params, weights=w, gradients=g, optimizer=o, activation=0.0,
                     working=working, buffers=offload.paged_buffers(params, s, ctx.prec, 0.0),
                     grad_reduce=reduce_t, param_gather=gather_t, host=host, nvme=nvme,
                     updated=updated_params(params, s, ctx))


def _measured_states(kind: str, s: Strategy, ctx: BlockContext) -> float:
    """Factor on the analytic model-state bytes of a layer of `kind` under `s` that gives the measured bytes per
    parameter (Galvatron's memory profile; 1 without one or where it lacks the kind)."""
    mem = ctx.cal.memory
    if mem is None or kind not in mem.states_bytes_per_param:
        return 1.0
    return mem.states_bytes_per_param[kind] / sum(model_state_bytes(1.0, 1, s.zero, ctx.prec, s.offload != "none"))


def _edge_working(edge: Edge, s: Strategy, ctx: BlockContext, pipelined: bool) -> float:
    """Transient bytes of the embedding (none in the formulas) or the head's logits for one micro-batch: the
    measured edge memory where the calibration has it (cost/measured_memory.py), else `head_activation_bytes`."""
    mem = ctx.cal.memory
    per_token = mem.edge_activation(edge, pipelined, s.tp, ctx.prec.activation) if mem is not None else None
    if per_token is not None:
        return per_token * ctx.seqs * ctx.seq_len / s.cp
    return head_activation_bytes(s, ctx) if edge == "head" else 0.0


def _edge_zero_sync(edge: Edge, params: float, s: Strategy, et: EdgeTime, ctx: BlockContext
                    ) -> tuple[float, float]:
    """(forward, backward) seconds of an edge's own ZeRO-2/3 collectives. The embedding's are the first gather
    of a micro-batch and its last reduce-scatter: no compute runs beside them, so they are exposed whole. The
    head's run beside its own compute, like a layer's."""
    if s.zero < 2 or ctx.dp_group.size <= 1 or params <= 0:
        return 0.0, 0.0
    if edge == "head":
        return zero_sync_time(params, s.zero, et.forward, et.backward, ctx)
    return zero_sync_time(params, s.zero, 0.0, 0.0, ctx)


def usable_memory(capacity: float, cal: Calibration, bucketed: bool = True) -> float:
    """Bytes of a device of `capacity` bytes that its model can use: less the context (or profiled
    process) and the allocator's fragmentation, and the data-parallel gradient buckets when `bucketed`."""
    usable = (capacity - context_bytes(cal)) / (1 + FRAGMENTATION_FRACTION)
    return usable - (2 * GRAD_BUCKET_BYTES if bucketed else 0.0)


def recompute_flops_per_token(block: Block, recompute: str, seq_len: int, ring: bool = False) -> float:
    """Forward FLOPs repeated per token of the sequence by recomputing `block` (full: the whole layer,
    selective: the attention cores, none under ring context parallelism (`ring`), whose attention is not run
    again; attn_kept: all but the attention cores; gemm_kept: the attention cores, its GEMM outputs are kept),
    for a run of `seq_len` tokens per sequence."""
    cores = 0.0 if ring else block.attention_flops_per_token(seq_len)
    per_own_token = {"full": block.flops_per_token(seq_len),
                     "attn_kept": block.gemm_flops_per_token(seq_len),
                     "selective": cores,
                     "gemm_kept": block.attention_flops_per_token(seq_len)}.get(recompute, 0.0)
    return per_own_token * block.seq(seq_len) / seq_len


def tied_embedding_sync(ctx: BlockContext) -> float:
    """Seconds per step summing the gradients of an embedding and its copy on another stage, the head tied to
    it or the multi-token-prediction modules' lookups (Megatron's embedding group: an all-reduce between the
    two stages' devices)."""
    m = ctx.model
    return comm.all_reduce(m.vocab * m.hidden * ctx.prec.grad, comm.GroupShape(2, 2, 1), ctx.cluster, ctx.cal)


TIED_SUM_PASSES = 5
"""Whole tied tables a one-stage copy sum reads or writes (dimensionless): both copies' gathered gradients
read, their sum written, then read once more as each copy takes its part back
(`plait.runtime.train._sum_tied_grad`: stack, sum, scale in place, copy to each copy's shard)."""


def tied_shards(s: Strategy) -> int:
    """Pieces a tied table's gradient is split into under `s`: tensor parallel (along the vocabulary) times
    ZeRO's shard group (all the data and context ranks, or `shard` of them)."""
    return s.tp * ((s.shard or s.dp * s.cp) if s.zero >= 1 else 1)


def tied_gather_bytes(first: Strategy, last: Strategy, ctx: BlockContext) -> tuple[float, float]:
    """Bytes of a tied table's gradient that each rank of a one-stage pipeline receives to sum the two copies
    (`plait.executable.tied_copies`): the embedding's copy laid out like `first`, the head's like `last`, each
    copy's whole gradient gathered over the ranks sharding it; per copy (shards - 1) / shards of the table."""
    table = ctx.model.vocab * ctx.model.hidden * ctx.prec.grad
    k0, k1 = tied_shards(first), tied_shards(last)
    return table * (k0 - 1) / k0, table * (k1 - 1) / k1


def tied_copies_sum(first: Strategy, last: Strategy, ranks: tuple[int, ...], ctx: BlockContext) -> float:
    """Seconds per step summing the gradients of a tied table's two copies held on one stage of `ranks`
    (`tied_gather_bytes`): an all-gather of each sharded copy over the ranks sharding it (the first of
    `ranks`), then the sum in device memory (`TIED_SUM_PASSES` table passes)."""
    table = ctx.model.vocab * ctx.model.hidden * ctx.prec.grad
    gpn = ctx.cluster.gpus_per_node
    gathers = sum(comm.all_gather(table, comm.GroupShape.of(ranks[: tied_shards(s)], gpn), ctx.cluster, ctx.cal)
                  for s in (first, last))
    return gathers + elementwise_time(TIED_SUM_PASSES * table, ctx.cluster.gpu, ctx.cal, kernels=3)


@dataclass(frozen=True)
class Held:
    """Parameters a device updates in its optimizer step: a priced layer, how many of it, its strategy and
    how many replicas share it."""

    cost: LayerCost
    count: int
    strategy: Strategy
    replicas: int

    @property
    def local_params(self) -> float:
        """Parameters this device's optimizer updates (its ZeRO shards, `LayerCost.updated`)."""
        return self.count * self.cost.updated


def optimizer_time(held: list[Held], ctx: BlockContext) -> float:
    """Seconds of one optimizer step over a device's parameters: the device's step over those it keeps
    (`device_optimizer_time`) beside the host CPU's over those it offloads (cost/offload.py); the two run
    at once."""
    on_host = [h for h in held if h.strategy.offload != "none"]
    on_device = [h for h in held if h.strategy.offload == "none"]
    host = offload.host_optimizer_time(sum(h.local_params for h in on_host), ctx.cluster,
                                       sum(h.count * h.cost.nvme for h in on_host))
    return max(host, device_optimizer_time(on_device, ctx) if on_device else 0.0)


def device_optimizer_time(held: list[Held], ctx: BlockContext) -> float:
    """Seconds of one optimizer step over a device's parameters: AdamW's memory traffic, or the profiled step
    (clipping, AdamW, zeroing) at the per-parameter rate of each layout (DTensor shards cost more per
    parameter than plain tensors) plus the largest fixed part."""
    measured, name = ctx.cal.measured, ctx.model.name
    if measured is None or measured.optimizer_curve(name) is None:
        local = sum(h.local_params for h in held)
        return elementwise_time(local * ctx.prec.optimizer_traffic, ctx.cluster.gpu, ctx.cal, kernels=4)
    per_param = fixed = 0.0
    for h in held:
        s, replicas = h.strategy, h.replicas
        kinds = runtime_kinds(s, replicas) or ([("zero", "zero3", replicas)] if s.zero and replicas > 1 else [])
        curve, stretch = measured.optimizer_curve(name, *(kinds[0][1:] if kinds else ("none", 1)))
        per_param += stretch * curve.per_param_s * h.local_params
        fixed = max(fixed, stretch * curve.intercept_s)
    return per_param + fixed


def send_piece_bytes(layer: int, s: Strategy, sequences: int, ctx: BlockContext, receiver: Strategy | None = None
                     ) -> float:
    """Bytes the busiest rank sends or receives at a pipeline boundary before `layer`, for a micro-batch of
    `sequences` samples whose activations leave a stage laid out by strategy `s`. Into a stage of as many
    ranks (or `receiver` None), each rank sends its own piece to the same position of the next stage;
    into a stage of another width (`receiver`'s), the pieces go straight to the receiver's layout
    (`plait.layout.transfer`, the blocks `plait.runtime.boundary` sends)."""
    src = Layout.of(s)
    whole = carried_bytes(layer, sequences, ctx)
    if receiver is not None and receiver.devices != s.devices:
        return whole * transfer_fraction(src, Layout.of(receiver))
    return whole / (src.dp * src.token_parts)


def send_time(layer: int, s: Strategy, sequences: int, ctx: BlockContext, cross_node: bool,
              receiver: Strategy | None = None, split: int = 1) -> float:
    """Seconds of one pipeline send (one direction, one micro-batch) at the boundary before `layer`: the
    busiest rank's bytes (`send_piece_bytes`) point to point, the senders in parallel. `split` > 1: Megatron-LM's
    scatter/gather (Narayanan et al., SC21, Sec. 4.1), where the `split` tensor-parallel ranks that hold the same
    activation each send 1/split of it and the receivers all-gather the pieces inside their node."""
    piece = send_piece_bytes(layer, s, sequences, ctx, receiver)
    if split <= 1:
        return comm.p2p(piece, cross_node, ctx.cluster, ctx.cal)
    gather = comm.all_gather(piece, comm.GroupShape(split, 1, split), ctx.cluster, ctx.cal)
    return comm.p2p(piece / split, cross_node, ctx.cluster, ctx.cal) + gather


def carried_bytes(layer: int, sequences: int, ctx: BlockContext) -> float:
    """Bytes of `sequences` samples' activations that arrive at `layer` from the layer before it."""
    return sequences * ctx.model.carried_elements(layer, ctx.seq_len) * ctx.prec.activation


def relayout_time(src: Layout, dst: Layout, moved_bytes: float, stage: comm.GroupShape, ctx: BlockContext
                  ) -> tuple[float, float]:
    """(forward, backward) seconds to re-lay out `moved_bytes` of activations from layout `src` to `dst` over a
    stage's ranks: one exchange each way that moves only what each rank lacks (plait.layout), the gradient
    going back in backward."""
    if src == dst:
        return 0.0, 0.0
    return tuple(comm.exchange(received_fraction(a, b) * moved_bytes, stage, ctx.cluster, ctx.cal)  # type: ignore[return-value]
                 for a, b in ((src, dst), (dst, src)))
