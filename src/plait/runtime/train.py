"""The training loop every rank runs under torchrun: build the model, apply the plan, train, report.

Numerics: every rank initialises the full model from the seed before sharding (so every plan starts from
the same weights), every plan reads the same global batch per step, and the loss is the mean over all of
its tokens; in fp32 any plan reproduces the single-process loss curve.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import cached_property, partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from plait.errors import PlaitError
from plait.executable import tied_copies
from plait.models import build_model
from plait.models.hf_weights import load_hf_safetensors
from plait.models.mtp import mtp_loss, next_token_kwargs
from plait.models.vision import IGNORE_INDEX, image_targets
from plait.plan import SYNC_P2P, Plan
from plait.runtime import checkpoint, memory, offload, preflight, swap
from plait.runtime.data import SAMPLES_LOG_ENV, TokenSource, log_samples
from plait.runtime.experts import count_choices, expert_load, update_choice_biases
from plait.runtime.loop import lr_at, step_optimizers, train_loop
from plait.runtime.optim import make_optimizer
from plait.runtime.boundary import boundaries
from plait.runtime.parallelize import (
    parallelize_chunk,
    set_whole_gradient,
    sync_gradients,
    sync_whole_gradients,
    whole_gradient,
)
from plait.runtime.pipeline_chunks import ChunkedSchedule
from plait.runtime.pipeline_uneven import UnevenSchedule
from plait.runtime.replica_zero import ReplicaShards, attach, optimizer_params, replica_shards
from plait.runtime.placement import Chunk, Placement, Replicas, check_executable, place
from plait.runtime.stragglers import Adaptive, ComputeClock
from plait.runtime.zero import REDUCE_DTYPES, follow_zero_stages, micro_batch_flags
from plait.spec.model import ModelSpec, load_model

COLLECTIVE_TIMEOUT_S = 300.0
"""Default seconds a rank waits in a collective before failing (gloo's default is 30 minutes)."""


@dataclass(frozen=True)
class TrainConfig:
    """Options of one training run (JSON-serialisable: the launcher hands it to every rank)."""

    model: str
    plan: dict
    steps: int = 10
    seed: int = 0
    lr: float = 3e-4
    warmup: int = 2
    clip: float = 1.0
    dtype: str = "fp32"  # fp32; bf16: autocast over fp32 weights; bf16-pure: bf16 weights, gradients, moments
    data: str | None = None  # a text file, or a token file (.bin/.npy; datasets are tokenized into one first)
    data_dtype: str | None = None  # a .bin token file's element type (default: from its name, else uint16)
    metrics_out: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only after the last step
    resume_from: str | None = None  # a checkpoint directory (step-N) to start from, instead of the newest
    timeout_s: float = COLLECTIVE_TIMEOUT_S  # seconds a rank waits in a collective before failing
    hf_checkpoint: str | None = None  # a Hugging Face safetensors directory to start from
    adaptive: bool = False  # detect straggling ranks and re-plan around them while training
    inject_slow: str | None = None  # simulated stragglers: "RANK:FACTOR@STEP[,...]" (FACTOR 1 = recovered)
    profile: str | None = None  # a `plait profile` file for the re-planning cost model
    switch_via: str = "network"  # how a plan switch moves state: network | dcp (plait.runtime.stragglers)
    replan_degrees: str = "any"  # any: re-plans may change tp and pp degrees; keep: the current ones
    # Variable-length documents (plait.runtime.varlen): the layout method, the file of lengths to draw from,
    # documents per step, tokens a rank holds at once, a static degree, and how a group splits a row.
    varlen: str | None = None
    lengths: str | None = None
    global_batch: int = 0
    capacity: int = 0
    sp: int | None = None
    cp_mode: str = "ulysses"
    varlen_states: str = "sharded"  # model states: sharded over the world (FSDP2, ZeRO-3) | replicated
    offload_above: int = 0  # documents of at least this many tokens swap their saved activations to host; 0 = none
    varlen_stages: int = 1  # pipeline stages; each runs the step's sequence-parallel groups on its own ranks
    nvme_dir: str | None = None  # offload="nvme": the directory of each rank's state files (default: a temp dir)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> TrainConfig:
        return TrainConfig(**json.loads(text))


def build_chunks(spec: ModelSpec, plan: Plan, where: Placement, seed: int, hf_checkpoint: str | None = None,
                 hand_sync: bool = False, dtype: torch.dtype | None = None
                 ) -> tuple[list[torch.nn.Module], list[GradientSync]]:
    """This rank's model chunks: the full model initialised from `seed`, cut to each chunk's layers, cast to
    `dtype` (None: left in fp32), then parallelised with the chunk's strategies; and the gradients that need
    a manual sync (`hand_sync`: every data-parallel reduction after the backward, none inside it)."""
    stages = plan.pipelines[where.pipeline].stages
    reduce = reduce_dtype(plan.grad_reduce, dtype)
    chunks = []
    manual_sync: list[GradientSync] = []
    for chunk in where.chunks:
        j = chunk.index
        model = build_model(spec)
        model.init_weights(seed)
        start, end = stages[j].layers
        for name in list(model.layers.keys()):
            if not start <= int(name) < end:
                del model.layers[name]
        if spec.mtp_layers and j == len(stages) - 1 and (j != 0 or tied_copies(plan)):
            model.mtp_embeddings = copy.deepcopy(model.tok_embeddings)  # summed with the first stage's
        if j != 0:
            model.tok_embeddings = None
            model.pos_embeddings = None
        if j != len(stages) - 1:
            model.norm = None
            model.output = None
        if spec.tied_embeddings and len(stages) == 1 and tied_copies(plan):
            _untie(model)
        if hf_checkpoint:
            load_hf_safetensors(model, hf_checkpoint)
        if dtype is not None:
            model.to(dtype)
        # micro-batches whose mean loss one backward pass sums: torch's pipeline schedules scale the gradients
        # themselves, the runtime's own divide each micro-batch's loss by a run's micro-batches
        if plan.own_schedule(where.pipeline):
            accumulated = plan.run_micro_batches(where.pipeline)
        else:
            accumulated = 1 if where.pp > 1 else plan.pipelines[where.pipeline].micro_batches
        synced = parallelize_chunk(model, chunk, plan.seq_len, pipelined=where.pp > 1 or hand_sync,
                                   grad_accumulation=accumulated, reduce_dtype=reduce)
        manual_sync += [GradientSync(params, group, weight, reduce_dtype=reduce)
                        for params, group, weight in synced]
        chunks.append(model)
    if where.replicas:
        manual_sync += _replica_sync(chunks, where, plan, spec.layers)
    return chunks, manual_sync


PARAM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": None, "bf16-pure": torch.bfloat16}
"""The dtype each `--dtype` casts the model to (None: fp32 weights; bf16 then autocasts the math)."""


def plan_offloads(plan: Plan) -> set[str]:
    """The offload choices of a plan's strategies."""
    return {s.offload for pipe in plan.pipelines for stage in pipe.stages for s in stage.strategies}


def reduce_dtype(grad_reduce: str, params: torch.dtype | None) -> torch.dtype | None:
    """The dtype gradients cross the wire in for a plan's `grad_reduce` with weights of dtype `params` (None:
    fp32): bf16 weights' gradients are upcast for an fp32 reduction (FSDP2's reduce_dtype, as the price's
    `grad_reduce` fp32 counts them), fp32 ones already are."""
    if grad_reduce == "fp32" and params is not None:
        return torch.float32
    return REDUCE_DTYPES[grad_reduce]


@dataclass(frozen=True)
class GradientSync:
    """Gradients reduced by hand over `group`: averaged, or summed after scaling by `weight` (several
    pipelines: the share of the global batch this rank's pipeline trained on; MoE weights: see
    `plait.runtime.experts`), which also applies when the group is this rank alone (None). `whole`: the
    group's ranks shard the parameters differently, so whole gradients are summed (`sync_whole_gradients`).
    `reduce_dtype`: the dtype averaged gradients cross the wire in (the plan's `grad_reduce`; None: their
    own)."""

    params: list[torch.nn.Parameter]
    group: dist.ProcessGroup | None
    weight: float | None = None
    whole: bool = False
    reduce_dtype: torch.dtype | None = None

    def __call__(self) -> None:
        if self.whole:
            assert self.group is not None and self.weight is not None
            sync_whole_gradients(self.params, self.group, self.weight)
        elif self.group is not None:
            sync_gradients(self.params, self.group, self.weight, self.reduce_dtype)
        elif self.weight is not None and self.weight != 1.0:
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params
                     if p.grad is not None]
            torch._foreach_mul_(grads, self.weight)


