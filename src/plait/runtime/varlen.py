"""Training on variable-length documents with a parallel layout that follows each step's data (FlexSP,
ByteScale).

Every step's global batch of documents (lengths drawn from a real distribution) is planned by
`plait.planner.varlen` into micro-batches of groups: a group of ranks packs its documents into one row
(document masks, positions restarting per document) and runs it with Ulysses over exactly those ranks
(FlexSP, static SP), with ring attention over them (ByteScale, static DP x CP), or alone on one rank. The
groups change from micro-batch to micro-batch; their process groups are made once and reused. Planning runs
on rank 0 in a background thread one step ahead (overlapped with training) and its result is broadcast.

Model states (weights, gradients, optimizer state) are sharded over all ranks by default (FSDP2, ZeRO-3, as
FlexSP does: each layer gathered for its forward and backward, gradients reduce-scattered), or replicated
(`--varlen-states replicated`, gradients all-reduced once per step). Either way the loss is the sum of
every target token's cross-entropy divided by the global batch's target tokens, and the gradients are summed
over the ranks (never averaged), so they are the single-process gradient of the whole batch, whatever the
layout. Sharded, every rank makes the same passes in the same order (`slots`): a rank with no work in a
slot runs a one-token filler pass whose loss counts zero. ByteScale's selective offloading
(`cfg.offload_above`): a pass whose row holds a document at least that long swaps every layer's saved
activations to host memory (`runtime/swap.py`), as the planner prices it.

MoE layers: no expert parallelism inside the groups; the experts are states like the dense weights, every
rank routes its own tokens of a row to all experts locally, and the balancing loss takes each document as a
sequence, averaged over the global batch's documents (`routing`), so it too is the same for any layout.

Pipeline stages (`cfg.varlen_stages`): the layout is planned on one stage's ranks and every stage runs it on
its own ranks, holding its layers with states sharded or replicated over those ranks; each pass goes
through the stages in 1F1B order, hidden states handed on to the same place in the next stage
(`DocumentSteps._pipelined`), so every stage makes every pass (fillers included).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from plait.errors import PlaitError
from plait.models import build_model
from plait.models.llama import causal_mask, sdpa_with_sinks
from plait.models.moe import AUX_LOSS_COEF, Documents, MoE
from plait.runtime import checkpoint, memory, swap
from plait.runtime.data import BYTE_VOCAB, TokenSource
from plait.runtime.experts import count_choices, update_choice_biases
from plait.runtime.optim import make_optimizer
from plait.runtime.packing import IGNORE, Packed, contiguous, document_mask, pack, zigzag
from plait.runtime.ring import RingLayout, ring_attention
from plait.runtime.token_files import is_token_file
from plait.runtime.ulysses import Ulysses
from plait.spec.model import ModelSpec, load_model

METHODS = ("flexsp", "bytescale", "static")
STATES = ("sharded", "replicated")
"""How the variable-length runtime keeps model states: sharded over every rank (FSDP2) or replicated."""


@dataclass(frozen=True)
class Work:
    """One group's share of a micro-batch: its ranks and the documents (places in the global batch) it packs."""

    ranks: tuple[int, ...]
    documents: tuple[int, ...]


@dataclass(frozen=True)
class StepLayout:
    """A step's micro-batches (each a list of group works), the planned seconds and the solver's seconds."""

    micro_batches: list[list[Work]]
    planned_s: float
    solve_s: float

    def summary(self) -> str:
        """Group sizes per micro-batch, e.g. "4x1 2x1 | 1x4" (size x count)."""
        return " | ".join(" ".join(f"{d}x{n}" for d, n in sorted(Counter(len(w.ranks) for w in mb).items(),
                                                                     reverse=True)) for mb in self.micro_batches)


