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
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
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
from plait.models.llama import causal_mask
from plait.runtime import checkpoint, memory, swap
from plait.runtime.data import BYTE_VOCAB, TokenSource
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
    and of those only the keys within a layer's sliding `window` (tokens; 0: all)."""
    def attend(q: Tensor, k: Tensor, v: Tensor, window: int = 0) -> Tensor:
        place = torch.arange(mask.shape[-1], device=mask.device)
        allowed = mask & causal_mask(place, place, window) if window else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return attend


class Groups:
    """Process groups of rank sets, made when first needed (collectively, in the same order on every rank)
    and kept."""

    def __init__(self) -> None:
        self.made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def prepare(self, layout: StepLayout) -> None:
        for mb in layout.micro_batches:
            for w in mb:
                if len(w.ranks) > 1 and w.ranks not in self.made:
                    self.made[w.ranks] = dist.new_group(list(w.ranks))

    def __getitem__(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        return self.made[ranks]


def row_mask(packed: Packed) -> Tensor:
    """Which tokens of a whole packed row each token may attend to: bool [T, T]."""
    place = torch.arange(packed.length)
    return document_mask(packed.documents, place, packed.documents, place)


def run_group(model: nn.Module, packed: Packed, ranks: tuple[int, ...], mode: str,
              group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """This rank's logits [T_local, V] and targets [T_local] of a packed row that `ranks` run together:
    alone (`len(ranks) == 1`), with Ulysses, or with ring attention (`mode`)."""
    d, me = len(ranks), ranks.index(dist.get_rank()) if dist.is_initialized() else 0
    if d == 1:
        return model(packed.tokens[None], packed.positions, masked(row_mask(packed)))[0], packed.targets
    if mode == "ring":
        parts = zigzag(packed.length, d)
        layout = RingLayout(group, ranks, tuple(parts), tuple(packed.documents[p] for p in parts))
        local = packed.take(parts[me])
        return model(local.tokens[None], local.positions, partial(ring_attention, layout=layout))[0], local.targets
    mine = contiguous(packed.length, d)[me]
    mask = row_mask(packed)
    attentions = [layer.attention for layer in model.layers.values()]
    model.sequence_slice = (int(mine[0]), int(mine[-1]) + 1)
    for a in attentions:
        a.context_parallel = Ulysses(group)
    try:
        return model(packed.tokens[None], packed.positions, masked(mask))[0], packed.targets[mine]
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


def shard_states(model: nn.Module, world: int) -> None:
    """FSDP2 (ZeRO-3) over all `world` ranks: each layer and the rest (embedding, norm, head) one unit;
    gradients summed over the ranks, not averaged (the loss is already divided by the batch's tokens)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from plait.runtime.zero import shard_unit

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        shard_unit(layer, mesh, 3)
    shard_unit(model, mesh, 3)
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        if world > 1:  # gloo has no pre-multiplied sum (see plait.runtime.experts._zero)
            unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)


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
        self.cost = SequenceCost(spec, cluster, cal, precision, self.mode, cfg.offload_above)
        # Static: one degree for the whole run, the smallest that holds the longest document it can meet.
        self.degree = (cfg.sp or smallest_degree(spec.max_seq_len, cfg.capacity, world)) \
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
    if "moe" in spec.kind_counts():
        raise PlaitError(f"--varlen does not train MoE layers yet ({spec.name}); drop --varlen")
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
    if cfg.sp is not None and (cfg.varlen != "static" or cfg.sp <= 0 or cfg.sp & (cfg.sp - 1) or cfg.sp > world):
        raise PlaitError(f"--sp goes with --varlen static and is a power of two up to {world}; got {cfg.sp}")
    if spec.max_seq_len > cfg.capacity * world:
        raise PlaitError(f"documents are cut at the model's {spec.max_seq_len} positions, more than {world} ranks "
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
        self.sharded = cfg.varlen_states == "sharded"
        self.model = build_model(spec)
        self.model.init_weights(cfg.seed)
        if self.sharded:
            shard_states(self.model, world)
        # ByteScale's selective offloading: passes holding a document of at least cfg.offload_above tokens
        # swap every layer's saved activations to host memory (exact values back in backward).
        self.swaps = swap.switchable(self.model) if cfg.offload_above > 0 else []
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
        self.groups.prepare(layout)
        docs = self.source.documents(step)
        total = sum(len(d) - 1 for d in docs)  # target tokens of the global batch
        loss_sum = torch.zeros((), dtype=torch.float64)
        first = step == self.start
        if self.swaps:
            self.model.swap_meter.reset()
        meter = memory.SavedActivations(self.params) if first else contextlib.nullcontext()
        t1 = time.perf_counter()
        with meter:
            for mb in layout.micro_batches:
                # A rank may serve several groups of a micro-batch one after another (ByteScale's spread
                # sequences); every rank takes its works in the layout's order, so no two groups wait on
                # each other. Sharded states are gathered by all ranks at once: each makes one pass per
                # slot, a filler where it has no work.
                for slot in slots(mb):
                    mine = next((w for w in slot if rank in w.ranks), None)
                    if mine is None and not self.sharded:
                        continue
                    loss_sum += self._pass(mine, docs, total)
        t2 = time.perf_counter()
        if not self.sharded:
            sum_gradients(self.params)
        grads = memory.tensor_bytes(p.grad for p in self.params) if first else 0.0
        grad_norm = clip_grads(self.params, cfg.clip, None)
        step_optimizers([self.optimizer])
        dist.all_reduce(loss_sum)
        elapsed = time.perf_counter() - t0
        record = {"step": step, "loss": float(loss_sum / total), "step_time_s": elapsed,
                  "tokens_per_s": total / elapsed, "tokens": total, "lr": lr_at(step, cfg),
                  "grad_norm": grad_norm, "peak_memory_bytes": memory.peak_bytes(),
                  "layout": layout.summary(), "planned_s": layout.planned_s, "solve_s": layout.solve_s,
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

    def _pass(self, work: Work | None, docs: list[Tensor], total: int) -> Tensor:
        """Forward and backward of this rank's share of `work` (a filler pass, counting zero, if None);
        returns its summed token loss (float64)."""
        from plait.planner.varlen import offloaded

        mode = self.planner.mode
        ranks = work.ranks if work is not None else (self.rank,)
        rows = [docs[i] for i in work.documents] if work is not None else [FILLER]
        packed = pack(rows, padding_multiple(len(ranks), mode))
        group = self.groups[ranks] if len(ranks) > 1 else None
        offload = work is not None and any(offloaded(len(docs[i]) - 1, self.cfg.offload_above)
                                           for i in work.documents)
        for layer_swap in self.swaps:
            layer_swap.share = 1.0 if offload else 0.0
        with self.autocast:
            logits, targets = run_group(self.model, packed, ranks, mode, group)
            loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")
        if work is None:
            loss = loss * 0.0
        (loss / total).backward()
        return loss.detach().double()

    def after_step(self, step: int, record: dict) -> None:
        pass  # the layout changes every step inside train_step; there is no plan to switch between steps

    def save(self, done: int) -> None:
        checkpoint.save(self.cfg.checkpoint_dir, done, [self.model], [self.optimizer], self.spec)

    def close(self) -> None:
        self.planner.close()


def sum_gradients(params: list[nn.Parameter]) -> None:
    """Sum every parameter's gradient over all ranks (one flat all-reduce; a rank that did not touch a
    parameter adds zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    start = 0
    for p, g in zip(params, grads):
        p.grad = flat[start: start + g.numel()].view_as(p).clone()
        start += g.numel()