def _replica_sync(chunks: list[torch.nn.Module], where: Placement, plan: Plan, layers: int) -> list[GradientSync]:
    """Several pipelines: every layer's gradients (and the embedding's and head's) over its replicas in every
    pipeline (`Placement.replicas`), weighted by this pipeline's share of the global batch, in model order
    (the same order on every member of a group). Whole gradients held by several ranks of a pipeline count
    once: each copy gets its share of the weight."""
    weight = plan.pipelines[where.pipeline].samples / plan.global_batch
    by_group: dict[Replicas, list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for model in chunks:
        parts = [(-1, m) for m in (model.tok_embeddings, model.pos_embeddings) if m is not None]
        parts += [(int(name), block) for name, block in model.layers.items()]
        parts += [(layers, m) for m in model.head_modules]
        for key, module in parts:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    by_group.setdefault(where.replicas[key], []).append(p)
    return [GradientSync(params, r.group, weight / r.copies if r.whole else weight, r.whole)
            for r, params in by_group.items()]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of a micro-batch (logits [B, T, V], targets [B, T])."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _text_loss(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """Cross-entropy summed over the targets that count, per position, times `scale` (positions per counted
    target of a whole sequence): the mean over the counted targets, which equal splits of the positions
    (context parallelism) average back to."""
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total * (scale / targets.numel())


def loss_function(spec: ModelSpec, seq_len: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of a micro-batch: the mean cross-entropy, over the text targets when an image takes the
    first positions (`plait.models.vision.image_targets`), with the multi-token-prediction modules' losses
    (`plait.models.mtp.mtp_loss`)."""
    if spec.mtp_layers:
        return mtp_loss
    left_out = max(spec.image_tokens - 1, 0)
    return token_loss if not left_out else partial(_text_loss, scale=seq_len / (seq_len - left_out))


def clip_grads(params: list[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None,
               uncounted: torch.nn.Parameter | None = None, share: float = 1.0) -> float:
    """Clip by the global gradient norm over every shard and stage; returns the norm before clipping.
    `uncounted` is clipped but left out of the norm (the second copy of a tied weight); `share` weighs this
    rank's squared norm in the sum over `pp_group` (`Placement.norm_share`).

    One fused norm per device mesh (a single collective each, torchtitan-style) and one fused multiply."""
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        if uncounted is not None and g is uncounted.grad:
            continue
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    square = torch.zeros((), dtype=torch.float64)
    for mesh, group in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        square += (norm.full_tensor() if mesh is not None else norm).double() ** 2
    if pp_group is not None:
        square *= share
        dist.all_reduce(square, group=pp_group)
    total = square.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if locals_:
            torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
    return float(total)


def _untie(model: torch.nn.Module) -> None:
    """Give the head its own copy of the embedding table it is tied to (equal values), to be laid out like
    the stage's last layer while the embedding's is laid out like its first
    (`plait.executable.tied_copies`)."""
    model.output.weight = torch.nn.Parameter(model.tok_embeddings.weight.detach().clone())


def _tied_weights(chunks: list[torch.nn.Module], where: Placement, plan: Plan) -> list[torch.nn.Parameter]:
    """This rank's copies of an embedding table that the head is tied to or multi-token-prediction modules
    read (`plait.models.mtp`), whose gradients are summed after backward: the embedding's on the first
    stage, the head's (the modules' own copy) on the last, both in a one-stage pipeline that holds two; none
    when one parameter serves both."""
    if where.tied_group is None and where.tied_whole is None:
        return []
    end = chunks[-1].mtp_embeddings if chunks[-1].mtp_embeddings is not None else chunks[-1].output
    return ([chunks[0].tok_embeddings.weight] if where.first else []) + \
        ([end.weight] if where.last(plan) else [])


def _sum_tied_grad(copies: list[torch.nn.Parameter], group: dist.ProcessGroup | None,
                   whole: float | None = None) -> None:
    """Add the head's gradient of a tied embedding table to the embedding's, and back: shard by shard where
    both ends shard it alike, else as whole gradients, this rank's (all its copies' summed) weighted by
    `whole` (`Placement.tied_whole`) and summed over `group` (None: this rank holds every copy)."""
    if whole is None:
        grad = copies[0].grad  # already sharded like the weight (`_shard_grads_like_params`)
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)
        return
    total = torch.stack([whole_gradient(w.grad) for w in copies]).sum(0).mul_(whole)
    if group is not None:
        dist.all_reduce(total, group=group)
    for w in copies:
        set_whole_gradient(w.grad, total)


def _shard_grads_like_params(params: list[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements: a vocabulary-parallel embedding's gradient
    comes out of backward replicated (the whole table on every rank) while its weight is sharded; sharding
    it here frees the rest before the optimizer, which would otherwise redistribute it at every use."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(placements=p.placements)


def _schedule(plan: Plan, chunks: list[torch.nn.Module], where: Placement, micro_batches: int, loss_fn: Callable):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    n_stages = len(plan.pipelines[where.pipeline].stages)
    device = torch.device("cpu")
    for m in chunks:
        follow_zero_stages(m)
    stages = [PipelineStage(m, c.index, n_stages, device, group=where.pp_group) for m, c in zip(chunks, where.chunks)]
    # Several runs a step: torch's scaling divides every gradient, earlier runs' too, so the runs sum their
    # micro-batches' gradients and `_forward_backward` divides once.
    scale = plan.schedule_runs == 1
    if plan.schedule == "interleaved" and plan.chunks > 1:
        return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss_fn, scale_grads=scale), stages
    kind = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    return kind(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=scale), stages


def _uneven_schedule(plan: Plan, spec: ModelSpec, chunks: list[torch.nn.Module], where: Placement, loss_fn: Callable,
                     clock: ComputeClock | None) -> UnevenSchedule | ChunkedSchedule:
    """This rank's schedule in a pipeline whose stages have different widths: its one stage's, or with
    interleaved chunks its stages' in the priced order (`plait.runtime.pipeline_chunks`)."""
    pipe = plan.pipelines[where.pipeline]
    timed = clock.compute if clock is not None else contextlib.nullcontext
    parts = {}
    for model, chunk in zip(chunks, where.chunks):
        before, after = boundaries(plan, where.pipeline, chunk.index, spec, where.pp_group)
        parts[chunk.index] = UnevenSchedule(model, chunk.index, len(pipe.stages), before, after,
                                            plan.run_micro_batches(where.pipeline), loss_fn, plan.schedule,
                                            timed, blocking=plan.p2p in SYNC_P2P)
    if plan.chunks == 1:
        return parts[where.chunks[0].index]
    return ChunkedSchedule(parts, where.group, where.pp, plan.run_micro_batches(where.pipeline), plan.chunks)


@dataclass
class Placed:
    """A plan applied on this rank: its model chunks, optimizers, pipeline schedule and gradient syncs
    (nothing when the plan leaves this rank out)."""

    plan: Plan
    where: Placement
    chunks: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    manual_sync: list[GradientSync]
    schedule: object | None
    tied: list[torch.nn.Parameter]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss

    @cached_property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for m in self.chunks for p in m.parameters()]

    def rows(self) -> tuple[range, tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(first sequence of each of this rank's micro-batches in the global batch, (offset, count) of the
        embedding's rows in a micro-batch, of the loss's rows, the loss's token positions)."""
        where, plan = self.where, self.plan
        pipe = plan.pipelines[where.pipeline]
        offset = sum(p.samples for p in plan.pipelines[: where.pipeline])
        sl = where.output_segment.sequence_slice(plan.seq_len) or (0, plan.seq_len)
        return (range(offset, offset + pipe.samples, pipe.micro_batch_sequences),
                where.input_segment.batch_rows(pipe.micro_batch_sequences),
                where.output_segment.batch_rows(pipe.micro_batch_sequences), sl)


def apply_plan(cfg: TrainConfig, spec: ModelSpec, plan: Plan, clock: ComputeClock | None = None,
               hand_sync: bool = False) -> Placed:
    """Build this rank's share of `plan` (collective: every rank builds every group)."""
    where = place(plan, dist.get_rank(), spec.shares_table,
                  frozenset(i for i, block in enumerate(spec.stack) if block.kind == "moe"))
    loss = loss_function(spec, plan.seq_len)
    if where.idle:
        return Placed(plan, where, [], [], [], None, [], loss)
    chunks, manual_sync = build_chunks(spec, plan, where, cfg.seed, cfg.hf_checkpoint, hand_sync,
                                       PARAM_DTYPES[cfg.dtype])
    sliced = bool(where.replicas)  # checkpoints and switches see whole moments (`replica_zero.whole_view`)
    shards = replica_shards(chunks, where, plan, spec.layers) if sliced else [[] for _ in chunks]
    optimizers = [make_optimizer(optimizer_params(m, s), cfg.lr, _hosted(m, c, s), nvme_dir(cfg, where.rank, c.index))
                  for m, s, c in zip(chunks, shards, where.chunks)]
    for optimizer, s in zip(optimizers, shards):
        attach(optimizer, s)
    schedule = None
    if plan.own_schedule(where.pipeline):
        schedule = _uneven_schedule(plan, spec, chunks, where, loss, clock)
    elif where.pp > 1:
        schedule, stages = _schedule(plan, chunks, where, plan.run_micro_batches(where.pipeline), loss)
        if clock is not None:
            for stage in stages:
                clock.wrap_stage(stage)
    tied = _tied_weights(chunks, where, plan)
    count_choices(chunks)
    return Placed(plan, where, chunks, optimizers, manual_sync, schedule, tied, loss)


def _hosted(model: torch.nn.Module, chunk: Chunk, shards: list[ReplicaShards]) -> dict[int, str]:
    """id -> offload choice of what a chunk's optimizer steps on the host (`plait.runtime.offload`): its
    offloaded layers' parameters, or this rank's slices of them where pipelines split their states."""
    hosted = offload.hosted_params(model, chunk)
    return hosted | {id(view): hosted[id(p)] for s in shards for p, view in s.owned if id(p) in hosted}


def nvme_dir(cfg: TrainConfig, rank: int, chunk: int) -> Path | None:
    """Where rank `rank` keeps the offload="nvme" state files of its chunk `chunk` (None: a temp dir)."""
    return Path(cfg.nvme_dir) / f"rank-{rank}" / f"chunk-{chunk}" if cfg.nvme_dir else None


def _forward_backward(placed: Placed, inputs: list[torch.Tensor], targets: list[torch.Tensor], rows: float,
                      loss_sum: torch.Tensor, autocast, clock: ComputeClock | None) -> None:
    """One step's forwards and backwards (gradient accumulation over micro-batches, or the pipeline
    schedule); adds the loss summed over its `rows` sequences per micro-batch, and the rows, to `loss_sum`."""
    chunks, schedule, where = placed.chunks, placed.schedule, placed.where
    timed = clock.compute if clock is not None else contextlib.nullcontext
    if schedule is None:
        for i, (x, y) in enumerate(zip(inputs, targets)):
            micro_batch_flags(chunks[0], last=i == len(inputs) - 1)  # each unit as its ZeRO stage says
            with timed():
                with autocast:
                    loss = placed.loss(chunks[0](x, **next_token_kwargs(chunks[0], y)), y)
                (loss / len(inputs)).backward()
            loss_sum[0] += loss.detach().double() * rows
            loss_sum[1] += rows
        return
    last = where.last(placed.plan)
    runs = placed.plan.schedule_runs
    per_run = len(inputs) // runs
    losses: list[torch.Tensor] = []
    for k in range(runs):  # one schedule call per run, as NeMo AutoModel's gradient accumulation loop
        mine = slice(k * per_run, (k + 1) * per_run)
        run_losses: list[torch.Tensor] = []  # torch's schedules clear the list they are given
        kwargs = {"target": torch.cat(targets[mine]), "losses": run_losses} if last else {}
        if last and not placed.plan.own_schedule(where.pipeline):  # torch's: MTP chunks' next tokens
            kwargs |= next_token_kwargs(chunks[-1], kwargs["target"])
        with autocast:
            if where.first:
                schedule.step(torch.cat(inputs[mine]), **kwargs)
            else:
                schedule.step(**kwargs)
        losses += run_losses
    if runs > 1:  # plait's schedules average each run's micro-batches, torch's (unscaled) sum them
        own = placed.plan.own_schedule(where.pipeline)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in placed.params
                 if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / (runs if own else len(inputs)))
    for loss in losses:
        loss_sum[0] += loss.detach().double() * rows
        loss_sum[1] += rows


def run(cfg: TrainConfig, report=None, before_step=None) -> list[dict]:
    """Train under an initialised process group; returns (on rank 0) one metrics dict per step.
    `report(record)` gets each step's metrics on rank 0; `before_step(step)` runs on every rank before a
    step is timed."""
    if cfg.varlen:
        from plait.runtime.varlen import run_varlen

        return run_varlen(cfg, report, before_step)
    world = dist.get_world_size()
    spec = load_model(cfg.model)
    plan = Plan.model_validate(cfg.plan)
    check_executable(plan, spec, world)
    if (cfg.adaptive or cfg.inject_slow) and "moe" in spec.kind_counts():
        raise PlaitError(f"re-planning around stragglers does not move MoE experts yet ({spec.name}); drop "
                         "--adaptive and --inject-slow")
    preflight.check_dtype(cfg.dtype, plan_offloads(plan))
    torch.manual_seed(cfg.seed)
    reserve = memory.current_bytes()  # before any model state
    adaptive = Adaptive(cfg, spec, world) if cfg.adaptive or cfg.inject_slow else None
    placed = apply_plan(cfg, spec, plan, adaptive.clock if adaptive else None, hand_sync=adaptive is not None)
    start = resume(cfg, spec, placed.chunks, placed.optimizers, dist.get_rank())
    source = TokenSource(spec.vocab, plan.seq_len, plan.global_batch, cfg.seed, cfg.data, cfg.data_dtype)
    return train_loop(cfg, PlanSteps(cfg, spec, placed, source, adaptive, start, reserve), start, report, before_step)


class PlanSteps:
    """Steps of fixed-length global batches under one plan at a time (`Stepper`): the plan changes only when
    the straggler monitor (`adaptive`) switches it at a step boundary."""

    def __init__(self, cfg: TrainConfig, spec: ModelSpec, placed: Placed, source: TokenSource,
                 adaptive: Adaptive | None, start: int, reserve: float) -> None:
        self.cfg, self.spec, self.placed, self.source, self.adaptive = cfg, spec, placed, source, adaptive
        self.start, self.reserve = start, reserve
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.clock = adaptive.clock if adaptive else None
        # bf16: fp32 master weights and optimizer, bf16 autocast for the forward (and so the backward) math;
        # bf16-pure: the weights themselves are bf16 (`PARAM_DTYPES`), no autocast.
        self.autocast = torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16,
                                       enabled=cfg.dtype == "bf16")
        self.samples_log = os.environ.get(SAMPLES_LOG_ENV)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.placed.optimizers

    def before_step(self, step: int) -> None:
        if self.adaptive:
            self.adaptive.before_step(step)

    def train_step(self, step: int, t0: float) -> dict:
        cfg, spec, placed, source, start = self.cfg, self.spec, self.placed, self.source, self.start
        params, where, plan = placed.params, placed.where, placed.plan
        loss_sum = torch.zeros(2, dtype=torch.float64)
        meter = memory.SavedActivations(params) if step == start else contextlib.nullcontext()
        for chunk in placed.chunks:  # token-wise swapping's byte counts, per step
            if getattr(chunk, "swap_meter", None) is not None:
                chunk.swap_meter.reset()
        grads = 0.0
        grad_norm = 0.0
        if not where.idle:
            # Micro-batch k of a pipeline holds sequences [k, k + B) of the global batch; a layout with
            # data-parallel degree dp gives each of its dp parts B/dp of them.
            micro, (in_first, in_count), (out_first, out_count), sl = placed.rows()
            inputs = [source.rows(step, k + in_first, in_count).inputs for k in micro]
            targets = [image_targets(source.rows(step, k + out_first, out_count).targets, spec)[:, sl[0]: sl[1]]
                       for k in micro]
            if self.samples_log:
                read = {i for k in micro for first, count in ((k + in_first, in_count), (k + out_first, out_count))
                        for i in source.sample_ids(step, first, count)}
                log_samples(self.samples_log, self.rank, step, sorted(read))
            with meter:
                # Each sequence counts once in the reported loss: the tp x cp ranks that compute the loss of
                # the same rows (each over its share of the tokens) split its weight.
                out = where.output_segment.strategy
                _forward_backward(placed, inputs, targets, out_count / (out.tp * out.cp), loss_sum,
                                  self.autocast, self.clock)
        elif self.adaptive:
            self.adaptive.probe()
        _shard_grads_like_params(params)
        if step == start:
            grads = memory.tensor_bytes(p.grad for p in params)
        t1 = time.perf_counter()
        for sync in placed.manual_sync:
            sync()
        if placed.tied and all(w.grad is not None for w in placed.tied):
            _sum_tied_grad(placed.tied, where.tied_group, where.tied_whole)
        t2 = time.perf_counter()
        if not where.idle:
            head_copy = placed.tied[-1] if placed.tied and where.last(plan) else None  # counted once
            grad_norm = clip_grads(params, cfg.clip, where.pp_group, uncounted=head_copy,
                                   share=where.norm_share)
        t3 = time.perf_counter()
        step_optimizers(placed.optimizers)
        t4 = time.perf_counter()
        dist.all_reduce(loss_sum)
        elapsed = time.perf_counter() - t0
        load = expert_load(placed.chunks, spec.layers) if spec.has_experts else None
        update_choice_biases(placed.chunks, spec)
        record = {"step": step, "loss": float(loss_sum[0] / loss_sum[1]), "step_time_s": elapsed,
                  "tokens_per_s": plan.global_batch * plan.seq_len / elapsed, "lr": lr_at(step, cfg),
                  "grad_norm": grad_norm, "peak_memory_bytes": memory.peak_bytes(),
                  "phases_s": {"forward_backward": t1 - t0, "gradient_sync": t2 - t1, "clip": t3 - t2,
                               "optimizer": t4 - t3}}
        if (swapped := swap.step_metrics(placed.chunks)) is not None:
            record["swap"] = swapped
        if (moved := offload.step_metrics(placed.optimizers)) is not None:
            record["offload"] = moved
        if load is not None:  # routed rows of the busiest expert rank over the mean, over the MoE layers
            moe = [x for x, block in zip(load, spec.stack) if block.kind == "moe"]
            record["expert_load"] = {"mean": sum(moe) / len(moe), "max": max(moe)}
        if step == start:  # the peak's terms on every rank, as `plait simulate` predicts them
            mine = memory.terms(memory.tensor_bytes(params), grads, memory.optimizer_state_bytes(placed.optimizers),
                                getattr(meter, "peak", 0.0), self.reserve, memory.peak_bytes())
            by_rank: list[dict | None] = [None] * self.world
            dist.all_gather_object(by_rank, mine)
            record["memory_terms"] = by_rank
        return record

    def after_step(self, step: int, record: dict) -> None:
        """Switch plans around stragglers when the monitor says so (every rank at the same step)."""
        if not self.adaptive:
            return
        new = self.adaptive.after_step(step, self.placed, record)
        if new is not None:
            t5 = time.perf_counter()
            cfg, spec, clock = self.cfg, self.spec, self.clock
            self.placed = self.adaptive.switch(self.placed, new, step + 1,
                                               lambda p: apply_plan(cfg, spec, p, clock, True))
            record["switch"]["seconds"] = time.perf_counter() - t5

    def save(self, done: int) -> None:
        checkpoint.save(self.cfg.checkpoint_dir, done, self.placed.chunks, self.placed.optimizers, self.spec)

    def close(self) -> None:
        if self.adaptive:
            self.adaptive.close()


def resume(cfg: TrainConfig, spec: ModelSpec, chunks: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer],
           rank: int) -> int:
    """Load the checkpoint to start from and return the steps it was saved after (0: none): --resume-from,
    else the newest checkpoint of --checkpoint-dir that loads; rank 0 prints a note for each one skipped."""
    def note(line: str) -> None:
        if rank == 0:
            print(f"note: {line}", file=sys.stderr, flush=True)

    if cfg.resume_from:
        path = Path(cfg.resume_from)
        checkpoint.load(path, chunks, optimizers)
        return checkpoint.step_of(path)
    if not cfg.checkpoint_dir:
        return 0
    candidates = checkpoint.resumable(cfg.checkpoint_dir, spec, note)
    for path in candidates:
        try:
            checkpoint.load(path, chunks, optimizers)
        except PlaitError as exc:
            note(f"{exc}; using the next older checkpoint")
            continue
        return checkpoint.step_of(path)
    if candidates:
        raise PlaitError(f"no checkpoint in {cfg.checkpoint_dir!r} could be loaded; delete them or give another "
                         "--checkpoint-dir")
    return 0


def init_distributed(timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the torchrun job (gloo on CPU, NCCL on GPUs); a collective fails after `timeout_s` seconds."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # After a torchrun restart the rendezvous store still holds the dead ranks' addresses: give every
        # restart its own key space.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=(rank == 0 and not agent_store), timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"plait/restart-{restart}", store), rank=rank,
                                world_size=world, timeout=timeout)
    torch.set_num_threads(1)