class DocumentSource:
    """Every step's documents: `global_batch` lengths drawn (seeded by step) from `lengths` and clipped to
    [1, max_length] (the model's positions); each document holds length + 1 tokens (inputs and next-token
    targets) read from a text file's bytes or a token file, or seeded random tokens."""

    def __init__(self, lengths: np.ndarray, global_batch: int, seed: int, vocab: int, max_length: int,
                 path: str | None = None, dtype: str | None = None) -> None:
        self.pool, self.global_batch, self.seed, self.vocab = lengths, global_batch, seed, vocab
        self.max_length = max_length
        self.text = TokenSource(vocab, max_length, 1, seed, path, dtype) if path else None

    def lengths(self, step: int) -> list[int]:
        rng = np.random.default_rng((self.seed, step))
        return np.clip(rng.choice(self.pool, size=self.global_batch), 1, self.max_length).tolist()

    def documents(self, step: int) -> list[Tensor]:
        out = []
        for i, n in enumerate(self.lengths(step)):
            if self.text is None:
                gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 65_537 + i)
                out.append(torch.randint(0, self.vocab, (n + 1,), generator=gen))
            else:
                span = max(self.text.length - (n + 1), 1)
                start = (step * self.global_batch + i) * 7_919 % span
                out.append(self.text.span(start, n + 1))
        return out


def layout_of(plan, lengths: list[int]) -> StepLayout:
    """A planner's `BatchPlan` as works: each group's lengths mapped back to documents of those lengths
    (equal lengths in batch order)."""
    free: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        free.setdefault(n, []).append(i)
    mbs = [[Work(g.ranks, tuple(free[n].pop(0) for n in g.lengths)) for g in mb.groups] for mb in plan.micro_batches]
    return StepLayout(mbs, plan.seconds, plan.solve_time_s)


