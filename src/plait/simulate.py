"""Simulator: Plan x ModelSpec x Cluster -> Report (iteration time, its breakdown, memory per device).

For every stage the cost model gives per-micro-batch forward and backward times (blocks, embedding, head,
re-layout between differing strategies) and the p2p time to the next stage; the pipeline schedule is
simulated event by event; then each device group reduces its gradients (overlapped with the last
backward where the plan allows) and steps its optimizer. The iteration ends when the last device does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from plait.cost import comm
from plait.cost.calibration import Calibration, calibration_for
from plait.cost.comm import GroupShape
from plait.cost.compute import elementwise_time
from plait.cost.head import embedding_time, head_activation_bytes, head_time
from plait.cost.layer import BlockContext, BlockTime, block_activation_bytes, block_time, runtime_kinds
from plait.cost.memory import GRAD_BUCKET_BYTES, MemoryTerms, model_state_bytes, with_reserve
from plait.cost.pipeline import PipelineResult, StageTimes, peak_weighted_in_flight, simulate_pipeline
from plait.cost.precision import PRECISIONS, PrecisionBytes
from plait.layout import Layout, received_fraction
from plait.plan import Plan, Stage, Strategy, validate_plan
from plait.spec.cluster import GIB, Cluster
from plait.spec.model import ModelSpec

BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "zero_comm", "relayout", "pp_bubble", "p2p",
                  "dp_comm_exposed", "optimizer")


@dataclass(frozen=True)
class StageCost:
    """One stage (model chunk) for one micro-batch on one of its devices, seconds, plus its memory inputs."""

    parts: dict[str, float]  # compute, recompute, tp_comm, cp_comm, zero_comm, relayout
    forward: float
    backward: float
    send: float
    activation_bytes: float  # saved by one micro-batch
    working_bytes: float  # transient on top of the saved activations (recompute, logits)
    params: list[tuple[float, Strategy, int]]  # (parameters, strategy, first layer) of each run, embedding, head
    buffer_bytes: float


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
            "breakdown": self.breakdown,
            "devices": [
                {"pipeline": d.pipeline, "stage": d.index, "ranks": [d.ranks[0], d.ranks[-1]],
                 "layers": [list(r) for r in d.layers], "end_s": d.end_s,
                 "memory_gib": {k: v / GIB for k, v in d.memory.as_dict().items()} | {"total": d.memory.total / GIB}}
                for d in self.devices
            ],
        }


def _dp_ranks(plan: Plan, layer: int, s: Strategy, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Ranks holding the same shard of `layer` (tp coordinate 0: every dp and cp coordinate, since context
    parallel ranks hold the same weights and reduce their gradients too) across every pipeline."""
    own = ranks[:: s.tp]
    if len(plan.pipelines) == 1:
        return own
    out: list[int] = []
    for pipe in plan.pipelines:
        for st in pipe.stages:
            if st.layers[0] <= layer < st.layers[1]:
                other = st.strategy(layer)
                out.extend(st.ranks[:: other.tp])
    return tuple(out)


