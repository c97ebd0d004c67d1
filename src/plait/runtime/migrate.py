"""Plan switches over the network: move model and optimizer state from the old plan's owners straight to the
new plan's owners, nothing written to disk (DCP stays for checkpoints, `plait.runtime.checkpoint`).

Identity is the fully qualified name DCP uses (`checkpoint.local_state`: the full model's parameter names,
flattened optimizer keys such as `state.layers.0.attention.wq.weight.exp_avg`), and a tensor's slice on a rank
is a box (offsets, sizes) of the full tensor, read from DTensor placements as DCP does. Under either plan a
rank may hold a whole tensor (a pipeline stage, a replica), a tensor-parallel shard or an FSDP/ZeRO shard.

1. Every rank states what it holds under the old plan and what it needs under the new one (one
   all-gather of metadata, no tensor data).
2. Every rank computes the same list of transfers (`transfers`): each needed box is cut along the distinct
   old boxes it overlaps; a piece the destination already holds is copied locally; otherwise the source is
   the least-loaded replica holding it (bytes sent so far; ties to the lowest rank), spreading the sends of
   data-parallel replicas.
3. Transfers run in rounds of at most `BUCKET_BYTES` (`dist.batch_isend_irecv` over the world group; a
   larger slice is sent in pieces of rows), so a rank's extra memory is bounded by one round's send copies
   and receive buffers; received pieces are written into the new model's local shards and optimizer state,
   which are then applied exactly as a DCP load applies them (`checkpoint.apply_state`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait.errors import PlaitError
from plait.runtime.checkpoint import apply_state, local_state, table_alias

BUCKET_BYTES = 64 * 2**20
"""Bytes of transfers per round of point-to-point ops (bounds a rank's extra memory during a switch)."""


@dataclass(frozen=True)
class Box:
    """A slice of a tensor: start `offsets` and `sizes` per dimension (a 0-dim tensor: both empty)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes (None when empty)."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends)))

    def pieces(self, itemsize: int, limit: int) -> list[Box]:
        """This box cut along its first dimension into pieces of at most `limit` bytes (of `itemsize` each;
        a piece is at least one row)."""
        if not self.sizes:
            return [self]
        rows = max(1, limit // max(1, self.numel // self.sizes[0] * itemsize))
        return [Box((self.offsets[0] + start, *self.offsets[1:]), (min(rows, self.sizes[0] - start), *self.sizes[1:]))
                for start in range(0, self.sizes[0], rows)]

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box in a local tensor that holds `outer`."""
        return tuple(slice(o - b, o - b + n) for o, n, b in zip(self.offsets, self.sizes, outer.offsets))


@dataclass(frozen=True)
class Held:
    """One rank's slice of a named tensor."""

    box: Box
    dtype: str  # torch dtype name, e.g. "float32"


@dataclass(frozen=True)
class Transfer:
    """Move `region` of tensor `key` (named `source_key` on the sender) from rank `src` to rank `dst`."""

    key: str
    source_key: str
    src: int
    dst: int
    region: Box
    nbytes: int
    dtype: str  # the sender's torch dtype name


def _box(value: torch.Tensor) -> Box:
    """This rank's slice of the full tensor behind `value` (the whole of a plain tensor)."""
    if isinstance(value, DTensor):
        (chunk,) = value.__create_chunk_list__()
        return Box(tuple(chunk.offsets), tuple(chunk.sizes))
    return Box((0,) * value.dim(), tuple(value.shape))


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def describe(state: dict) -> tuple[dict[str, Held], dict[str, object]]:
    """(the tensors of a merged `local_state` by key, its other values such as learning rates)."""
    held: dict[str, Held] = {}
    other: dict[str, object] = {}
    for top, entries in state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                held[f"{top}.{key}"] = Held(_box(value), str(value.dtype).removeprefix("torch."))
            else:
                other[f"{top}.{key}"] = value
    return held, other


def _source_key(key: str, holders: dict[str, list[tuple[int, Held]]]) -> str:
    """`key`, or the embedding's name for a copy of the table (a tied head, MTP's) the old plan kept as the
    embedding's own on its stage."""
    if key in holders:
        return key
    alias = table_alias(key)
    if alias in holders:
        return alias
    raise PlaitError(f"cannot switch plans: no rank holds {key!r} under the old plan; switch with --switch-via dcp")


def transfers(old: list[dict[str, Held]], new: list[dict[str, Held]], limit: int = BUCKET_BYTES
              ) -> list[Transfer]:
    """Every piece each rank needs under the new plan (`new[rank]`), from whom under the old (`old[rank]`):
    the same list on every rank, in key order, then destination rank; a piece sent over the network is at
    most `limit` bytes (or one row)."""
    holders: dict[str, list[tuple[int, Held]]] = {}
    for rank, held in enumerate(old):
        for key, h in held.items():
            if h.box.numel:
                holders.setdefault(key, []).append((rank, h))
    load = [0] * len(old)
    out: list[Transfer] = []
    for key in sorted({k for need in new for k in need}):
        source = _source_key(key, holders)
        boxes: dict[Box, list[int]] = {}
        for rank, h in sorted(holders[source], key=lambda rh: rh[1].box.offsets):
            boxes.setdefault(h.box, []).append(rank)
        dtype = holders[source][0][1].dtype
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for dst, need in enumerate(new):
            if key not in need or not need[key].box.numel:
                continue
            covered = 0
            for box, ranks in boxes.items():
                region = box.intersect(need[key].box)
                if region is None:
                    continue
                covered += region.numel
                if dst in ranks:
                    out.append(Transfer(key, source, dst, dst, region, region.numel * itemsize, dtype))
                    continue
                for piece in region.pieces(itemsize, limit):
                    src = min(ranks, key=lambda r: (load[r], r))
                    load[src] += piece.numel * itemsize
                    out.append(Transfer(key, source, src, dst, piece, piece.numel * itemsize, dtype))
            if covered != need[key].box.numel:
                raise PlaitError(f"cannot switch plans: the old plan's slices of {key!r} cover {covered} of the "
                                 f"{need[key].box.numel} elements rank {dst} needs; switch with --switch-via dcp")
    return out


def rounds(moves: list[Transfer], limit: int = BUCKET_BYTES) -> Iterator[list[Transfer]]:
    """Consecutive transfers in rounds of at most `limit` bytes over the network (a larger one, a row longer
    than `limit`, goes alone; local copies cost nothing)."""
    batch: list[Transfer] = []
    size = 0
    for t in moves:
        cost = t.nbytes if t.src != t.dst else 0
        if batch and size + cost > limit:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += cost
    if batch:
        yield batch


def _entry(state: dict, name: str) -> torch.Tensor:
    top, key = name.split(".", 1)
    return state[top][key]


def move(old_chunks: list[torch.nn.Module], old_optimizers: list[torch.optim.Optimizer],
         new_chunks: list[torch.nn.Module], new_optimizers: list[torch.optim.Optimizer],
         limit: int = BUCKET_BYTES) -> int:
    """Fill the new plan's chunks and optimizers on this rank with the old plan's state (collective over
    every rank, idle ones included); returns the bytes this rank sent."""
    rank = dist.get_rank()
    old_state, _ = local_state(old_chunks, old_optimizers)
    new_state, keys = local_state(new_chunks, new_optimizers)
    old_held, old_other = describe(old_state)
    new_held, new_other = describe(new_state)
    gathered: list[tuple | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (old_held, old_other, new_held))
    values: dict[str, object] = {}
    for _, other, _ in gathered:  # type: ignore[misc]
        values.update(other)
    sent = 0
    moves = transfers([g[0] for g in gathered], [g[2] for g in gathered], limit)  # type: ignore[index]
    for batch in rounds(moves, limit):
        ops, received = [], []
        for tag, t in enumerate(batch):
            if rank not in (t.src, t.dst):
                continue
            if t.src == rank:
                piece = _local(_entry(old_state, t.source_key))[t.region.within(old_held[t.source_key].box)]
            if t.src == t.dst:
                _local(_entry(new_state, t.key))[t.region.within(new_held[t.key].box)].copy_(piece)
            elif t.src == rank:
                ops.append(dist.P2POp(dist.isend, piece.contiguous(), t.dst, tag=tag))
                sent += t.nbytes
            else:
                buffer = torch.empty(t.region.sizes, dtype=getattr(torch, t.dtype))
                ops.append(dist.P2POp(dist.irecv, buffer, t.src, tag=tag))
                received.append((t, buffer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for t, buffer in received:
            _local(_entry(new_state, t.key))[t.region.within(new_held[t.key].box)].copy_(buffer)
    for name in new_other:
        top, key = name.split(".", 1)
        source = name if name in values else table_alias(name)
        if source in values:
            new_state[top][key] = values[source]
    apply_state(new_state, keys, new_chunks, new_optimizers)
    return sent
