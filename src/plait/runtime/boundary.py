"""The hand-over between consecutive pipeline stages of different widths.

The first stage's positions hold their pieces of a micro-batch's hidden state [B, T, H] in its last layer's
layout; each position of the next stage receives exactly its piece in its first layer's layout, from the
positions that hold it (`plait.layout.transfer`: the blocks the cost model prices). Forward moves the
activation; backward moves its gradient the other way, scaled by the two layouts' data degrees (the
gradient convention of `plait.runtime.relayout`). Every (sender, receiver) pair exchanges one message per
micro-batch and direction: sends are non-blocking, receives wait for every sender. Each boundary of a
pipeline tags its messages apart, so that interleaved chunks, whose ranks meet at several boundaries, match
every receive with its own send.

Under p2p=megatron, between two stages of one layout that holds each piece on `split` = tp ranks (no
sequence parallelism), each sender sends only its 1/split of the piece to its own position and the receivers
all-gather the pieces among their tp ranks (Megatron-LM's scatter/gather, SC21 Sec. 4.1; the bytes
`plait.cost.price.send_time` prices with `split`).

The state is what the family carries (`plait.spec.model.ModelSpec.carried_elements`): [B, T, H] hidden
states; T5's encoder and decoder states side by side, [B, T, 2H]; LLaVA's flat image and text, [B, F], up
to its projector, whose layers split no tokens, so it crosses as [B, 1, F].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from plait.layout import Block, Layout, scatter_split, transfer
from plait.plan import Plan
from plait.spec.model import ModelSpec

FORWARD_TAG, BACKWARD_TAG = 1, 2
"""Message tags of activations (forward) and their gradients (backward) at a pipeline's first boundary; the
boundary after stage j adds 2 j (`Boundary.index`)."""
GATHER_TAG = 1 << 20
"""Added to a boundary's tag for the receivers' all-gather of scattered pieces (`Boundary.split`)."""


@dataclass(frozen=True)
class Boundary:
    """A stage (ranks `senders`, its last layer's layout `src`) hands micro-batches of `batch` sequences x
    `tokens` x `hidden` to the next stage (ranks `receivers`, its first layer's layout `dst`) over `group`
    (a process group holding both stages' ranks; the ranks here are global). `index`: the stage before it,
    whose tags it uses; `flat`: the stages carry [B, hidden] (one token of `hidden` elements)."""

    src: Layout
    dst: Layout
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    batch: int
    tokens: int
    hidden: int
    group: dist.ProcessGroup | None
    index: int = 0
    flat: bool = False
    split: int = 1

    def scatter_sizes(self, position: int, forward: bool) -> list[int]:
        """Elements of the `split` parts of position `position`'s flattened piece (Megatron's scatter: the
        position sends the part at its tp index)."""
        have = self.src if forward else self.dst
        (b0, b1), (t0, t1) = have.piece(position, self.batch, self.tokens)
        whole = (b1 - b0) * (t1 - t0) * self.hidden
        q, r = divmod(whole, self.split)
        return [q + (i < r) for i in range(self.split)]

    def _tag(self, forward: bool) -> int:
        return (FORWARD_TAG if forward else BACKWARD_TAG) + 2 * self.index

    def send(self, x: Tensor, forward: bool) -> list[tuple[dist.Work, Tensor]]:
        """Start sending this rank's piece `x` (forward: the activation, from a sender; backward: its gradient,
        from a receiver, scaled by src.data_degree / dst.data_degree); the caller keeps the returned (handle,
        buffer) pairs and waits on them before the step ends."""
        have, want, mine, peers = self._sides(forward)
        position = mine.index(dist.get_rank())
        if self.flat:
            x = x.unsqueeze(1)
        if not forward and self.src.data_degree != self.dst.data_degree:
            x = x * (self.src.data_degree / self.dst.data_degree)
        if self.split > 1:
            sizes = self.scatter_sizes(position, forward)
            part = x.reshape(-1).split(sizes)[position % self.split].contiguous()
            return [(dist.isend(part, peers[position], group=self.group, tag=self._tag(forward)), part)]
        (b0, _), (t0, _) = have.piece(position, self.batch, self.tokens)
        out: dict[int, list[Tensor]] = {}
        for block in self._blocks(have, want):
            if block.sender == position:
                part = x[block.batch[0] - b0: block.batch[1] - b0, block.tokens[0] - t0: block.tokens[1] - t0]
                out.setdefault(block.receiver, []).append(part.reshape(-1))
        tag = self._tag(forward)
        buffers = [(receiver, torch.cat(parts)) for receiver, parts in sorted(out.items())]
        return [(dist.isend(buf, peers[receiver], group=self.group, tag=tag), buf) for receiver, buf in buffers]

    def receive(self, forward: bool, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        """This rank's piece (forward: the activation on a receiver; backward: its gradient on a sender)."""
        have, want, mine, peers = self._sides(forward)
        position = mine.index(dist.get_rank())
        (b0, b1), (t0, t1) = want.piece(position, self.batch, self.tokens)
        out = torch.empty((b1 - b0, t1 - t0, self.hidden), dtype=dtype, device=device)
        if self.split > 1:
            return self._gather(out, position, forward, mine, peers)
        by_sender: dict[int, list[Block]] = {}
        for block in self._blocks(have, want):
            if block.receiver == position:
                by_sender.setdefault(block.sender, []).append(block)
        tag = self._tag(forward)
        buffers = {s: torch.empty(sum(b.cells for b in blocks) * self.hidden, dtype=dtype, device=device)
                   for s, blocks in by_sender.items()}
        works = [dist.irecv(buf, peers[s], group=self.group, tag=tag) for s, buf in sorted(buffers.items())]
        for work in works:
            work.wait()
        for s, blocks in by_sender.items():
            start = 0
            for block in blocks:
                size = block.cells * self.hidden
                shape = (block.batch[1] - block.batch[0], block.tokens[1] - block.tokens[0], self.hidden)
                out[block.batch[0] - b0: block.batch[1] - b0, block.tokens[0] - t0: block.tokens[1] - t0] = \
                    buffers[s][start: start + size].view(shape)
                start += size
        return out.flatten(1) if self.flat else out

    def _gather(self, out: Tensor, position: int, forward: bool, mine: tuple[int, ...], peers: tuple[int, ...]
                ) -> Tensor:
        """Receive this position's 1/split part from the same position of the other stage, then all-gather
        the parts among the `split` positions that hold the same piece (point to point, each part once to
        every other holder)."""
        parts = list(out.view(-1).split(self.scatter_sizes(position, forward)))
        mine_at, first = position % self.split, position - position % self.split
        tag = self._tag(forward)
        dist.irecv(parts[mine_at], peers[position], group=self.group, tag=tag).wait()
        others = [i for i in range(self.split) if i != mine_at]
        gather = tag + GATHER_TAG
        works = [dist.isend(parts[mine_at], mine[first + i], group=self.group, tag=gather) for i in others]
        works += [dist.irecv(parts[i], mine[first + i], group=self.group, tag=gather) for i in others]
        for work in works:
            work.wait()
        return out.flatten(1) if self.flat else out

    def _sides(self, forward: bool) -> tuple[Layout, Layout, tuple[int, ...], tuple[int, ...]]:
        """(layout sent, layout received, this rank's stage's ranks, the other stage's ranks) in a direction."""
        have, want = (self.src, self.dst) if forward else (self.dst, self.src)
        if dist.get_rank() in self.senders:
            return have, want, self.senders, self.receivers
        return have, want, self.receivers, self.senders

    def _blocks(self, have: Layout, want: Layout) -> tuple[Block, ...]:
        return transfer(have, want, self.batch, self.tokens)


def boundaries(plan: Plan, pipeline: int, index: int, spec: ModelSpec, group: dist.ProcessGroup | None
               ) -> tuple[Boundary | None, Boundary | None]:
    """The boundaries before and after stage `index` of a pipeline (None at its ends), each sized by the
    state `spec`'s family carries into the next stage's first layer."""
    pipe = plan.pipelines[pipeline]
    stages = pipe.stages

    def between(j: int) -> Boundary:
        a, b = stages[j], stages[j + 1]
        tokens, width, flat = carried_shape(spec, b.layers[0], plan.seq_len)
        src, dst = Layout.of(a.strategy(a.layers[1] - 1)), Layout.of(b.strategy(b.layers[0]))
        return Boundary(src, dst, a.ranks, b.ranks, pipe.micro_batch_sequences, tokens, width, group, j, flat,
                        scatter_split(src, dst) if plan.p2p == "megatron" else 1)

    return (between(index - 1) if index > 0 else None,
            between(index) if index < len(stages) - 1 else None)


def carried_shape(spec: ModelSpec, layer: int, seq_len: int) -> tuple[int, int, bool]:
    """(tokens, elements per token, flat) of one sample's state arriving at `layer`: seq_len tokens of the
    carried width (T5: 2H), or one flat row of every element where a vision model carries its image
    (`plait.models.vision`: up to the projector)."""
    elements = int(spec.carried_elements(layer, seq_len))
    stack = spec.stack
    if layer > 0 and stack[layer - 1].kind in ("patch_embed", "vision"):
        return 1, elements, True
    return seq_len, elements // seq_len, False