def _stage_cost(plan: Plan, pipe_index: int, stage_index: int, model: ModelSpec, cluster: Cluster,
                cal: Calibration) -> StageCost:
    pipe = plan.pipelines[pipe_index]
    stage = pipe.stages[stage_index]
    prec = PRECISIONS[plan.precision]
    eb = prec.activation
    last = stage_index == len(pipe.stages) - 1
    parts = dict.fromkeys(("compute", "recompute", "tp_comm", "cp_comm", "zero_comm", "relayout"), 0.0)
    fwd = bwd = 0.0
    act = working = 0.0
    params: list[tuple[float, Strategy, int]] = []
    buffers = 0.0
    prev = pipe.stages[stage_index - 1].strategies[-1] if stage_index > 0 else None  # what arrives
    mb_bytes = pipe.micro_batch_size * plan.seq_len * model.hidden * eb  # one micro-batch's hidden state
    stage_group = GroupShape.of(stage.ranks, cluster.gpus_per_node)
    layer = stage.layers[0]
    for s, count in stage.layer_strategies():
        ctx = BlockContext.for_ranks(model, cluster, cal, prec, plan.seq_len, pipe.micro_batch_size // s.dp, s, stage.ranks,
                       _dp_ranks(plan, layer, s, stage.ranks))
        bt: BlockTime = block_time(s, ctx)
        fwd += count * bt.forward_total
        bwd += count * bt.backward_total
        parts["compute"] += count * (bt.forward + bt.backward)
        parts["recompute"] += count * bt.recompute
        parts["tp_comm"] += count * bt.tp_comm
        parts["cp_comm"] += count * bt.cp_comm
        parts["zero_comm"] += count * bt.zero_comm
        act += count * block_activation_bytes(s, ctx)
        if s.recompute != "none":
            working = max(working, block_activation_bytes(s, ctx, "none"))
        params.append((count * model.block_params / s.tp, s, layer))
        if s.zero == 3 and ctx.dp_group.size > 1:  # FSDP keeps the current and the prefetched block unsharded
            buffers = max(buffers, 2 * model.block_params / s.tp * (prec.param + prec.grad))
        if prev is not None and Layout.of(prev) != Layout.of(s):
            # Re-layout of the hidden state between differing strategies (or from the previous stage's):
            # one exchange over the stage each way (plait.layout); the backward moves the gradient back.
            a, b = Layout.of(prev), Layout.of(s)
            f = comm.exchange(received_fraction(a, b) * mb_bytes, stage_group, cluster, cal)
            g = comm.exchange(received_fraction(b, a) * mb_bytes, stage_group, cluster, cal)
            fwd += f
            bwd += g
            parts["relayout"] += f + g
        prev = s
        layer += count
    first_s, last_s = stage.strategy(stage.layers[0]), stage.strategy(stage.layers[1] - 1)
    if stage_index == 0:
        ctx = BlockContext.for_ranks(model, cluster, cal, prec, plan.seq_len, pipe.micro_batch_size // first_s.dp, first_s,
                       stage.ranks, _dp_ranks(plan, stage.layers[0], first_s, stage.ranks))
        et = embedding_time(first_s, ctx)
        fwd += et.forward + et.tp_comm / 2
        bwd += et.backward + et.tp_comm / 2
        parts["compute"] += et.forward + et.backward
        parts["tp_comm"] += et.tp_comm
        params.append((model.embedding_params / first_s.tp, first_s, stage.layers[0]))
    if last:
        ctx = BlockContext.for_ranks(model, cluster, cal, prec, plan.seq_len, pipe.micro_batch_size // last_s.dp, last_s,
                       stage.ranks, _dp_ranks(plan, stage.layers[1] - 1, last_s, stage.ranks))
        ht = head_time(last_s, ctx)
        fwd += ht.forward + ht.tp_comm / 2
        bwd += ht.backward + ht.tp_comm / 2
        parts["compute"] += ht.forward + ht.backward
        parts["tp_comm"] += ht.tp_comm
        working = max(working, head_activation_bytes(last_s, ctx))
        head = model.head_params + (model.vocab * model.hidden if model.tied_embeddings and stage_index > 0 else 0)
        params.append((head / last_s.tp, last_s, stage.layers[1] - 1))
    send = 0.0
    if not last:
        nxt = pipe.stages[stage_index + 1]
        piece = mb_bytes / (last_s.dp * Layout.of(last_s).token_parts)  # each rank sends its own piece
        cross = comm.nodes_of(stage.ranks, cluster.gpus_per_node) != comm.nodes_of(nxt.ranks, cluster.gpus_per_node)
        send = comm.p2p(piece, cross, cluster, cal)
        buffers += 2 * piece
    speed = _slowest(stage.ranks, cluster)
    if speed != 1.0:
        fwd, bwd = fwd * speed, bwd * speed
        parts = {k: v * speed for k, v in parts.items()}
    return StageCost(parts, fwd, bwd, send, act, working, params, buffers)


