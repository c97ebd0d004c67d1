"""Measure one transformer block, the embedding and the head on this device, and fit their cost curves.

Method (every number is a difference, so that what the models share cancels out):

* **Blocks, by difference of layer counts.** For every micro-batch (seqs, seq_len) a model of
  L1 = `BASE_LAYERS` blocks and one of L2 = `BASE_LAYERS + EXTRA_LAYERS` blocks (no embedding, no head:
  the input is a hidden state [B, T, H] that requires grad, as on a middle pipeline stage) are timed
  alike; block seconds = (t(L2) - t(L1)) / (L2 - L1). The Python overhead of the model's forward, the
  input and the output cancel.
* **Embedding and head, by their own differences.** Three models of L1 blocks: A = the blocks alone
  (hidden in, hidden out), C = token embedding + blocks (tokens in, hidden out), B = embedding + blocks +
  final norm + LM head + cross-entropy loss (tokens in, scalar loss out); embedding = t(C) - t(A) and
  head = t(B) - t(C). The embedding is a table lookup, far cheaper than a block: its samples are small
  differences and may come out slightly negative (noise); its curves are clamped at zero by the fit.
* **Forward and backward.** Each repetition times the forward (train mode, building the autograd graph,
  loss included) and then the backward of that output (`backward(gradient)` with a fixed random gradient
  for hidden outputs, `loss.backward()` for the loss); backward = time(forward + backward) - time(forward)
  of the same repetition. A sample is the median over `REPEATS` repetitions (after `WARMUP` untimed
  rounds) of the difference above, paired repetition by repetition. Every model of every shard width and
  micro-batch runs once per round, interleaved, so that a slow spell of a shared machine hits all of them
  alike. On the CPU the clock is the thread's CPU time (`time.thread_time`: one compute thread, and CPU
  autograd runs backward on the calling thread), so time other processes take the core away does not
  count; on CUDA it is `time.perf_counter` around device synchronisations.
* **Tensor parallelism.** For a shard width tp the block is built with heads/tp, kv_heads/tp and ffn/tp
  (head_dim and hidden kept): the GEMMs and attention one rank computes under Megatron TP, without the
  collectives (those are profiled separately). The embedding table and LM head hold vocab/tp rows and the
  loss runs over the rank's vocabulary shard (Megatron's vocabulary-parallel cross-entropy, less its
  all-reduces).
* **Recomputation.** Blocks are wrapped by `plait.runtime.parallelize.apply_ac`, as the runtime does; the
  measured backward then includes the recomputation.
* **Activation bytes.** One extra forward per model and micro-batch counts the bytes kept for backward:
  the storages packed by `torch.autograd.graph.saved_tensors_hooks`, plus the storages created during the
  forward that are still alive after it (a `TorchDispatchMode` holds weak references to every op's
  output). The second set is needed because checkpointed regions hide their tensors from outer hooks:
  attn_kept caches the attention outputs in its own dispatch mode, not through saved-tensor hooks. Storages are counted once (by `data_ptr`); parameters and buffers are not activations. The
  per-block figure is again the difference between L2 and L1 blocks; it is exact and independent of the
  device, at the measurement dtype (fp32: 4 bytes per element).

All models of one shard width share one set of weights (one model of L2 blocks with its embedding and
head; the others are views of some of its modules), so memory grows with L2 blocks, not with the number
of models. Curves: seconds = intercept + per_token * tokens + per_token_seq * tokens * seq_len, fitted by
non-negative least squares with rows weighted by 1/tokens (relative errors count alike); the default
points put several sequence lengths at one token count and several batch sizes at one sequence length, so
the three coefficients are identifiable. Measurements run on one CPU thread (what each training rank
uses), in fp32, seeded.
"""

from __future__ import annotations

import copy
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import nnls
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plait.cost.profile_file import Curve, EdgeProfile, LayerProfile, LayerSample
from plait.errors import PlaitError
from plait.models import build_model
from plait.runtime.parallelize import apply_ac
from plait.spec.layers import Block
from plait.spec.model import ModelSpec

