"""Measure one transformer block as the runtime runs it under each parallel strategy, communication included.

The layer profile (`plait.profile.layers`) times one rank's share of a block's arithmetic; the collective
curves time bare collectives. Neither sees what the runtime does around them: DTensor's dispatch and
redistributions under tensor (and sequence) parallelism, FSDP2's parameter gathers and hooks under ZeRO-3,
Ulysses' all-to-alls, expert parallelism's count exchange, token all-to-alls and reordering, and how all of
that contends for the cores with compute. This module measures it.

Method, inside the collective job (torchrun, every rank): for each strategy kind (`KINDS`), each group size g
it applies to, and each count of ranks busy at once (the g ranks of one group alone, or every rank in groups
of g side by side, as in a job that also runs data parallelism), four models are parallelised with the
runtime's own functions (`apply_tp`, `apply_cp`, `apply_dp`; for ep the experts sharded and exchanged as
`plait.runtime.experts.apply_ep` does) over a mesh of the group: A and L, of
`BASE_LAYERS` and `BASE_LAYERS + EXTRA_LAYERS` blocks (hidden state in and out, as on a middle pipeline
stage), C = embedding + A, B = C + final norm, LM head and loss. Each is timed in wall-clock seconds:
forward, then backward, the slowest busy rank of each repetition. Block = (L - A) / EXTRA_LAYERS, embedding =
C - A, head = B - C, so the model's input and output handling cancels; a sample is the median over the
repetitions of `PASSES` passes over all items. The optimizer step (clipping, AdamW, zeroing) is timed on B
and L. Ranks not busy wait at a barrier. ZeRO-3 runs with gradient synchronisation off (the runtime reduces
gradients once per step, after the last micro-batch; that reduction is priced from the collective curves).

A sample's micro-batch (seqs, seq_len) is what one data-parallel replica of the group computes: the group's
ranks hold seqs x seq_len tokens between them (tp: all of them, replicated; tp_sp and cp: seq_len/g each);
ZeRO-3 and ep ranks each hold seqs x seq_len tokens of their own. The blocks are the model's trunk decoder
layer, for ep its first MoE layer (`expert_layer`), whose experts the group's ranks split E/g each. Units:
seconds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from plait.cost.profile_file import EdgeProfile, LayerSample, StrategyKind, StrategyProfile
from plait.profile.layers import BASE_LAYERS, EXTRA_LAYERS, SEED, fit_curves
from plait.profile.optimizer import fit_optimizer
from plait.runtime.optim import PROFILE_LR, make_optimizer
from plait.spec.layers import Block
from plait.spec.model import ModelSpec

KINDS: tuple[StrategyKind, ...] = ("tp", "tp_sp", "cp", "zero3", "ep")
"""Kinds timed over groups of g >= 2 ranks; "none" (a plain block, group 1) is timed with 2 and with every
rank busy: how much a rank slows down when the others compute beside it."""
POINTS: tuple[tuple[int, int], ...] = ((1, 64), (4, 64), (1, 128), (2, 256))
"""(seqs, seq_len) of the default micro-batches (scaled down to the model's max_seq_len)."""
QUICK_POINTS: tuple[tuple[int, int], ...] = ((1, 64), (2, 64), (1, 128))
WARMUP, REPEATS = 1, 4
QUICK_WARMUP, QUICK_REPEATS = 1, 3
PASSES = 2
"""Every item is measured in this many passes over all items (WARMUP + REPEATS rounds each), so that a slow
spell of a shared machine does not decide one item alone; a sample is the median over all passes' rounds."""
POINTS_SEQ_LEN = 256
"""The longest default sequence; points are scaled down for models with a shorter max_seq_len."""

Item = tuple[str, int, int]
"""(kind, group size, busy ranks)."""


def expert_layer(spec: ModelSpec) -> Block | None:
    """The MoE layer whose expert parallelism the profile times: the model's first (None without one)."""
    return next((b for b in spec.distinct_blocks if b.kind == "moe"), None)


def applies(spec: ModelSpec, kind: str, g: int) -> bool:
    """Whether the runtime can run `kind` over g ranks for `spec` (heads, kv heads and ffn split evenly for
    tensor parallelism, heads and kv heads for Ulysses, whole experts, at least top_k a rank, for ep)."""
    if kind == "ep":
        moe = expert_layer(spec)
        return moe is not None and moe.experts % g == 0 and moe.experts // g >= moe.top_k
    if kind in ("tp", "tp_sp"):
        return spec.heads % g == 0 and spec.kv_heads % g == 0 and spec.ffn % g == 0
    if kind == "cp":
        return spec.heads % g == 0 and spec.kv_heads % g == 0
    return True


def points(spec: ModelSpec, g: int, quick: bool) -> tuple[tuple[int, int], ...]:
    """The micro-batches measured over g ranks: the defaults scaled to max_seq_len, seq_len a multiple of g."""
    factor = min(1.0, spec.max_seq_len / POINTS_SEQ_LEN)
    scaled = ((seqs, max(g, int(seq_len * factor)) // g * g) for seqs, seq_len in (QUICK_POINTS if quick else POINTS))
    return tuple(dict.fromkeys(scaled))


def planned_items(spec: ModelSpec, world: int, group_sizes: list[int]) -> list[Item]:
    """What the job measures, in order: a plain block ("none", 1) with 2 and with `world` busy ranks, then
    (kind, g, busy ranks) for every kind that applies to g ranks, busy ranks g (one group alone) and, if
    larger, every whole multiple of g up to `world` (groups side by side)."""
    items: list[Item] = [("none", 1, busy) for busy in sorted({2, world})]
    for g in group_sizes:
        busy = sorted({g, world // g * g})
        items += [(kind, g, b) for kind in KINDS if applies(spec, kind, g) for b in busy]
    return items


def merge(passes: list[dict]) -> dict:
    """One item's raw measurements from several passes as samples: medians over every pass's repetitions
    (seconds per micro-batch), and the median optimizer seconds per parameter count."""
    first = passes[0]
    out = {k: first[k] for k in ("kind", "group", "ranks", "shape")}
    for part in ("samples", "embedding", "head"):
        out[part] = [{"seqs": s["seqs"], "seq_len": s["seq_len"],
                      **{k: statistics.median(v for p in passes for v in p[part][i][k]) for k in ("forward_s", "backward_s")}}
                     for i, s in enumerate(first[part])]
    out["optimizer"] = [(params, statistics.median(p["optimizer"][i][1] for p in passes))
                        for i, (params, _) in enumerate(first["optimizer"])]
    return out


def profiles(model: str, raw: list[dict]) -> list[StrategyProfile]:
    """Fit one StrategyProfile per measured (kind, group, busy ranks) from the job's raw samples."""
    out = []
    for r in raw:
        fitted = {}
        for part in ("samples", "embedding", "head"):
            samples = [LayerSample(activation_bytes=0.0, **s) for s in r[part]]
            fitted[part] = (*fit_curves(samples), tuple(samples))
        forward, backward, samples = fitted["samples"]
        tp = r["group"] if r["kind"] in ("tp", "tp_sp") else 1
        edges = {part: EdgeProfile(model=model, part=part, tp=tp, forward=fitted[part][0], backward=fitted[part][1],
                                   samples=fitted[part][2]) for part in ("embedding", "head")}
        out.append(StrategyProfile(model=model, kind=r["kind"], group=r["group"], ranks=r["ranks"],
                                   shape=r["shape"], forward=forward, backward=backward, samples=samples, **edges,
                                   optimizer=fit_optimizer([tuple(x) for x in r["optimizer"]])))
    return out


# ---- in a torchrun rank -------------------------------------------------------------------------------
SMALL, LARGE = "A", "L"
"""Model names: A = BASE_LAYERS blocks, L = BASE_LAYERS + EXTRA_LAYERS blocks (hidden in, hidden out);
C = embedding + A (tokens in), B = C + final norm, LM head and loss (tokens in, loss out)."""


def measure_item(spec: ModelSpec, item: Item, quick: bool, dtype: str = "fp32") -> dict | None:
    """Measure one (kind, g, busy ranks) on a joined process group (every rank calls it: the meshes are
    built collectively); returns the raw samples on rank 0, None elsewhere: per micro-batch the block's,
    the embedding's (C - A) and the head's (B - C) forward and backward seconds of every repetition, and
    the optimizer step (clipping, AdamW, zeroing) of models B and L as (local parameters, seconds), weights
    and activations in `dtype` ("fp32" or "bf16"). `merge` combines passes into samples."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from plait.profile.collectives_worker import _barrier, _sync, rank_device

    kind, g, busy = item
    rank = dist.get_rank()
    device = rank_device()
    mesh = DeviceMesh(device.type, torch.arange(busy).view(busy // g, g), mesh_dim_names=("replica", "group"))
    if kind == "ep":  # the expert mesh of `plait.runtime.experts`, each group of g ranks one ep group
        mesh = DeviceMesh(device.type, torch.arange(busy).view(busy // g, g, 1),
                          mesh_dim_names=("edp", "ep", "etp"))
    busy_group = dist.new_group(list(range(busy)))
    if rank >= busy:
        return None
    warmup, repeats = (QUICK_WARMUP, QUICK_REPEATS) if quick else (WARMUP, REPEATS)
    pts = points(spec, g, quick)
    position = rank % g
    group_mesh = mesh if kind == "ep" else mesh["group"]
    models = {name: _parallel_model(spec, name, kind, group_mesh, device, dtype) for name in "ALCB"}
    runs = {(p, name): _run(spec, models[name], name, kind, g, position, p, device, dtype) for p in pts
            for name in models}
    times: dict[tuple, list[tuple[float, float]]] = {key: [] for key in runs}
    for round_ in range(warmup + repeats):
        for key, (forward, backward, inputs) in runs.items():
            _barrier(busy_group, device)
            start = time.perf_counter()
            out = forward()
            _sync(device)
            mid = time.perf_counter()
            backward(out)
            _sync(device)
            end = time.perf_counter()
            for x in inputs:
                x.grad = None
            if round_ >= warmup:
                times[key].append((mid - start, end - mid))
    optimizer = [_time_optimizer(models[name], runs[(pts[-1], name)], kind, repeats, busy_group, device)
                 for name in ("B", LARGE)]
    keys = list(times)
    flat = torch.tensor([t for k in keys for pair in times[k] for t in pair], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=busy_group)  # the slowest busy rank, per repetition
    slowest = flat.view(len(keys), repeats, 2).cpu()

    def median_diff(p: tuple[int, int], plus: str, minus: str, count: int = 1) -> dict:
        diff = (slowest[keys.index((p, plus))] - slowest[keys.index((p, minus))]) / count
        return {"seqs": p[0], "seq_len": p[1], "forward_s": diff[:, 0].tolist(), "backward_s": diff[:, 1].tolist()}

    if rank != 0:
        return None
    moe = expert_layer(spec) if kind == "ep" else None
    return {"kind": kind, "group": g, "ranks": busy, "shape": spec.shape_of(moe) if moe is not None else "",
            "samples": [median_diff(p, LARGE, SMALL, EXTRA_LAYERS) for p in pts],
            "embedding": [median_diff(p, "C", SMALL) for p in pts],
            "head": [median_diff(p, "B", "C") for p in pts],
            "optimizer": optimizer}


def _parallel_model(spec: ModelSpec, name: str, kind: str, group_mesh, device, dtype: str = "fp32"):
    """Model `name` (see SMALL/LARGE) of seeded weights in `dtype`, parallelised over `group_mesh` as the
    runtime does (for ep: the ("edp", "ep", "etp") expert mesh)."""
    from plait.models import build_model
    from plait.profile.layers import TORCH_DTYPES
    from plait.runtime.experts import AllToAll, moe_layers, shard_experts
    from plait.runtime.parallelize import apply_cp, apply_dp, apply_tp

    layers = BASE_LAYERS + EXTRA_LAYERS if name == LARGE else BASE_LAYERS
    moe = expert_layer(spec) if kind == "ep" else None
    # a stack of the trunk decoder layer (of any model), for ep of its first MoE layer
    stack = replace(spec, mixed=(), layers=layers) if moe is None else replace(spec, mixed=(moe,) * layers)
    model = build_model(stack, device=device, seed=SEED, dtype=TORCH_DTYPES[dtype])
    embedding, head = name in "CB", name == "B"
    if not embedding:
        model.tok_embeddings = model.pos_embeddings = None
    if not head:
        model.norm = model.output = None
    names = list(model.layers.keys())
    if kind in ("tp", "tp_sp"):
        apply_tp(model, group_mesh, kind == "tp_sp", names, embedding=embedding, head=head)
    elif kind == "cp":
        apply_cp(model, group_mesh.get_group(), names)  # the embedding's sequence slice is set per run
    elif kind == "zero3":
        apply_dp(model, group_mesh, zero=3, hand_sync=False)  # reduce-scatters every backward, as ZeRO-3 does
    elif kind == "ep":  # expert gradients are reduced once per step, after the last micro-batch (not timed)
        for layer in moe_layers(model, names):
            shard_experts(layer, group_mesh)
            layer.exchange = AllToAll(group_mesh.get_group("ep"))
    return model.train()


def _run(spec: ModelSpec, model, name: str, kind: str, g: int, position: int, point: tuple[int, int], device,
         dtype: str = "fp32"):
    """(forward() -> output, backward(output), inputs requiring grad) of one model on one micro-batch."""
    import torch

    from plait.profile.layers import TORCH_DTYPES
    from plait.runtime.train import token_loss

    seqs, seq_len = point
    local = seq_len // g if kind in ("tp_sp", "cp") else seq_len
    gen = torch.Generator().manual_seed(SEED)
    floats = TORCH_DTYPES[dtype]
    x = torch.randn(seqs, local, spec.hidden, generator=gen).to(device, floats).requires_grad_(True)
    tokens = torch.randint(0, spec.vocab, (seqs, seq_len), generator=gen).to(device)
    if name in (SMALL, LARGE):
        grad = torch.randn(seqs, local, spec.hidden, generator=gen).to(device, floats)
        return (lambda: model(x)), (lambda out: out.backward(grad)), (x,)
    sliced = (position * local, (position + 1) * local) if kind == "cp" else (0, seq_len)
    targets = torch.randint(0, spec.vocab, (seqs, seq_len), generator=gen).to(device)[:, sliced[0]: sliced[1]]
    out_len = local if kind in ("tp_sp", "cp") else seq_len
    grad = torch.randn(seqs, out_len, spec.hidden, generator=gen).to(device, floats)

    def forward():
        if kind == "cp":
            model.sequence_slice = sliced
        out = model(tokens)
        return token_loss(out, targets) if name == "B" else out

    def backward(out) -> None:
        out.backward() if name == "B" else out.backward(grad)

    return forward, backward, ()


def _time_optimizer(model, run, kind: str, repeats: int, group, device) -> tuple[float, float]:
    """(this rank's parameters, median seconds) of clipping, an AdamW step and zeroing the gradients, after
    one backward that reduces gradients (ZeRO-3)."""
    from torch.distributed.tensor import DTensor

    from plait.profile.collectives_worker import _barrier, _sync
    from plait.runtime.train import clip_grads

    params = list(model.parameters())
    optimizer = make_optimizer(params, PROFILE_LR)
    seconds = []
    for rep in range(1 + repeats):
        forward, backward, _ = run
        backward(forward())
        _barrier(group, device)
        start = time.perf_counter()
        clip_grads(params, 1.0, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if rep:
            seconds.append(time.perf_counter() - start)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return float(local), statistics.median(seconds)