def _simulate_pipelines(plan: Plan, all_costs: list[list[StageCost]], record: bool
                        ) -> list[tuple[int, list[StageCost], PipelineResult, PipelineResult | None]]:
    """Each pipeline's schedule simulated from its stage costs: (index, costs, result, result without the
    p2p sends or None when it has none)."""
    staged = []
    for pi, (pipe, costs) in enumerate(zip(plan.pipelines, all_costs, strict=True)):
        times = [StageTimes(c.forward, c.backward, c.send) for c in costs]
        res = simulate_pipeline(times, pipe.micro_batches, plan.schedule, plan.chunks, record=record)
        no_send = None
        if len(costs) > 1 and any(c.send for c in costs):
            no_send = simulate_pipeline([StageTimes(c.forward, c.backward) for c in costs], pipe.micro_batches,
                                        plan.schedule, plan.chunks)
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
    tokens = plan.pipelines[0].micro_batch_size // first.dp * plan.seq_len
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
    reduce_t = gather_t = 0.0
    local_params = 0.0
    for cost in costs:
        for params, s, layer in cost.params:
            dp_group = GroupShape.of(_dp_ranks(plan, layer, s, stage.ranks), cluster.gpus_per_node)
            replicas = dp_group.size
            local_params += params / (replicas if s.zero >= 1 else 1)
            r, g = comm.gradient_sync(params, s.zero, dp_group, prec.grad, prec.param, cluster, cal)
            reduce_t, gather_t = reduce_t + r, gather_t + g
    if model.tied_embeddings and len(plan.pipelines[0].stages) > 1:
        reduce_t += comm.all_reduce(model.vocab * model.hidden * prec.grad, GroupShape(2, 2, 1), cluster, cal)
    optimizer = elementwise_time(local_params * prec.optimizer_traffic, cluster.gpu, cal, kernels=4)
    if cal.measured is not None and cal.measured.optimizer_curve(model.name) is not None:
        optimizer = _measured_optimizer(costs, plan, stage, model, cluster, cal)
    return reduce_t, gather_t, optimizer


def _measured_optimizer(costs: list[StageCost], plan: Plan, stage: Stage, model: ModelSpec, cluster: Cluster,
                        cal: Calibration) -> float:
    """Seconds of the profiled optimizer step (clipping, AdamW, zeroing) over a device's parameters, each at
    the per-parameter rate of the layout its strategy gives it (DTensor shards cost more per parameter
    than plain tensors), plus the largest fixed part."""
    per_param = fixed = 0.0
    for cost in costs:
        for params, s, layer in cost.params:
            replicas = len(_dp_ranks(plan, layer, s, stage.ranks))
            kinds = runtime_kinds(s, replicas) or ([("zero", "zero3", replicas)] if s.zero and replicas > 1 else [])
            curve, stretch = cal.measured.optimizer_curve(model.name, *(kinds[0][1:] if kinds else ("none", 1)))
            per_param += stretch * curve.per_param_s * params / (replicas if s.zero >= 1 else 1)
            fixed = max(fixed, stretch * curve.intercept_s)
    return per_param + fixed