def masked(mask: Tensor) -> Callable[..., Tensor]:
    """An attention core (see `Attention.forward`) over whole packed rows that allows exactly `mask` [T, T],
    and of those only the keys within a layer's sliding `window` (tokens; 0: all), with the layer's attention
    `sinks` if it has them."""
    def attend(q: Tensor, k: Tensor, v: Tensor, window: int = 0, sinks: Tensor | None = None) -> Tensor:
        place = torch.arange(mask.shape[-1], device=mask.device)
        allowed = mask & causal_mask(place, place, window) if window else mask
        if sinks is not None:
            return sdpa_with_sinks(q, k, v, sinks, allowed, causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return attend


@dataclass(frozen=True)
class Stages:
    """Pipeline stages of a variable-length run: `count` stages of `width` neighbouring ranks each, this
    rank on stage `index`. A layout's group ranks count within a stage; every stage runs them alike."""

    count: int
    index: int
    width: int

    @staticmethod
    def of(count: int, rank: int, world: int) -> Stages:
        return Stages(count, rank // (world // count), world // count)

    def ranks(self, local: tuple[int, ...], stage: int | None = None) -> tuple[int, ...]:
        """The world ranks of stage-local ranks `local` on `stage` (default: this rank's)."""
        base = (self.index if stage is None else stage) * self.width
        return tuple(base + r for r in local)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


class Groups:
    """Process groups of rank sets, made when first needed (collectively, in the same order on every rank)
    and kept."""

    def __init__(self) -> None:
        self.made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def prepare(self, layout: StepLayout, stages: Stages | None = None) -> None:
        """Make the groups of `layout` (its ranks count within a stage: on every stage of `stages`)."""
        stages = stages or Stages(1, 0, dist.get_world_size())
        for mb in layout.micro_batches:
            for w in mb:
                for stage in range(stages.count):
                    ranks = stages.ranks(w.ranks, stage)
                    if len(ranks) > 1 and ranks not in self.made:
                        self.made[ranks] = dist.new_group(list(ranks))

    def __getitem__(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        return self.made[ranks]


def row_mask(packed: Packed) -> Tensor:
    """Which tokens of a whole packed row each token may attend to: bool [T, T]."""
    place = torch.arange(packed.length)
    return document_mask(packed.documents, place, packed.documents, place)


def local_tokens(packed: Packed, ranks: int, me: int, mode: str) -> int:
    """Tokens of a packed row that member `me` of `ranks` keeps (`run_group`): all alone, its zigzag pieces
    (ring), its contiguous slice (Ulysses)."""
    if ranks == 1:
        return packed.length
    return len((zigzag if mode == "ring" else contiguous)(packed.length, ranks)[me])


def moe_layers(model: nn.Module) -> list[MoE]:
    """The mixture-of-experts feed-forwards of a (stage) model."""
    return [m for m in model.modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def routing(model: nn.Module, packed: Packed, local: Tensor,
            group: dist.ProcessGroup | None) -> Iterator[None]:
    """Every MoE layer of `model` routes this rank's tokens of `packed` (its places `local` in the row)
    to its own experts (no expert parallelism) and takes each document as a sequence of the balancing loss,
    counts summed over `group` (the ranks sharing the row; None: alone)."""
    moes = moe_layers(model)
    count = int(packed.documents[packed.targets != IGNORE].max()) + 1  # the padding's number, if any
    for m in moes:
        m.documents, m.sequence_group = Documents(packed.documents[local], count), group
    try:
        yield
    finally:
        for m in moes:
            m.documents = m.sequence_group = None


def run_group(model: nn.Module, packed: Packed, ranks: tuple[int, ...], mode: str,
              group: dist.ProcessGroup | None, hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """This rank's logits [T_local, V] (or hidden state [T_local, H] on a stage without the head) and
    targets [T_local] of a packed row that `ranks` run together: alone (`len(ranks) == 1`), with Ulysses, or
    with ring attention (`mode`). `hidden` [1, T_local, H]: the previous pipeline stage's output for this
    rank's tokens, read instead of the tokens by a stage without the embedding."""
    d, me = len(ranks), ranks.index(dist.get_rank()) if dist.is_initialized() else 0
    if d == 1:
        x = packed.tokens[None] if hidden is None else hidden
        with routing(model, packed, torch.arange(packed.length), None):
            return model(x, packed.positions, masked(row_mask(packed)))[0], packed.targets
    if mode == "ring":
        parts = zigzag(packed.length, d)
        layout = RingLayout(group, ranks, tuple(parts), tuple(packed.documents[p] for p in parts))
        local = packed.take(parts[me])
        x = local.tokens[None] if hidden is None else hidden
        with routing(model, packed, parts[me], group):
            return model(x, local.positions, partial(ring_attention, layout=layout))[0], local.targets
    mine = contiguous(packed.length, d)[me]
    mask = row_mask(packed)
    attentions = [layer.attention for layer in model.layers.values()]
    model.sequence_slice = (int(mine[0]), int(mine[-1]) + 1)
    for a in attentions:
        a.context_parallel = Ulysses(group)
    try:
        x = packed.tokens[None] if hidden is None else hidden
        with routing(model, packed, mine, group):
            return model(x, packed.positions, masked(mask))[0], packed.targets[mine]
    finally:
        model.sequence_slice = None
        for a in attentions:
            a.context_parallel = None


def slots(mb: list[Work]) -> list[list[Work]]:
    """A micro-batch's works in passes that every rank makes together: a work goes in the first slot after
    every slot its ranks already use, so each rank's works keep the layout's order and all ranks of a work
    run it in the same slot."""
    used: dict[int, int] = {}
    out: list[list[Work]] = []
    for w in mb:
        slot = max(used.get(r, 0) for r in w.ranks)
        used.update(dict.fromkeys(w.ranks, slot + 1))
        out.extend([] for _ in range(slot + 1 - len(out)))
        out[slot].append(w)
    return out


def shard_states(model: nn.Module, mesh) -> None:
    """FSDP2 (ZeRO-3) over the ranks of the 1-D `mesh` (all ranks, or a pipeline stage's): each layer and
    the rest (embedding, norm, head) one unit; gradients summed over the ranks, not averaged (the loss is
    already divided by the batch's tokens)."""
    from torch.distributed.fsdp import FSDPModule

    from plait.runtime.zero import shard_unit

    for layer in model.layers.values():
        shard_unit(layer, mesh, 3)
    shard_unit(model, mesh, 3)
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        if mesh.size() > 1:  # gloo has no pre-multiplied sum (see plait.runtime.experts._zero)
            unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)


def stage_model(spec: ModelSpec, seed: int, stages: Stages) -> nn.Module:
    """This rank's stage of the model (`plait.planner.varlen.stage_layers`), initialised from `seed` as the
    whole model is: its layers, the embedding on the first stage, the norm and head on the last."""
    from plait.planner.varlen import stage_layers

    model = build_model(spec)
    model.init_weights(seed)
    start, end = stage_layers(spec.layers, stages.count)[stages.index]
    for name in list(model.layers.keys()):
        if not start <= int(name) < end:
            del model.layers[name]
    if not stages.first:
        model.tok_embeddings = model.pos_embeddings = None
    if not stages.last:
        model.norm = model.output = None
    return model


FILLER = torch.tensor([0, 0])
"""The document of a filler pass: one input token and one target."""


def padding_multiple(ranks: int, mode: str) -> int:
    """Rows run by `ranks` ranks are padded to a multiple of this (ring: two zigzag pieces per rank)."""
    return 1 if ranks == 1 else 2 * ranks if mode == "ring" else ranks


class Planner:
    """Plans step layouts on rank 0 in a background thread, one step ahead; every rank gets each step's
    layout by broadcast."""

    def __init__(self, cfg, spec: ModelSpec, source: DocumentSource, world: int) -> None:
        from plait.cost.measured import local_cost
        from plait.planner.varlen import SequenceCost, smallest_degree

        self.cfg, self.source, self.world = cfg, source, world
        self.rank = dist.get_rank()
        cluster, cal = local_cost(cfg.profile, world)
        precision = "bf16" if cfg.dtype == "bf16" else "fp32"
        self.cost = SequenceCost(spec, cluster, cal, precision, self.mode, cfg.offload_above, cfg.varlen_stages)
        # Static: one degree for the whole run, the smallest that holds the longest document it can meet.
        self.degree = (cfg.sp or smallest_degree(spec.max_seq_len, cfg.capacity, world // cfg.varlen_stages)) \
            if cfg.varlen == "static" else None
        self.pool = ThreadPoolExecutor(1) if self.rank == 0 else None
        self.pending: dict[int, Future] = {}

    @property
    def mode(self) -> str:
        return "ring" if self.cfg.varlen == "bytescale" or self.cfg.cp_mode == "ring" else "ulysses"

    def _plan(self, step: int) -> StepLayout:
        from plait.planner.varlen import plan_batch

        lengths = self.source.lengths(step)
        return layout_of(plan_batch(lengths, self.world, self.cost, self.cfg.capacity, self.cfg.varlen,
                                    self.degree), lengths)

    def layout(self, step: int, last: int) -> tuple[StepLayout, float]:
        """The layout of `step` and the seconds rank 0 waited for it; starts planning step + 1."""
        box: list[object] = [None]
        waited = 0.0
        if self.pool is not None:
            t0 = time.perf_counter()
            future = self.pending.pop(step, None) or self.pool.submit(self._plan, step)
            if step + 1 < last:
                self.pending[step + 1] = self.pool.submit(self._plan, step + 1)
            try:
                box[0] = future.result()
            except PlaitError as exc:
                box[0] = exc
            waited = time.perf_counter() - t0
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], PlaitError):
            raise box[0]
        return box[0], waited  # type: ignore[return-value]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


VARLEN_FAMILIES = ("llama", "gpt")
"""Families whose packed documents the variable-length runtime trains (plait.models.llama's Transformer)."""


def check_config(cfg, spec: ModelSpec, world: int) -> None:
    """PlaitError for a variable-length run this runtime cannot do, naming the fix."""
    if spec.family not in VARLEN_FAMILIES:
        raise PlaitError(f"--varlen packs documents for decoder-only models ({', '.join(VARLEN_FAMILIES)}), not "
                         f"{spec.family} ({spec.name}); drop --varlen")
    if spec.mtp_layers:
        raise PlaitError(f"--varlen packs documents, and {spec.name} ends in multi-token-prediction modules, which "
                         "read the tokens ahead of whole sequences; drop --varlen or mtp")
    if cfg.varlen not in METHODS:
        raise PlaitError(f"--varlen must be one of {', '.join(METHODS)}, got {cfg.varlen!r}")
    if cfg.varlen_states not in STATES:
        raise PlaitError(f"--varlen-states must be one of {', '.join(STATES)}, got {cfg.varlen_states!r}")
    if cfg.offload_above < 0:
        raise PlaitError(f"--offload-above is a document length in tokens (0: no offloading), "
                         f"got {cfg.offload_above}")
    if cfg.cp_mode not in ("ulysses", "ring"):
        raise PlaitError(f"--cp-mode must be ulysses or ring, got {cfg.cp_mode!r}")
    if cfg.capacity <= 0:
        raise PlaitError(f"--capacity must be a positive number of tokens per rank, got {cfg.capacity}")
    stages = cfg.varlen_stages
    if stages < 1 or world % stages or stages > spec.layers:
        raise PlaitError(f"--varlen-stages must divide the {world} ranks and leave every stage a layer of "
                         f"{spec.layers}; got {stages}")
    if stages > 1 and spec.tied_embeddings:
        raise PlaitError(f"--varlen-stages cuts the model, and {spec.name} ties its head to the embedding; use "
                         "--varlen-stages 1 or an untied model")
    world //= stages  # what follows is about one stage's ranks
    if cfg.sp is not None and (cfg.varlen != "static" or cfg.sp <= 0 or cfg.sp & (cfg.sp - 1) or cfg.sp > world):
        raise PlaitError(f"--sp goes with --varlen static and is a power of two up to {world}; got {cfg.sp}")
    if spec.max_seq_len > cfg.capacity * world:
        raise PlaitError(f"documents are cut at the model's {spec.max_seq_len} positions, more than {world} ranks "
                         f"{'of a stage ' if stages > 1 else ''}"
                         f"hold at --capacity {cfg.capacity}; raise it to "
                         f"{-(-spec.max_seq_len // world)} or use a model with fewer positions (seq=...)")
    ulysses = cfg.varlen != "bytescale" and cfg.cp_mode == "ulysses"
    largest = 1 << (world.bit_length() - 1)
    if ulysses and spec.heads % min(largest, cfg.sp or largest):
        raise PlaitError(f"Ulysses groups of up to {min(largest, cfg.sp or largest)} ranks need the heads "
                         f"({spec.heads}) to divide among them; use --cp-mode ring or fewer ranks")
    if cfg.data and not is_token_file(cfg.data) and spec.vocab < BYTE_VOCAB:
        raise PlaitError(f"the byte-level tokenizer needs a vocabulary of at least {BYTE_VOCAB}; {spec.name} has "
                         f"{spec.vocab}")
    for name, value in (("--adaptive", cfg.adaptive),
                        ("--hf-checkpoint", cfg.hf_checkpoint), ("--inject-slow", cfg.inject_slow)):
        if value:
            raise PlaitError(f"{name} does not combine with --varlen yet; drop one of them")


def run_varlen(cfg, report=None, before_step=None) -> list[dict]:
    """Train `cfg.steps` steps of variable-length documents; returns (on rank 0) one metrics dict per step."""
    from plait.planner.varlen import load_lengths
    from plait.runtime.loop import train_loop
    from plait.runtime.train import resume

    world = dist.get_world_size()
    spec = load_model(cfg.model)
    check_config(cfg, spec, world)
    torch.manual_seed(cfg.seed)
    source = DocumentSource(load_lengths(cfg.lengths), cfg.global_batch, cfg.seed, spec.vocab,
                            spec.max_seq_len, cfg.data, cfg.data_dtype)
    steps = DocumentSteps(cfg, spec, source, world)
    start = steps.start = resume(cfg, spec, [steps.model], [steps.optimizer], dist.get_rank())
    return train_loop(cfg, steps, start, report, before_step)


class DocumentSteps:
    """Steps of variable-length documents (`plait.runtime.loop.Stepper`): each step's documents are laid
    out by the planner (one step ahead, on rank 0) and packed per group; model states sharded over all ranks
    or replicated (`cfg.varlen_states`)."""

    def __init__(self, cfg, spec: ModelSpec, source: DocumentSource, world: int) -> None:
        self.cfg, self.spec, self.source, self.rank = cfg, spec, source, dist.get_rank()
        self.reserve = memory.current_bytes()  # before any model state
        from torch.distributed.device_mesh import init_device_mesh

        self.sharded = cfg.varlen_states == "sharded"
        self.stages = Stages.of(cfg.varlen_stages, self.rank, world)
        self.model = stage_model(spec, cfg.seed, self.stages)
        mesh = init_device_mesh("cpu", (self.stages.count, self.stages.width), mesh_dim_names=("pp", "sp"))
        # a stage's ranks (they sum its gradients) and this rank's peers on the other stages (the norm)
        self.stage_group = mesh["sp"].get_group() if self.stages.count > 1 else None
        self.pp_group = mesh["pp"].get_group() if self.stages.count > 1 else None
        if self.sharded:
            shard_states(self.model, mesh["sp"])
        # ByteScale's selective offloading: passes holding a document of at least cfg.offload_above tokens
        # swap every layer's saved activations to host memory (exact values back in backward).
        self.swaps = swap.switchable(self.model) if cfg.offload_above > 0 else []
        self.moes = moe_layers(self.model)
        count_choices([self.model])  # DeepSeek-V3's choice biases move after every step, as fixed-length runs'
        self.choice_counts = {m: m.choice_counts for m in self.moes if m.choice_counts is not None}
        self.params = list(self.model.parameters())
        self.optimizer = make_optimizer(self.params, cfg.lr)
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
        self.planner = Planner(cfg, spec, source, world)
        self.groups = Groups()
        self.start = 0  # the first step this run trains (set after resuming)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def before_step(self, step: int) -> None:
        pass

    def train_step(self, step: int, t0: float) -> dict:
        from plait.runtime.loop import lr_at, step_optimizers
        from plait.runtime.train import clip_grads

        cfg, rank = self.cfg, self.rank
        layout, waited = self.planner.layout(step, cfg.steps)  # this step's plan
        self.groups.prepare(layout, self.stages)
        docs = self.source.documents(step)
        total = sum(len(d) - 1 for d in docs)  # target tokens of the global batch
        loss_sum = torch.zeros((), dtype=torch.float64)
        first = step == self.start
        if self.swaps:
            self.model.swap_meter.reset()
        meter = memory.SavedActivations(self.params) if first else contextlib.nullcontext()
        t1 = time.perf_counter()
        local = rank % self.stages.width  # this rank's place in its stage (the layout's ranks)
        with meter:
            # A rank may serve several groups of a micro-batch one after another (ByteScale's spread
            # sequences); every rank takes its works in the layout's order, so no two groups wait on
            # each other. Sharded states are gathered by all ranks of a stage at once, and pipeline stages
            # hand every pass on: each rank makes one pass per slot, a filler where it has no work.
            passes = [next((w for w in slot if local in w.ranks), None)
                      for mb in layout.micro_batches for slot in slots(mb)]
            if self.stages.count > 1:
                loss_sum += self._pipelined(passes, docs, total)
            else:
                for mine in passes:
                    if mine is not None or self.sharded:
                        loss_sum += self._pass(mine, docs, total)
        t2 = time.perf_counter()
        if not self.sharded:
            sum_gradients(self.params, self.stage_group)
        grads = memory.tensor_bytes(p.grad for p in self.params) if first else 0.0
        grad_norm = clip_grads(self.params, cfg.clip, self.pp_group)
        step_optimizers([self.optimizer])
        for moe, counts in self.choice_counts.items():
            moe.choice_counts = counts
        update_choice_biases([self.model], self.spec)
        dist.all_reduce(loss_sum)
        elapsed = time.perf_counter() - t0
        record = {"step": step, "loss": float(loss_sum / total), "step_time_s": elapsed,
                  "tokens_per_s": total / elapsed, "tokens": total, "lr": lr_at(step, cfg),
                  "grad_norm": grad_norm, "peak_memory_bytes": memory.peak_bytes(),
                  "layout": layout.summary(), "stages": self.stages.count, "planned_s": layout.planned_s,
                  "solve_s": layout.solve_s,
                  "plan_wait_s": waited, "phases_s": {"plan_and_groups": t1 - t0, "forward_backward": t2 - t1,
                                                      "gradient_sync_and_step": elapsed - (t2 - t0)}}
        if (swapped := swap.step_metrics([self.model])) is not None:
            record["swap"] = swapped
        if first:  # the peak's terms on every rank, as `plait simulate` predicts them
            mine_terms = memory.terms(memory.tensor_bytes(self.params), grads,
                                      memory.optimizer_state_bytes([self.optimizer]), getattr(meter, "peak", 0.0),
                                      self.reserve, memory.peak_bytes())
            by_rank: list[dict | None] = [None] * dist.get_world_size()
            dist.all_gather_object(by_rank, mine_terms)
            record["memory_terms"] = by_rank
        return record

    def _prepare(self, work: Work | None, docs: list[Tensor]) -> tuple[Packed, tuple[int, ...],
                                                                       dist.ProcessGroup | None]:
        """The packed row of `work` (a filler's if None), the world ranks running it on this rank's stage and
        their group; sets ByteScale's selective offloading for the pass."""
        from plait.planner.varlen import offloaded

        ranks = self.stages.ranks(work.ranks) if work is not None else (self.rank,)
        rows = [docs[i] for i in work.documents] if work is not None else [FILLER]
        packed = pack(rows, padding_multiple(len(ranks), self.planner.mode))
        offload = work is not None and any(offloaded(len(docs[i]) - 1, self.cfg.offload_above)
                                           for i in work.documents)
        for layer_swap in self.swaps:
            layer_swap.share = 1.0 if offload else 0.0
        for moe in self.moes:  # balancing loss: the mean over the global batch's documents (a filler's: 0)
            moe.aux_scale = 0.0 if work is None else AUX_LOSS_COEF / len(docs)
        for moe, counts in self.choice_counts.items():  # a filler's choices count in no bias update
            moe.choice_counts = counts if work is not None else torch.zeros_like(counts)
        return packed, ranks, self.groups[ranks] if len(ranks) > 1 else None

    def _loss(self, logits: Tensor, targets: Tensor, work: Work | None) -> Tensor:
        loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")
        return loss * 0.0 if work is None else loss

    def _pass(self, work: Work | None, docs: list[Tensor], total: int) -> Tensor:
        """Forward and backward of this rank's share of `work` (a filler pass, counting zero, if None);
        returns its summed token loss (float64)."""
        packed, ranks, group = self._prepare(work, docs)
        with self.autocast:
            logits, targets = run_group(self.model, packed, ranks, self.planner.mode, group)
            loss = self._loss(logits, targets, work)
        (loss / total).backward()
        return loss.detach().double()

    def _pipelined(self, passes: list[Work | None], docs: list[Tensor], total: int) -> Tensor:
        """Every pass of the step (work or filler) through the pipeline stages in 1F1B order
        (`plait.runtime.pipeline_uneven.order`, each pass a micro-batch): a stage runs a pass's forward on
        its share of the pass's group and hands its hidden state [T_local, H] to the same place on the next
        stage, which reads it instead of the tokens; the last stage adds the loss; backwards run from the
        loss or from the gradient the next stage sends back, and send the input's gradient on. Returns the
        summed loss of this rank's tokens (float64; zero off the last stage)."""
        from plait.runtime.pipeline_uneven import order

        stages, mode, width = self.stages, self.planner.mode, self.stages.width
        loss_sum = torch.zeros((), dtype=torch.float64)
        saved: dict[int, tuple[Tensor | None, Tensor]] = {}  # pass -> (received input, output or loss)
        pending: list[tuple[dist.Work, Tensor]] = []  # sends in flight, with their buffers
        for what, k in order("1f1b", stages.count, stages.index, len(passes)):
            if what == "F":
                packed, ranks, group = self._prepare(passes[k], docs)
                hidden = None
                if not stages.first:
                    size = local_tokens(packed, len(ranks), ranks.index(self.rank), mode)
                    hidden = torch.empty(1, size, self.spec.hidden)
                    dist.recv(hidden, src=self.rank - width)
                    hidden.requires_grad_()
                with self.autocast:
                    out, targets = run_group(self.model, packed, ranks, mode, group, hidden)
                    if stages.last:
                        out = self._loss(out, targets, passes[k])
                if stages.last:
                    loss_sum += out.detach().double()
                else:
                    pending.append(_send(out.float()[None], self.rank + width))
                saved[k] = (hidden, out)
                continue
            hidden, out = saved.pop(k)
            if stages.last:
                (out / total).backward()
            else:
                grad = torch.empty(out.shape, dtype=torch.float32)
                dist.recv(grad, src=self.rank + width)
                torch.autograd.backward(out, grad.to(out.dtype))
            if hidden is not None:
                pending.append(_send(hidden.grad, self.rank - width))
        for handle, _ in pending:
            handle.wait()
        return loss_sum

    def after_step(self, step: int, record: dict) -> None:
        pass  # the layout changes every step inside train_step; there is no plan to switch between steps

    def save(self, done: int) -> None:
        checkpoint.save(self.cfg.checkpoint_dir, done, [self.model], [self.optimizer], self.spec)

    def close(self) -> None:
        self.planner.close()


def _send(tensor: Tensor, dst: int) -> tuple[dist.Work, Tensor]:
    """A non-blocking send of a contiguous copy of `tensor` to `dst`, with the buffer it reads."""
    buffer = tensor.detach().contiguous()
    return dist.isend(buffer, dst=dst), buffer


def sum_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter's gradient over the ranks of `group` (default: all; one flat all-reduce; a rank
    that did not touch a parameter adds zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    start = 0
    for p, g in zip(params, grads):
        p.grad = flat[start: start + g.numel()].view_as(p).clone()
        start += g.numel()
