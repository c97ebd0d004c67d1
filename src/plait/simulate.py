"""Simulator: Plan x ModelSpec x Cluster -> Report (iteration time, its breakdown, memory per device).

For every stage the cost model gives per-micro-batch forward and backward times (blocks, embedding, head,
re-layout between differing strategies) and the p2p time to the next stage; the pipeline schedule is
simulated event by event; then each device group reduces its gradients (overlapped with the last
backward where the plan allows) and steps its optimizer. The iteration ends when the last device does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import TypeVar

from plait.cost import comm
from plait.cost.calibration import Calibration, calibration_for
from plait.cost.comm import GroupShape
from plait.cost.layer import BlockContext
from plait.cost.memory import GRAD_BUCKET_BYTES, MemoryTerms, with_reserve
from plait.cost.pipeline import (
    PipelineResult,
    StageTimes,
    p2p_hold,
    paired_share,
    peak_weighted_in_flight,
    repeat_runs,
    simulate_pipeline,
)
from plait.cost.precision import PRECISIONS, PrecisionBytes, plan_precision
from plait.cost.price import (
    Held,
    LayerCost,
    carried_bytes,
    optimizer_time,
    price,
    price_edge,
    recompute_flops_per_token,
    relayout_time,
    send_piece_bytes,
    send_time,
    tied_copies_sum,
    tied_embedding_sync,
)
from plait.executable import holders, shard_shape, tied_copies
from plait.layout import Layout, scatter_split
from plait.plan import Plan, Stage, Strategy, validate_plan
from plait.spec.cluster import GIB, Cluster
from plait.spec.layers import Block
from plait.spec.model import ModelSpec

BUSY_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "zero_comm", "ep_comm", "relayout", "host_comm")
"""Parts of a stage's time per micro-batch that keep its devices busy."""
BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "zero_comm", "ep_comm", "relayout", "host_comm",
                  "pp_bubble", "p2p", "dp_comm_exposed", "optimizer")


@dataclass(frozen=True)
class StageCost:
    """One stage (model chunk) for one micro-batch on one of its devices, seconds, plus its memory inputs."""

    parts: dict[str, float]  # compute, recompute, tp_comm, cp_comm, zero_comm, relayout
    forward: float
    backward: float
    send: float
    activation_bytes: float  # saved by one micro-batch
    working_bytes: float  # transient on top of the saved activations (recompute, logits)
    priced: list[tuple[LayerCost, int, Strategy, int]]  # (price, layers, strategy, first layer) per shape and strategy, and edges
    kinds: list[str]  # the layer kind (or "embedding", "head") of each entry of `priced`
    buffer_bytes: float
    recompute_flops_per_token: float  # FLOPs recomputation repeats per token of the micro-batch
    swapped_bytes: float = 0.0  # saved activations swapped to host memory by one micro-batch


@dataclass(frozen=True)
class DeviceGroup:
    """A stage's device group (all the chunks it holds) after simulation."""

    pipeline: int
    index: int
    ranks: tuple[int, ...]
    layers: tuple[tuple[int, int], ...]
    memory: MemoryTerms
    end_s: float  # when this group finishes the iteration
    parts: dict[str, float]  # breakdown of end_s
    host_bytes: float = 0.0  # host memory one device of the group uses (offloaded states, swapped activations)
    nvme_bytes: float = 0.0  # NVMe one device of the group uses (states under offload="nvme")


@dataclass(frozen=True)
class KindSummary:
    """One layer kind (or the embedding or head) of the first pipeline: how many layers, their parameters,
    the seconds its device groups spend on them per iteration (forward, backward, recompute and exposed
    communication, every micro-batch), the largest model states and saved activations per micro-batch that
    one device holds of them (GiB)."""

    layers: int
    params: float
    seconds: float
    states_gib: float
    activation_gib_per_micro_batch: float


@dataclass(frozen=True)
class Report:
    """Predicted performance of a plan. Seconds, tokens/s, TFLOP/s, GiB."""

    iteration_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    peak_memory_gib: float
    memory_capacity_gib: float
    fits: bool
    breakdown: dict[str, float]
    devices: tuple[DeviceGroup, ...] = field(repr=False)
    pipelines: tuple[PipelineResult, ...] = field(repr=False)
    by_kind: dict[str, KindSummary] = field(default_factory=dict, repr=False)
    host_memory_gib: float = 0.0  # the fullest node's host memory used by its devices
    host_capacity_gib: float = 0.0  # host memory per node
    nvme_gib: float = 0.0  # the fullest node's NVMe used by its devices (offload="nvme")
    nvme_capacity_gib: float = 0.0  # NVMe per node

    @property
    def over_memory_gib(self) -> float:
        """GiB by which the largest device exceeds its memory (0 when it fits)."""
        return max(0.0, self.peak_memory_gib - self.memory_capacity_gib)

    def to_dict(self) -> dict:
        """The JSON report of DESIGN.md, plus per-device memory terms."""
        return {
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_memory_gib": self.peak_memory_gib,
            "memory_capacity_gib": self.memory_capacity_gib,
            "fits": self.fits,
            "over_memory_gib": self.over_memory_gib,
            "host_memory_gib": self.host_memory_gib,
            "host_capacity_gib": self.host_capacity_gib,
            "nvme_gib": self.nvme_gib,
            "nvme_capacity_gib": self.nvme_capacity_gib,
            "breakdown": self.breakdown,
            "by_kind": {k: asdict(v) for k, v in self.by_kind.items()},
            "devices": [
                {"pipeline": d.pipeline, "stage": d.index, "ranks": [d.ranks[0], d.ranks[-1]],
                 "layers": [list(r) for r in d.layers], "end_s": d.end_s,
                 "memory_gib": {k: v / GIB for k, v in d.memory.as_dict().items()} | {"total": d.memory.total / GIB},
                 "host_gib_per_device": d.host_bytes / GIB, "nvme_gib_per_device": d.nvme_bytes / GIB}
                for d in self.devices
            ],
        }