BASE_LAYERS = 1
"""Blocks of the smaller model of each difference (and of the edge models)."""
EXTRA_LAYERS = 2
"""Blocks the larger model has on top of BASE_LAYERS: block cost = difference / EXTRA_LAYERS."""
WARMUP = 2
"""Untimed rounds (every model once) before the timed ones."""
REPEATS = 11
"""Timed rounds; each sample is the median over them."""
QUICK_WARMUP = 1
QUICK_REPEATS = 9
DEFAULT_POINTS: tuple[tuple[int, int], ...] = ((1, 64), (4, 64), (1, 128), (2, 128), (1, 256), (2, 256))
"""(seqs, seq_len) of the default micro-batches: 256 tokens at three sequence lengths separate the
per-token from the per-token-and-position term, 1-4 sequences of 64 the intercept from the per-token term."""
QUICK_POINTS: tuple[tuple[int, int], ...] = ((1, 64), (2, 64), (1, 128))
"""Three small micro-batches: just enough to identify the three coefficients."""
POINTS_SEQ_LEN = 256
"""The longest default sequence; default points are scaled down for models with a shorter max_seq_len."""
SEED = 0
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The torch dtype of each profile dtype (`plait.cost.profile_file.ProfileDtype`)."""
MODES = ("none", "selective", "full")
EDGE_DIFFERENCES = {"embedding": ("C", "A"), "head": ("B", "C")}
"""Each edge part = the first edge model minus the second (see the module docstring)."""

Timing = tuple[float, float]
"""(forward seconds, backward seconds) of one model in one repetition."""
Point = tuple[int, int]
Target = tuple[int, str, int]
"""(tp, shape, ep): a layer's shard, the shape "" for the model's trunk decoder layer (`LayerProfile`)."""
RunKey = tuple[Target, Point, str]
"""(target, (seqs, seq_len), model): "<mode>/<blocks>" for blocks, "A", "B", "C" for the edges."""


# ---- public API ---------------------------------------------------------------------------------------
def measure_layers(spec: ModelSpec, *, tps: tuple[int, ...] = (1, 2), points: tuple[tuple[int, int], ...] | None = None,
                   recompute: tuple[str, ...] = ("none", "selective", "full"), quick: bool = False,
                   progress: Callable[[int, int], None] | None = None, eps: tuple[int, ...] = (1,),
                   dtype: str = "fp32") -> tuple[list[LayerProfile], list[EdgeProfile]]:
    """Measure, in this process on this device, the forward and backward seconds and the activation bytes of one
    transformer block of `spec` (for each tensor-parallel shard width tp: heads/tp, kv_heads/tp, ffn/tp, i.e. what
    one rank computes under Megatron TP, without the communication) and of the embedding and the head, as
    functions of the micro-batch (sequences, seq_len); fit a Curve for each. A model of several layer shapes
    (dense and mixture-of-experts layers) has each distinct layer measured alike, and its MoE layers also at
    each expert-parallel shard of `eps` (`layer_targets`).

    Weights and activations are in `dtype` (`TORCH_DTYPES`); the activation bytes count its elements.
    `points` are (seqs, seq_len) micro-batches (default DEFAULT_POINTS, or QUICK_POINTS with `quick`, which
    also runs fewer rounds); tp values that do not divide heads, kv_heads and ffn are skipped.
    `progress(done, total)` is called after each round of timings and after the byte count. Returns one
    LayerProfile per (layer, tp, ep, recompute mode) and an "embedding" and a "head" EdgeProfile per tp. See
    the module docstring for the method.
    """
    for mode in recompute:
        if mode not in MODES:
            raise PlaitError(f"unknown recompute mode {mode!r}; use one of {', '.join(MODES)}")
    pts = _check_points(spec, points) if points is not None else _default_points(spec, quick)
    targets = layer_targets(spec, tps, eps)
    if not targets:
        return [], []
    warmup, repeats = (QUICK_WARMUP, QUICK_REPEATS) if quick else (WARMUP, REPEATS)
    device = _device()
    with _measurement_settings():
        runs: dict[RunKey, _Run] = {}
        for target, layer_spec in targets.items():
            models = _Models.build(layer_spec, recompute, device, TORCH_DTYPES[dtype])
            for point in pts:
                runs |= {(target, point, name): run for name, run in _runs(models, point, device).items()}
        times = _time_runs(runs, warmup, repeats, device, progress)
        nbytes = {key: _activation_bytes(run) for key, run in runs.items()}
        if progress is not None:
            progress(warmup + repeats + 1, warmup + repeats + 1)
    blocks = f"{BASE_LAYERS + EXTRA_LAYERS}", f"{BASE_LAYERS}"
    layers = [_layer_profile(spec.name, target, mode, [
        _sample(point, times, nbytes, (target, point, f"{mode}/{blocks[0]}"),
                (target, point, f"{mode}/{blocks[1]}"), EXTRA_LAYERS) for point in pts])
        for target in targets for mode in recompute]
    first: dict[int, Target] = {}  # the edges of each width: measured beside its first layer
    for target in targets:
        first.setdefault(target[0], target)
    edges = [_edge_profile(spec.name, tp, part, [
        _sample(point, times, nbytes, (target, point, plus), (target, point, minus)) for point in pts])
        for tp, target in sorted(first.items()) for part, (plus, minus) in EDGE_DIFFERENCES.items()]
    return layers, edges


def layer_targets(spec: ModelSpec, tps: tuple[int, ...], eps: tuple[int, ...] = (1,)
                  ) -> dict[Target, ModelSpec]:
    """The layer shards to measure, each as a model of identical layers: for each tensor-parallel width tp
    that splits every layer (`Block.tp_divides`; the embedding and head split their vocabulary) and each
    distinct layer of `spec`, its tp shard; an MoE layer also at each expert-parallel width ep of `eps` that
    leaves it whole experts, at least top_k of them (experts/ep local experts taking all the rank's routed
    tokens, each expert split tp ways: etp = tp). A uniform decoder stack has one layer, the trunk (shape "").
    Multi-token-prediction modules (`Block.mtp`), which read the tokens ahead beside the hidden state, are not
    measured: the cost model prices them from their shape."""
    out: dict[Target, ModelSpec] = {}
    blocks = tuple(b for b in spec.distinct_blocks if not b.mtp)
    for tp in dict.fromkeys(tps):
        if tp < 1 or any(b.tp_divides(tp) for b in blocks) or not _divides(spec, tp):
            continue
        for block in blocks:
            shape = spec.shape_of(block)
            for ep in (dict.fromkeys(eps) if block.kind == "moe" else (1,)):
                whole = ep >= 1 and not block.experts % ep and block.experts // ep >= block.top_k
                if block.kind == "moe" and not whole:
                    continue
                out[(tp, shape, ep)] = _layer_spec(spec, block, tp, ep)
    return out


def _layer_spec(spec: ModelSpec, block: Block, tp: int, ep: int) -> ModelSpec:
    """A model of `block`'s shard alone (its tp shard; an MoE layer's experts/ep experts, each split tp ways
    as expert tensor parallelism of the same degree splits them), `spec`'s embedding and head split tp
    ways."""
    if spec.uniform:
        return _shard(spec, tp)
    shard = block.with_(heads=block.heads // tp, kv_heads=block.kv_heads // tp, ffn=block.ffn // tp,
                        experts=block.experts // ep, expert_ffn=block.expert_ffn // tp)
    return replace(_shard(spec, tp), mixed=(shard,) * (BASE_LAYERS + EXTRA_LAYERS))


def fit_curve(tokens: list[float], seq_lens: list[float], seconds: list[float]) -> Curve:
    """Fit seconds = intercept + a * tokens + b * tokens * seq_len with non-negative coefficients (least squares,
    rows weighted by 1/tokens so that every sample counts by its relative error; columns scaled to unit size
    for conditioning)."""
    t, s, y = (np.asarray(v, dtype=float) for v in (tokens, seq_lens, seconds))
    features = np.stack([np.ones_like(t), t, t * s], axis=1)
    weights = 1.0 / np.maximum(t, 1.0)
    scale = np.maximum(np.abs(features).max(axis=0), 1e-30)
    coef, _ = nnls(features * weights[:, None] / scale, y * weights)
    intercept, per_token, per_token_seq = (float(c) for c in coef / scale)
    return Curve(intercept_s=intercept, per_token_s=per_token, per_token_seq_s=per_token_seq)


# ---- micro-batches and shapes -------------------------------------------------------------------------
def _default_points(spec: ModelSpec, quick: bool) -> tuple[Point, ...]:
    """DEFAULT_POINTS (or QUICK_POINTS), sequence lengths scaled down to fit spec.max_seq_len."""
    base = QUICK_POINTS if quick else DEFAULT_POINTS
    factor = min(1.0, spec.max_seq_len / POINTS_SEQ_LEN)
    return tuple(dict.fromkeys((seqs, max(2, int(seq_len * factor))) for seqs, seq_len in base))


def _check_points(spec: ModelSpec, points: tuple[Point, ...]) -> tuple[Point, ...]:
    """The given points, validated: at least one, seqs >= 1, 1 <= seq_len <= max_seq_len; duplicates dropped."""
    if not points:
        raise PlaitError("measure_layers needs at least one (seqs, seq_len) point")
    for seqs, seq_len in points:
        if seqs < 1 or not 1 <= seq_len <= spec.max_seq_len:
            raise PlaitError(f"point ({seqs}, {seq_len}) of {spec.name!r}: need seqs >= 1 and "
                             f"1 <= seq_len <= max_seq_len={spec.max_seq_len}")
    return tuple(dict.fromkeys((int(seqs), int(seq_len)) for seqs, seq_len in points))


def _divides(spec: ModelSpec, tp: int) -> bool:
    """Whether tp splits heads, kv_heads and ffn evenly (Megatron's requirement)."""
    return tp >= 1 and spec.heads % tp == 0 and spec.kv_heads % tp == 0 and spec.ffn % tp == 0


def _shard(spec: ModelSpec, tp: int) -> ModelSpec:
    """One rank's share of `spec` under tp-way Megatron TP: heads, kv_heads, ffn and vocab (rounded up)
    divided by tp; hidden and head_dim kept."""
    return replace(spec, heads=spec.heads // tp, kv_heads=spec.kv_heads // tp, ffn=spec.ffn // tp,
                   head_dim=spec.head_dim, vocab=math.ceil(spec.vocab / tp))


def _device() -> torch.device:
    """The device this process computes on: its current CUDA device if any, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextmanager
def _measurement_settings() -> Iterator[None]:
    """One compute thread and no cyclic garbage collection while measuring; restored afterwards."""
    threads, gc_was_enabled = torch.get_num_threads(), gc.isenabled()
    torch.set_num_threads(1)
    gc.disable()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if gc_was_enabled:
            gc.enable()


# ---- the models ---------------------------------------------------------------------------------------
def _view(source: nn.Module, layers: int, *, embedding: bool, head: bool, mode: str = "none") -> nn.Module:
    """A model sharing `source`'s modules: its first `layers` blocks, with or without the embedding and the
    head, the blocks wrapped for recompute `mode` as the runtime does (`source` itself is left unchanged)."""
    model = copy.copy(source)
    model._modules = dict(source._modules)  # its own module table; the modules themselves are shared
    model.layers = nn.ModuleDict({name: source.layers[name] for name in list(source.layers)[:layers]})
    if not embedding:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if not head:
        model.norm = None
        model.output = None
    apply_ac(model, mode, list(model.layers.keys()))
    return model.train()


@dataclass
class _Models:
    """The models of one shard width, all views of one seeded fp32 model of L2 blocks: blocks (L1 and L2)
    per recompute mode, and the edge models A (L1 blocks), C (embedding + blocks), B (+ head and loss)."""

    spec: ModelSpec
    blocks: dict[str, tuple[nn.Module, nn.Module]]
    edges: dict[str, nn.Module]

    @classmethod
    def build(cls, spec: ModelSpec, recompute: tuple[str, ...], device: torch.device,
              dtype: torch.dtype = torch.float32) -> _Models:
        source = build_model(replace(spec, layers=BASE_LAYERS + EXTRA_LAYERS), device=device, seed=SEED,
                             dtype=dtype)
        blocks = {mode: (_view(source, BASE_LAYERS, embedding=False, head=False, mode=mode),
                         _view(source, BASE_LAYERS + EXTRA_LAYERS, embedding=False, head=False, mode=mode))
                  for mode in recompute}
        edges = {"A": _view(source, BASE_LAYERS, embedding=False, head=False),
                 "C": _view(source, BASE_LAYERS, embedding=True, head=False),
                 "B": _view(source, BASE_LAYERS, embedding=True, head=True)}
        return cls(spec, blocks, edges)


@dataclass
class _Run:
    """One model on one micro-batch: `forward()` returns what `backward(out)` differentiates."""

    model: nn.Module
    forward: Callable[[], Tensor]
    backward: Callable[[Tensor], None]
    inputs: tuple[Tensor, ...]


def _runs(models: _Models, point: Point, device: torch.device) -> dict[str, _Run]:
    """The runs of one micro-batch, keyed "<mode>/<blocks>" for blocks and "A", "B", "C" for the edges."""
    spec, (seqs, seq_len) = models.spec, point
    gen = torch.Generator().manual_seed(SEED)
    dtype = next(models.edges["B"].parameters()).dtype
    hidden = torch.randn(seqs, seq_len, spec.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    grad = torch.randn(seqs, seq_len, spec.hidden, generator=gen).to(device, dtype)
    tokens = torch.randint(0, spec.vocab, (seqs, seq_len), generator=gen).to(device)
    targets = torch.randint(0, spec.vocab, (seqs * seq_len,), generator=gen).to(device)

    def hidden_run(model: nn.Module, x: Tensor) -> _Run:
        return _Run(model, lambda: model(x), lambda out: out.backward(grad), (x,))

    def loss_forward() -> Tensor:
        return F.cross_entropy(models.edges["B"](tokens).flatten(0, 1), targets)

    runs = {}
    for mode, (small, large) in models.blocks.items():
        runs[f"{mode}/{BASE_LAYERS}"] = hidden_run(small, hidden)
        runs[f"{mode}/{BASE_LAYERS + EXTRA_LAYERS}"] = hidden_run(large, hidden)
    runs["A"] = runs.get(f"none/{BASE_LAYERS}") or hidden_run(models.edges["A"], hidden)
    runs["C"] = hidden_run(models.edges["C"], tokens)
    runs["B"] = _Run(models.edges["B"], loss_forward, lambda loss: loss.backward(), (tokens,))
    return runs


# ---- timing and bytes ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> Callable[[], float]:
    """Seconds: this thread's CPU time on the CPU (time lost to other processes does not count), wall time
    on CUDA (the GPU runs asynchronously: callers synchronise)."""
    return time.perf_counter if device.type == "cuda" else time.thread_time


def _time_once(run: _Run, device: torch.device) -> Timing:
    """(forward seconds, backward seconds) of one repetition; backward = (forward + backward) - forward."""
    clock = _clock(device)
    _sync(device)
    start = clock()
    out = run.forward()
    _sync(device)
    forward_end = clock()
    run.backward(out)
    _sync(device)
    end = clock()
    for x in run.inputs:
        x.grad = None
    return forward_end - start, (end - start) - (forward_end - start)


def _time_runs(runs: dict[RunKey, _Run], warmup: int, repeats: int, device: torch.device,
               progress: Callable[[int, int], None] | None) -> dict[RunKey, list[Timing]]:
    """The timings of every run in each of `repeats` rounds, after `warmup` rounds; a round runs every run
    once, one after the other (the same object may stand under several keys: it is timed once)."""
    unique: dict[int, _Run] = {id(run): run for run in runs.values()}
    timings: dict[int, list[Timing]] = {key: [] for key in unique}
    rounds = warmup + repeats
    for done in range(1, rounds + 1):
        for key, run in unique.items():
            timing = _time_once(run, device)
            if done > warmup:
                timings[key].append(timing)
        if progress is not None:
            progress(done, rounds + 1)
    return {key: timings[id(run)] for key, run in runs.items()}


class _LiveStorages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func: Callable[..., object], types: object, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                self.created.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
        return out


def _activation_bytes(run: _Run) -> float:
    """Bytes one forward of `run` keeps for backward: storages packed by saved-tensor hooks, plus storages
    created in the forward and still alive after it (checkpoint inputs, attn_kept's cache, the
    output), each once (by data_ptr); parameters and buffers excluded."""
    weights = {t.untyped_storage().data_ptr() for t in (*run.model.parameters(), *run.model.buffers())}
    kept: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return t

    live = _LiveStorages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live:
        out = run.forward()
    for ref, ptr, nbytes in live.created:
        if not ref.expired():
            kept[ptr] = nbytes
    del out
    return float(sum(nbytes for ptr, nbytes in kept.items() if ptr and ptr not in weights))


def _sample(point: Point, times: dict[RunKey, list[Timing]], nbytes: dict[RunKey, float], plus: RunKey,
            minus: RunKey, count: int = 1) -> LayerSample:
    """(plus - minus) / count for one micro-batch: forward and backward seconds as the median over the
    repetitions of the paired differences, activation bytes exactly."""
    pairs = list(zip(times[plus], times[minus]))
    forward = statistics.median((p[0] - m[0]) / count for p, m in pairs)
    backward = statistics.median((p[1] - m[1]) / count for p, m in pairs)
    return LayerSample(seqs=point[0], seq_len=point[1], forward_s=forward, backward_s=backward,
                       activation_bytes=(nbytes[plus] - nbytes[minus]) / count)


# ---- profiles -----------------------------------------------------------------------------------------
def fit_curves(samples: list[LayerSample]) -> tuple[Curve, Curve]:
    """Forward and backward curves fitted to the samples."""
    tokens = [float(s.seqs * s.seq_len) for s in samples]
    seq_lens = [float(s.seq_len) for s in samples]
    return (fit_curve(tokens, seq_lens, [s.forward_s for s in samples]),
            fit_curve(tokens, seq_lens, [s.backward_s for s in samples]))


def _layer_profile(model: str, target: Target, mode: str, samples: list[LayerSample]) -> LayerProfile:
    """A block's profile; activation bytes per token = the largest bytes/tokens over the samples (they are
    equal unless attention keeps something quadratic in seq_len, when the longest sequence rules)."""
    forward, backward = fit_curves(samples)
    per_token = max(s.activation_bytes / (s.seqs * s.seq_len) for s in samples)
    tp, shape, ep = target
    return LayerProfile(model=model, tp=tp, shape=shape, ep=ep, recompute=mode,  # type: ignore[arg-type]
                        forward=forward, backward=backward, activation_bytes_per_token=per_token,
                        samples=tuple(samples))


def _edge_profile(model: str, tp: int, part: str, samples: list[LayerSample]) -> EdgeProfile:
    """The embedding's or the head's profile."""
    forward, backward = fit_curves(samples)
    return EdgeProfile(model=model, part=part, tp=tp, forward=forward, backward=backward,  # type: ignore[arg-type]
                       samples=tuple(samples))