def simulate(plan: Plan, model: ModelSpec, cluster: Cluster, cal: Calibration | None = None,
             record: bool = False, validate: bool = True) -> Report:
    """Predict one training iteration of `plan` (with `cal`, or the GPU type's default calibration).
    Raises PlaitError if the plan is invalid."""
    cal = cal or calibration_for(cluster.gpu.name)
    if validate:
        validate_plan(plan, model, cluster)
    prec = PRECISIONS[plan.precision]
    groups: list[DeviceGroup] = []
    multi = len(plan.pipelines) > 1
    all_costs = [[_stage_cost(plan, pi, j, model, cluster, cal) for j in range(len(pipe.stages))]
                 for pi, pipe in enumerate(plan.pipelines)]
    staged = _simulate_pipelines(plan, all_costs, record)
    relief = _shared_core_relief(plan, model, cluster, cal, [res for _, _, res, _ in staged])
    if relief < 1.0:  # stage times shrink alike, so the busy fractions that set the relief stay as they were
        staged = _simulate_pipelines(plan, [[_scaled(c, relief) for c in costs] for costs in all_costs], record)
    results = [res for _, _, res, _ in staged]
    sync_start = max(r.makespan_s for r in results) if multi else None
    for pi, costs, res, no_send in staged:
        pipe = plan.pipelines[pi]
        pp = len(pipe.stages) // plan.chunks
        m = pipe.micro_batches
        weights = [[costs[j].activation_bytes for j in range(d, len(costs), pp)] for d in range(pp)]
        alive = peak_weighted_in_flight(plan.schedule, pp, m, plan.chunks, weights)
        for d in range(pp):
            chunk_costs = [costs[j] for j in range(d, len(costs), pp)]
            stage = pipe.stages[d]
            parts = {k: m * sum(c.parts[k] for c in chunk_costs) for k in chunk_costs[0].parts}
            busy = res.busy_s[d]
            ends = res.last_backward_end_s[d]
            quiet = no_send.last_backward_end_s[d] if no_send else ends
            parts["pp_bubble"] = max(0.0, quiet - busy)
            parts["p2p"] = max(0.0, ends - quiet)
            reduce_t, gather_t, optimizer = _grad_sync(chunk_costs, plan, stage, model, cluster, cal, prec)
            optimizer *= _slowest(stage.ranks, cluster)
            if sync_start is not None:  # replicas in other pipelines: wait for the slowest, no overlap
                wait = sync_start - ends
                parts["pp_bubble"] += wait
                ends = sync_start
                exposed = reduce_t
            elif plan.overlap_grad_reduce:
                window = sum(c.backward for c in chunk_costs) * cal.overlap_efficiency
                total_grad_bytes = sum(p for c in chunk_costs for p, _, _ in c.params) * prec.grad
                last_bucket = min(1.0, GRAD_BUCKET_BYTES / max(total_grad_bytes, 1.0))
                exposed = max(reduce_t - window, reduce_t * last_bucket)
            else:
                exposed = reduce_t
            parts["dp_comm_exposed"] = exposed + gather_t
            parts["optimizer"] = optimizer
            end = ends + exposed + gather_t + optimizer
            memory = _memory(chunk_costs, alive[d], stage, plan, prec, cal)
            layers = tuple(pipe.stages[j].layers for j in range(d, len(costs), pp))
            groups.append(DeviceGroup(pi, d, stage.ranks, layers, memory, end, parts))
    critical = max(groups, key=lambda g: g.end_s)
    iteration = critical.end_s
    tokens = plan.global_batch * plan.seq_len
    gpus = cluster.world_size
    prec_peak = prec.peak_flops(cluster.gpu)
    model_flops = model.model_flops_per_token(plan.seq_len) * tokens
    hw_flops = model_flops + _recompute_flops(plan, model)
    peak = max(g.memory.total for g in groups)
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
        fits=peak <= capacity,
        breakdown={k: critical.parts.get(k, 0.0) for k in BREAKDOWN_KEYS},
        devices=tuple(groups),
        pipelines=tuple(results),
    )


def _recompute_flops(plan: Plan, model: ModelSpec) -> float:
    """FLOPs repeated by activation recomputation in one iteration, over all pipelines."""
    total = 0.0
    for pipe in plan.pipelines:
        tokens = pipe.samples * plan.seq_len
        for stage in pipe.stages:
            for s, count in stage.layer_strategies():
                if s.recompute == "full":
                    total += count * model.block_flops_per_token(plan.seq_len) * tokens
                elif s.recompute == "selective":
                    total += count * model.attention_flops_per_token(plan.seq_len) * tokens
    return total


def _memory(costs: list[StageCost], activations: float, stage: Stage, plan: Plan, prec: PrecisionBytes,
            cal: Calibration) -> MemoryTerms:
    weights = grads = optimizer = 0.0
    bucket = 0.0
    for cost in costs:
        for params, s, layer in cost.params:
            replicas = len(_dp_ranks(plan, layer, s, stage.ranks))
            w, g, o = model_state_bytes(params, replicas, s.zero, prec)
            weights, grads, optimizer = weights + w, grads + g, optimizer + o
            if replicas > 1:
                bucket = 2 * GRAD_BUCKET_BYTES
    activations += max(c.working_bytes for c in costs)
    buffers = max(c.buffer_bytes for c in costs) + bucket
    return with_reserve(weights, grads, optimizer, activations, buffers, cal)