def _dp_ranks(plan: Plan, layer: int, s: Strategy, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Ranks holding the same shard of `layer` (tp coordinate 0: every dp and cp coordinate, since context
    parallel ranks hold the same weights and reduce their gradients too) across every pipeline."""
    own = s.degrees.group(ranks, "data")
    if len(plan.pipelines) == 1:
        return own
    out: list[int] = []
    for pipe in plan.pipelines:
        for st in pipe.stages:
            if st.layers[0] <= layer < st.layers[1]:
                out.extend(st.strategy(layer).degrees.group(st.ranks, "data"))
    return tuple(out)


def _across_pipelines(ctx: BlockContext, plan: Plan, layer: int, s: Strategy, stage: Stage) -> BlockContext:
    """`ctx` with what several pipelines shard of `layer` (`BlockContext.pipeline_dp`, `states_alike`): the
    runtime reduces the pipelines' gradients once per step, after the last backward, so ZeRO-2/3 shard
    gradients and weights within a pipeline's stage only; the optimizer state of a layer every pipeline holds
    alike is split among its holders (`plait.runtime.replica_zero`), of one held differently it is not."""
    if len(plan.pipelines) == 1:
        return ctx
    own = len(s.degrees.split_data(s.degrees.group(stage.ranks, "data"))[0])
    alike = len({shard_shape(st, layer) for st in holders(plan, layer)}) == 1
    return replace(ctx, pipeline_dp=own, states_alike=alike)


def _optimizer_shards(plan: Plan, layer: int, s: Strategy, stage: Stage) -> int:
    """Ranks `layer`'s optimizer state is split over (before ZeRO applies): its shard group in every pipeline,
    or in this pipeline alone where the pipelines hold it differently (`_across_pipelines`)."""
    ranks = _dp_ranks(plan, layer, s, stage.ranks)
    if len(plan.pipelines) > 1 and len({shard_shape(st, layer) for st in holders(plan, layer)}) > 1:
        ranks = s.degrees.group(stage.ranks, "data")
    return len(s.degrees.split_data(ranks)[0])


def layer_runs(stage: Stage, model: ModelSpec) -> list[tuple[Strategy, Block, int, int]]:
    """(strategy, layer shape, count, first layer) of each run of consecutive layers of a stage that share
    both strategy and shape."""
    start, end = stage.layers
    if len(stage.strategies) == 1:
        s = stage.strategies[0]
        return [(s, block, count, layer) for block, count, layer in _shape_runs(model, start, end)]
    pairs = ((stage.strategy(layer), model.stack[layer]) for layer in range(start, end))
    return [(s, block, count, layer) for (s, block), count, layer in _run_lengths(pairs, start)]


T = TypeVar("T")


def _run_lengths(items: Iterable[T], first: int) -> list[tuple[T, int, int]]:
    """(item, count, index of its first) of each run of equal consecutive `items`, indexed from `first`."""
    runs: list[tuple[T, int, int]] = []
    for i, item in enumerate(items, start=first):
        if runs and runs[-1][0] == item:
            runs[-1] = (item, runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((item, 1, i))
    return runs


def _layer_context(plan: Plan, pipe_index: int, stage: Stage, s: Strategy, layer: int, model: ModelSpec,
                   cluster: Cluster, cal: Calibration, prec: PrecisionBytes) -> BlockContext:
    """The context `layer` of `stage` (in pipeline `pipe_index`) is priced in with strategy `s`."""
    return _across_pipelines(
        BlockContext.for_ranks(model, cluster, cal, prec, plan.seq_len, plan.pipelines[pipe_index].per_replica(s),
                               s, stage.ranks, _dp_ranks(plan, layer, s, stage.ranks), plan.expert_load,
                               plan.dispatcher, plan.routing, exchange_hidden(plan, pipe_index, cal)),
        plan, layer, s, stage)


def exchange_hidden(plan: Plan, pipe_index: int, cal: Calibration) -> float:
    """Share of MoE layers' token exchange that the plan's expert-parallel overlap (`Plan.ep_overlap`) hides
    in pipeline `pipe_index`: the paired share of its schedule's passes (`paired_share`) at the calibrated
    share of a paired exchange (`Calibration.ep_overlap_hidden`); 0 without it."""
    if not plan.ep_overlap:
        return 0.0
    pp = len(plan.pipelines[pipe_index].stages) // plan.chunks
    return cal.ep_overlap_hidden * paired_share(plan.schedule, pp, plan.run_micro_batches(pipe_index), plan.chunks)


def _rank_pattern(ranks: tuple[int, ...], gpus_per_node: int) -> tuple[int, ...]:
    """What of a stage's ranks its group shapes depend on: for consecutive ranks, the first one's place in its
    node and their number (the shapes repeat node by node), else the ranks themselves."""
    first = ranks[0]
    if ranks == tuple(range(first, first + len(ranks))):
        return (first % gpus_per_node, len(ranks))
    return ranks


@dataclass(frozen=True)
class Floor:
    """What a plan takes at least, from its layers alone (no embedding, head, re-layout, send, bubble,
    synchronisation or transient buffers): never above what `price_plan` and `finish` give, and far cheaper
    (each layer shape priced once per strategy and rank pattern, from the cache), so that a baseline can skip
    pricing plans that cannot win or cannot fit."""

    seconds: float  # the busiest device group's micro-batches' layer forward and backward; 0 where CPU ranks
    # share cores (see `PricedPlan.lower_bound_s`)
    peak_bytes: float  # the largest device group's layer model states and saved activations at the schedule's
    # peak, with the allocator's reserve


def plan_floor(plan: Plan, model: ModelSpec, cluster: Cluster, cal: Calibration) -> Floor:
    """The plan's `Floor`."""
    prec = plan_precision(plan.precision, plan.grad_reduce)
    single = len(plan.pipelines) == 1  # then a layer's price depends on its shape, strategy and ranks alone
    priced: dict[tuple, LayerCost] = {}  # (strategy, shape, rank pattern[, pipeline, layer]) -> price
    seconds = peak = 0.0
    for pi, pipe in enumerate(plan.pipelines):
        pp = len(pipe.stages) // plan.chunks
        states, saved = [0.0] * pp, [[0.0] * plan.chunks for _ in range(pp)]
        for d in range(pp):
            busy = 0.0
            for k, stage in enumerate(pipe.stages[d::pp]):
                chunk_s = 0.0
                pattern = _rank_pattern(stage.ranks, cluster.gpus_per_node)
                for s, block, count, layer in layer_runs(stage, model):
                    key = (s, block, pattern) if single else (s, block, pattern, pi, layer)
                    if key not in priced:
                        priced[key] = price(block, s, _layer_context(plan, pi, stage, s, layer, model, cluster,
                                                                     cal, prec))
                    c = priced[key]
                    chunk_s += count * c.micro_batch_s
                    saved[d][k] += count * c.activation
                    states[d] += count * c.states
                busy += chunk_s * _slowest(stage.ranks, cluster)
            seconds = max(seconds, pipe.micro_batches * busy)
        alive = peak_weighted_in_flight(plan.schedule, pp, plan.run_micro_batches(pi), plan.chunks, saved)
        peak = max(peak, *(with_reserve(states[d], 0.0, 0.0, alive[d], 0.0, cal).total for d in range(pp)))
    return Floor(0.0 if cal.measured is not None else seconds, peak)


@lru_cache(maxsize=16384)
def _shape_runs(model: ModelSpec, start: int, end: int) -> tuple[tuple[Block, int, int], ...]:
    """(layer shape, count, first layer) of each run of consecutive layers of one shape in [start, end)."""
    return tuple(_run_lengths(model.stack[start:end], start))


def _stage_cost(plan: Plan, pipe_index: int, stage_index: int, model: ModelSpec, cluster: Cluster,
                cal: Calibration) -> StageCost:
    pipe = plan.pipelines[pipe_index]
    stage = pipe.stages[stage_index]
    prec = plan_precision(plan.precision, plan.grad_reduce)
    last = stage_index == len(pipe.stages) - 1
    parts = dict.fromkeys(BUSY_KEYS, 0.0)
    fwd = bwd = 0.0
    act = working = 0.0
    priced: list[tuple[LayerCost, int, Strategy, int]] = []
    kinds: list[str] = []
    buffers = recompute_flops = swapped = 0.0
    before = pipe.stages[stage_index - 1] if stage_index > 0 else None
    # What arrives, when a stage of as many ranks sends it rank by rank; between stages of different sizes
    # the send itself moves the pieces.
    prev = before.strategies[-1] if before is not None and len(before.ranks) == len(stage.ranks) else None
    stage_group = GroupShape.of(stage.ranks, cluster.gpus_per_node)

    single = len(plan.pipelines) == 1  # then a strategy's ranks and data-parallel group are the same every layer
    contexts: dict[Strategy, BlockContext] = {}

    def context(s: Strategy, layer: int) -> BlockContext:
        if single and s in contexts:
            return contexts[s]
        ctx = contexts[s] = _layer_context(plan, pipe_index, stage, s, layer, model, cluster, cal, prec)
        return ctx

    # Layers of one shape and strategy cost the same wherever they sit (with one pipeline): count them once.
    counted: dict[tuple, list[int]] = {}  # (shape, strategy[, first layer]) -> [layers, first layer]
    for s, block, count, layer in layer_runs(stage, model):
        key = (block, s) if single else (block, s, layer)
        if key in counted:
            counted[key][0] += count
        else:
            counted[key] = [count, layer]
        if prev is not None and Layout.of(prev) != Layout.of(s):
            # Re-layout of the hidden state between differing strategies (or from the previous stage's).
            ctx = context(s, layer)
            f, g = relayout_time(Layout.of(prev), Layout.of(s), carried_bytes(layer, pipe.micro_batch_sequences, ctx),
                                 stage_group, ctx)
            fwd += f
            bwd += g
            parts["relayout"] += f + g
        prev = s
    for (block, s, *_), (count, layer) in counted.items():
        c = price(block, s, context(s, layer))
        bt = c.time
        fwd += count * bt.forward_total
        bwd += count * bt.backward_total
        parts["compute"] += count * (bt.forward + bt.backward)
        parts["recompute"] += count * bt.recompute
        parts["tp_comm"] += count * bt.tp_comm
        parts["cp_comm"] += count * bt.cp_comm
        parts["zero_comm"] += count * bt.zero_comm
        parts["ep_comm"] += count * bt.ep_comm
        parts["host_comm"] += count * bt.host_comm
        act += count * c.activation
        swapped += count * c.swapped
        working = max(working, c.working)
        priced.append((c, count, s, layer))
        kinds.append(block.kind)
        buffers = max(buffers, c.buffers)
        recompute_flops += count * recompute_flops_per_token(block, s.recompute, plan.seq_len, ring=s.ring)
    first_s, last_s = stage.strategy(stage.layers[0]), stage.strategy(stage.layers[1] - 1)
    pipelined = len(pipe.stages) > 1
    edges = []
    if stage_index == 0:
        edges.append(("embedding", first_s, stage.layers[0]))
    if last:
        edges.append(("head", last_s, stage.layers[1] - 1))
    for edge, s, layer in edges:
        copy = edge == "head" and tied_copies(plan)  # the head's own copy of a tied table
        c = price_edge(edge, s, context(s, layer), pipelined and stage_index > 0,  # type: ignore[arg-type]
                       copy)
        fwd += c.time.forward_total
        bwd += c.time.backward_total
        parts["compute"] += c.time.forward + c.time.backward
        parts["tp_comm"] += c.time.tp_comm
        parts["zero_comm"] += c.time.zero_comm  # the embedding's exposed first gather and last reduce-scatter
        working = max(working, c.working)
        priced.append((c, 1, s, layer))
        kinds.append(edge)
    send = 0.0
    if not last:
        nxt = pipe.stages[stage_index + 1]
        ctx = context(last_s, stage.layers[1] - 1)
        cross = comm.nodes_of(stage.ranks, cluster.gpus_per_node) != comm.nodes_of(nxt.ranks, cluster.gpus_per_node)
        receiver = nxt.strategy(nxt.layers[0])
        split = scatter_split(Layout.of(last_s), Layout.of(receiver)) if plan.p2p == "megatron" else 1
        send = send_time(stage.layers[1], last_s, pipe.micro_batch_sequences, ctx, cross, receiver, split)
        buffers += 2 * send_piece_bytes(stage.layers[1], last_s, pipe.micro_batch_sequences, ctx, receiver)
    speed = _slowest(stage.ranks, cluster)
    if speed != 1.0:
        fwd, bwd = fwd * speed, bwd * speed
        parts = {k: v * speed for k, v in parts.items()}
    return StageCost(parts, fwd, bwd, send, act, working, priced, kinds, buffers, recompute_flops, swapped)


def _simulate_pipelines(plan: Plan, all_costs: list[list[StageCost]], record: bool, detail: bool = True
                        ) -> list[tuple[int, list[StageCost], PipelineResult, PipelineResult | None]]:
    """Each pipeline's schedule simulated from its stage costs: (index, costs, result, result without the
    p2p sends, or None when it has none or without `detail`)."""
    staged = []
    for pi, (pipe, costs) in enumerate(zip(plan.pipelines, all_costs, strict=True)):
        times = [StageTimes(c.forward, c.backward, c.send) for c in costs]
        hold = p2p_hold(plan.p2p)
        m, runs = plan.run_micro_batches(pi), plan.schedule_runs
        res = repeat_runs(simulate_pipeline(times, m, plan.schedule, plan.chunks, record=record, hold=hold),
                          runs)
        no_send = None
        if detail and len(costs) > 1 and any(c.send for c in costs):
            no_send = repeat_runs(simulate_pipeline([StageTimes(c.forward, c.backward) for c in costs], m,
                                                    plan.schedule, plan.chunks), runs)
        staged.append((pi, costs, res, no_send))
    return staged


def _shared_core_relief(plan: Plan, model: ModelSpec, cluster: Cluster, cal: Calibration,
                        results: list[PipelineResult]) -> float:
    """CPU ranks share their node's cores, so a rank computes faster while others idle (pipeline bubbles,
    ranks left out): the measured contention at the average number of ranks busy at once over the node's
    full contention, by which the stages' compute shrinks (<= 1; 1.0 where no profile measured sharing)."""
    measured = cal.measured
    span = max(r.makespan_s for r in results)
    if measured is None or measured.cores <= 1 or measured.ranks_per_node <= 1 or span <= 0:
        return 1.0
    busy_s = sum(len(pipe.stages[d].ranks) * res.busy_s[d]
                 for pipe, res in zip(plan.pipelines, results, strict=True) for d in range(res.devices))
    busy = 1.0 + (measured.ranks_per_node - 1) * min(1.0, busy_s / (span * cluster.world_size))
    first = plan.pipelines[0].stages[0].strategy(plan.pipelines[0].stages[0].layers[0])
    tokens = plan.pipelines[0].per_replica(first) * plan.seq_len
    full = measured.contention(model.name, tokens, plan.seq_len)
    return min(1.0, measured.contention_at(model.name, tokens, plan.seq_len, busy) / full) if full > 0 else 1.0


def _scaled(cost: StageCost, factor: float) -> StageCost:
    """A stage's per-micro-batch times (not its send) multiplied by `factor`."""
    return replace(cost, forward=cost.forward * factor, backward=cost.backward * factor,
                   parts={k: v * factor for k, v in cost.parts.items()})


def _slowest(ranks: tuple[int, ...], cluster: Cluster) -> float:
    """Speed factor of a device group: its slowest member's (1.0 healthy)."""
    return max(cluster.speed_of(r) for r in ranks) if cluster.speed else 1.0


def _grad_sync(costs: list[StageCost], plan: Plan, stage: Stage, model: ModelSpec, cluster: Cluster,
               cal: Calibration, prec: PrecisionBytes) -> tuple[float, float, float]:
    """(reduce seconds before the optimizer, gather seconds after it, optimizer seconds) of a device group."""
    reduce_t = sum(count * c.grad_reduce for cost in costs for c, count, _, _ in cost.priced)
    reduce_t += _whole_reduce(costs, plan, stage, model, cluster, cal, prec)
    gather_t = sum(count * c.param_gather for cost in costs for c, count, _, _ in cost.priced)
    ctx = BlockContext(model, cluster, cal, prec, plan.seq_len, 1, comm.SINGLE, comm.SINGLE, comm.SINGLE)
    if model.shares_table and stage.layers == (0, model.layers) and tied_copies(plan):
        # a one-stage pipeline holding both copies: summed in place
        reduce_t += tied_copies_sum(stage.strategy(0), stage.strategy(model.layers - 1), stage.ranks, ctx)
    elif model.shares_table and len(plan.pipelines[0].stages) > 1:
        reduce_t += tied_embedding_sync(ctx)  # the table's copy on the last stage (tied head, or MTP lookups)
    held = [Held(c, count, s, _optimizer_shards(plan, layer, s, stage)) for cost in costs
            for c, count, s, layer in cost.priced]
    return reduce_t, gather_t, optimizer_time(held, ctx)


def _whole_reduce(costs: list[StageCost], plan: Plan, stage: Stage, model: ModelSpec, cluster: Cluster,
                  cal: Calibration, prec: PrecisionBytes) -> float:
    """Seconds a device group spends reducing, across pipelines, the layers that pipelines shard differently
    (`plait.executable.shard_shape`), as the runtime does (`sync_whole_gradients`): the whole gradient
    gathered over the stage where tensor, expert (tensor) parallelism or ZeRO splits it, then all-reduced
    over every holder in every pipeline. An MoE layer's whole gradient is all its parameters (every expert)."""
    if len(plan.pipelines) == 1:
        return 0.0
    gpn, total = cluster.gpus_per_node, 0.0
    for cost in costs:
        for c, count, s, layer in cost.priced:
            holding = holders(plan, layer)
            if len({shard_shape(st, layer) for st in holding}) == 1:
                continue
            moe = 0 <= layer < model.layers and model.stack[layer].kind == "moe"
            whole = (model.stack[layer].params if moe else c.params * s.tp) * prec.reduce_bytes
            split = s.tp > 1 or (s.zero and s.dp * s.cp > 1) or (moe and s.ep * s.expert_tp > 1)
            gather = comm.all_gather(whole, GroupShape.of(stage.ranks, gpn), cluster, cal) if split else 0.0
            everyone = GroupShape.of(tuple(r for st in holding for r in st.ranks), gpn)
            total += count * (gather + comm.all_reduce(whole, everyone, cluster, cal))
    return total


@dataclass(frozen=True)
class PricedPlan:
    """A plan priced stage by stage, with every device's memory and its gradient-synchronisation terms,
    before its pipeline schedule is simulated (`finish` does that). Seconds and bytes."""

    plan: Plan
    model: ModelSpec
    cluster: Cluster
    cal: Calibration
    costs: list[list[StageCost]]  # per pipeline, per stage (model chunk)
    memory: list[list[MemoryTerms]]  # per pipeline, per device group
    syncs: list[list[tuple[float, float, float]]]  # per device group: (reduce, gather, optimizer) seconds
    host: list[list[float]] = field(default_factory=list)  # per pipeline, per device group: host bytes per device
    nvme: list[list[float]] = field(default_factory=list)  # per pipeline, per device group: NVMe bytes per device

    @property
    def peak_bytes(self) -> float:
        """The largest device's memory, bytes."""
        return max(m.total for mems in self.memory for m in mems)

    @property
    def host_peak_bytes(self) -> float:
        """The fullest node's host memory used by the devices on it, bytes."""
        return self._node_peak(self.host)

    @property
    def nvme_peak_bytes(self) -> float:
        """The fullest node's NVMe used by the devices on it, bytes."""
        return self._node_peak(self.nvme)

    def _node_peak(self, per_device: list[list[float]]) -> float:
        """The largest sum over a node's devices of `per_device` bytes (per pipeline, per device group)."""
        if not any(any(hosts) for hosts in per_device):  # nothing swapped or offloaded: skip the rank walk
            return 0.0
        per_node: dict[int, float] = {}
        for pipe, hosts in zip(self.plan.pipelines, per_device, strict=True):
            pp = len(pipe.stages) // self.plan.chunks
            for d in range(pp):
                for rank in pipe.stages[d].ranks:
                    node = self.cluster.node_of(rank)
                    per_node[node] = per_node.get(node, 0.0) + hosts[d]
        return max(per_node.values(), default=0.0)

    @property
    def fits(self) -> bool:
        """Whether every device's memory fits the GPU and every node's host memory and NVMe its own."""
        return self.peak_bytes <= self.cluster.gpu.memory_bytes and \
            self.host_peak_bytes <= self.cluster.host_side.memory_bytes and \
            self.nvme_peak_bytes <= self.cluster.host_side.nvme_bytes

    def lower_bound_s(self) -> float:
        """Seconds the iteration takes at least: `finish` never predicts less. A device's last backward
        ends no earlier than in the same schedule with every stage as fast as the fastest one (op end times
        only grow with op durations), nor before its forward inputs arrive and it has run all its
        micro-batches; its gradient synchronisation and optimizer follow. 0 where CPU ranks share cores
        (the simulator then shrinks stage times by how many ranks are busy)."""
        if self.cal.measured is not None:
            return 0.0
        plan, multi = self.plan, len(self.plan.pipelines) > 1
        bound = 0.0
        for pi, (pipe, costs) in enumerate(zip(plan.pipelines, self.costs, strict=True)):
            pp, m, runs = len(costs) // plan.chunks, plan.run_micro_batches(pi), plan.schedule_runs
            f = min(c.forward for c in costs)
            b = min(c.backward for c in costs)
            s = min((c.send for c in costs[:-1]), default=0.0)
            if plan.chunks == 1:
                schedule = "1f1b" if plan.schedule == "interleaved" else plan.schedule
                fastest = repeat_runs(simulate_pipeline([StageTimes(f, b, s)] * pp, m, schedule),
                                      runs).last_backward_end_s
            else:  # interleaved, sends left out: (m v + p - 1)(f + b) a run; device d's last backward d b
                # earlier
                span = (m * plan.chunks + pp - 1) * (f + b)
                fastest = tuple(runs * span - d * b for d in range(pp))
            for d in range(pp):
                arrive = sum(c.forward for c in costs[:d])
                busy = pipe.micro_batches * sum(c.forward + c.backward for c in costs[d::pp])
                reduce_t, gather_t, optimizer = self.syncs[pi][d]
                exposed = reduce_t if multi else _exposed_reduce(reduce_t, costs[d::pp], plan, self.cal)
                after = exposed + gather_t + optimizer
                bound = max(bound, max(fastest[d], arrive + busy) + after)
        return bound


def _exposed_reduce(reduce_t: float, chunk_costs: list[StageCost], plan: Plan, cal: Calibration) -> float:
    """Seconds of a device group's gradient reduction (`reduce_t`) left after its last backward: what the
    backward window (at the overlap efficiency) does not hide, and at least the last bucket's share."""
    if not plan.overlap_grad_reduce:
        return reduce_t
    window = sum(c.backward for c in chunk_costs) * cal.overlap_efficiency
    grad_bytes = sum(n * p.params for c in chunk_costs for p, n, _, _ in c.priced) * PRECISIONS[plan.precision].grad
    last_bucket = min(1.0, GRAD_BUCKET_BYTES / max(grad_bytes, 1.0))
    return max(reduce_t - window, reduce_t * last_bucket)


def price_plan(plan: Plan, model: ModelSpec, cluster: Cluster, cal: Calibration | None = None,
               validate: bool = True) -> PricedPlan:
    """Price every stage of `plan` and every device's memory (see PricedPlan). Raises PlaitError if the plan
    is invalid."""
    cal = cal or calibration_for(cluster.gpu.name)
    if validate:
        validate_plan(plan, model, cluster)
    prec = plan_precision(plan.precision, plan.grad_reduce)
    costs = [[_stage_cost(plan, pi, j, model, cluster, cal) for j in range(len(pipe.stages))]
             for pi, pipe in enumerate(plan.pipelines)]
    memory, syncs, host, nvme = [], [], [], []
    for pi, (pipe, pipe_costs) in enumerate(zip(plan.pipelines, costs, strict=True)):
        pp = len(pipe.stages) // plan.chunks
        weights = [[pipe_costs[j].activation_bytes for j in range(d, len(pipe_costs), pp)] for d in range(pp)]
        alive = peak_weighted_in_flight(plan.schedule, pp, plan.run_micro_batches(pi), plan.chunks, weights)
        host.append(_host_bytes(plan, pipe_costs, plan.run_micro_batches(pi), pp))
        nvme.append([sum(count * c.nvme for cost in pipe_costs[d::pp] for c, count, _, _ in cost.priced)
                     for d in range(pp)])
        mems, sync = [], []
        for d in range(pp):
            chunk_costs = pipe_costs[d::pp]
            stage = pipe.stages[d]
            reduce_t, gather_t, optimizer = _grad_sync(chunk_costs, plan, stage, model, cluster, cal, prec)
            optimizer *= _slowest(stage.ranks, cluster)
            sync.append((reduce_t, gather_t, optimizer))
            mems.append(_memory(chunk_costs, alive[d], stage, plan, prec, cal))
        memory.append(mems)
        syncs.append(sync)
    return PricedPlan(plan, model, cluster, cal, costs, memory, syncs, host, nvme)


def _host_bytes(plan: Plan, costs: list[StageCost], micro_batches: int, pp: int) -> list[float]:
    """Host memory of one device of each of a pipeline's `pp` device groups, bytes: its offloaded model states
    and its swapped activations of the micro-batches in flight (weighted like the device's own)."""
    swapped = [[costs[j].swapped_bytes for j in range(d, len(costs), pp)] for d in range(pp)]
    alive = peak_weighted_in_flight(plan.schedule, pp, micro_batches, plan.chunks, swapped) \
        if any(any(w) for w in swapped) else [0.0] * pp
    return [alive[d] + sum(count * c.host for cost in costs[d::pp] for c, count, _, _ in cost.priced)
            for d in range(pp)]


def finish(priced: PricedPlan, record: bool = False, detail: bool = True) -> Report:
    """Simulate the pipeline schedules of a priced plan: the Report. Without `detail`, the p2p time a
    pipeline waits for is counted in its bubble (one schedule simulated instead of two)."""
    plan, model, cluster, cal = priced.plan, priced.model, priced.cluster, priced.cal
    prec = plan_precision(plan.precision, plan.grad_reduce)
    groups: list[DeviceGroup] = []
    multi = len(plan.pipelines) > 1
    all_costs = priced.costs
    staged = _simulate_pipelines(plan, all_costs, record, detail)
    relief = _shared_core_relief(plan, model, cluster, cal, [res for _, _, res, _ in staged])
    if relief < 1.0:  # stage times shrink alike, so the busy fractions that set the relief stay as they were
        staged = _simulate_pipelines(plan, [[_scaled(c, relief) for c in costs] for costs in all_costs], record,
                                     detail)
    results = [res for _, _, res, _ in staged]
    sync_start = max(r.makespan_s for r in results) if multi else None
    for pi, costs, res, no_send in staged:
        pipe = plan.pipelines[pi]
        pp = len(pipe.stages) // plan.chunks
        m = pipe.micro_batches
        for d in range(pp):
            chunk_costs = costs[d::pp]
            stage = pipe.stages[d]
            parts = {k: m * sum(c.parts[k] for c in chunk_costs) for k in chunk_costs[0].parts}
            busy = res.busy_s[d]
            ends = res.last_backward_end_s[d]
            quiet = no_send.last_backward_end_s[d] if no_send else ends
            parts["pp_bubble"] = max(0.0, quiet - busy)
            parts["p2p"] = max(0.0, ends - quiet)
            reduce_t, gather_t, optimizer = priced.syncs[pi][d]
            exposed = _exposed_reduce(reduce_t, chunk_costs, plan, cal)
            if sync_start is not None:  # replicas in other pipelines: wait for the slowest, no overlap
                parts["pp_bubble"] += sync_start - ends
                ends, exposed = sync_start, reduce_t
            parts["dp_comm_exposed"] = exposed + gather_t
            parts["optimizer"] = optimizer
            end = ends + exposed + gather_t + optimizer
            layers = tuple(pipe.stages[j].layers for j in range(d, len(costs), pp))
            groups.append(DeviceGroup(pi, d, stage.ranks, layers, priced.memory[pi][d], end, parts,
                                      priced.host[pi][d], priced.nvme[pi][d]))
    by_kind = _by_kind(plan, all_costs[0], model)
    critical = max(groups, key=lambda g: g.end_s)
    iteration = critical.end_s
    tokens = plan.global_batch * plan.seq_len
    gpus = cluster.world_size
    prec_peak = prec.peak_flops(cluster.gpu)
    model_flops = model.model_flops_per_token(plan.seq_len) * tokens
    hw_flops = model_flops + _recompute_flops(plan, all_costs)
    peak = priced.peak_bytes
    capacity = cluster.gpu.memory_bytes
    return Report(
        iteration_time_s=iteration,
        tokens_per_s=tokens / iteration,
        model_tflops_per_gpu=model_flops / iteration / gpus / 1e12,
        hardware_tflops_per_gpu=hw_flops / iteration / gpus / 1e12,
        mfu=model_flops / iteration / gpus / prec_peak,
        hfu=hw_flops / iteration / gpus / prec_peak,
        peak_memory_gib=peak / GIB,
        memory_capacity_gib=capacity / GIB,
        fits=priced.fits,
        breakdown={k: critical.parts.get(k, 0.0) for k in BREAKDOWN_KEYS},
        devices=tuple(groups),
        pipelines=tuple(results),
        by_kind=by_kind,
        host_memory_gib=priced.host_peak_bytes / GIB,
        host_capacity_gib=cluster.host_side.memory_bytes / GIB,
        nvme_gib=priced.nvme_peak_bytes / GIB,
        nvme_capacity_gib=cluster.host_side.nvme_bytes / GIB,
    )


def simulate(plan: Plan, model: ModelSpec, cluster: Cluster, cal: Calibration | None = None,
             record: bool = False, validate: bool = True, detail: bool = True) -> Report:
    """Predict one training iteration of `plan` (with `cal`, or the GPU type's default calibration).
    Raises PlaitError if the plan is invalid. `detail=False` see `finish`."""
    return finish(price_plan(plan, model, cluster, cal, validate), record, detail)


def _by_kind(plan: Plan, costs: list[StageCost], model: ModelSpec) -> dict[str, KindSummary]:
    """Time and memory of each layer kind of the first pipeline (see KindSummary)."""
    pipe = plan.pipelines[0]
    pp = len(pipe.stages) // plan.chunks
    layers: dict[str, int] = {}
    params: dict[str, float] = {}
    for b in model.stack:
        layers[b.kind] = layers.get(b.kind, 0) + 1
        params[b.kind] = params.get(b.kind, 0.0) + b.params
    layers |= {"embedding": 1, "head": 1}
    params |= {"embedding": float(model.embedding_params), "head": float(model.head_params)}
    seconds = dict.fromkeys(layers, 0.0)
    states: dict[str, list[float]] = {k: [0.0] * pp for k in layers}
    activ: dict[str, list[float]] = {k: [0.0] * pp for k in layers}
    for j, cost in enumerate(costs):
        for (c, count, _, _), kind in zip(cost.priced, cost.kinds, strict=True):
            seconds[kind] += pipe.micro_batches * count * c.micro_batch_s
            states[kind][j % pp] += count * c.states
            activ[kind][j % pp] += count * c.activation
    return {k: KindSummary(layers[k], params[k], seconds[k], max(states[k]) / GIB, max(activ[k]) / GIB)
            for k in layers}


def _recompute_flops(plan: Plan, costs: list[list[StageCost]]) -> float:
    """FLOPs repeated by activation recomputation in one iteration, over all pipelines."""
    return sum(pipe.samples * plan.seq_len * sum(c.recompute_flops_per_token for c in stages)
               for pipe, stages in zip(plan.pipelines, costs, strict=True))


def _memory(costs: list[StageCost], activations: float, stage: Stage, plan: Plan, prec: PrecisionBytes,
            cal: Calibration) -> MemoryTerms:
    weights = grads = optimizer = 0.0
    bucket = 0.0
    for cost in costs:
        for c, count, s, layer in cost.priced:
            weights, grads, optimizer = (weights + count * c.weights, grads + count * c.gradients,
                                         optimizer + count * c.optimizer)
            if len(_dp_ranks(plan, layer, s, stage.ranks)) > 1:
                bucket = 2 * GRAD_BUCKET_BYTES
    activations += max(c.working_bytes for c in costs)
    buffers = max(c.buffer_bytes for c in costs) + bucket
    return with_reserve(weights, grads, optimizer, activations, buffers, cal)
