"""Re-layout of the hidden state between layers, or pipeline stages, whose strategies split it differently
(`plait.layout`): one all-to-all over the stage that moves exactly the blocks `plait.layout.exchange` plans.

Between pipeline stages, position i of one stage sends its piece to position i of the next, so the next
stage's ranks hold the previous stage's layout and re-layout the same way.

Gradient convention: under a layout whose weights are averaged over d = dp * cp replicas (DDP, FSDP), a
rank's activation gradient is d times the gradient of the global mean loss with respect to its piece
(what a per-rank mean loss gives). The backward of a re-layout from layout a to b is therefore the inverse
re-layout of the gradient, scaled by d_a / d_b, and every plan trains with single-process numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from plait.layout import Layout, exchange


def _local(block_range: tuple[int, int], origin: int) -> slice:
    return slice(block_range[0] - origin, block_range[1] - origin)


def _relayout(x: Tensor, src: Layout, dst: Layout, position: int, order: tuple[int, ...],
              group: dist.ProcessGroup) -> Tensor:
    """This position's `dst` piece, given its `src` piece `x` [b, t, ...]. `order[j]` is the group rank of
    position j."""
    batch, tokens = x.shape[0] * src.dp, x.shape[1] * src.token_parts
    (sb, _), (st, _) = src.piece(position, batch, tokens)
    (db, db1), (dt, dt1) = dst.piece(position, batch, tokens)
    out = x.new_empty((db1 - db, dt1 - dt, *x.shape[2:]))
    width = x[:1, :1].numel()  # elements per token
    sends: list[Tensor] = [x.new_empty(0)] * len(order)
    receives = []
    for block in exchange(src, dst, batch, tokens):
        if block.sender == position:
            part = x[_local(block.batch, sb), _local(block.tokens, st)]
            if block.receiver == position:
                out[_local(block.batch, db), _local(block.tokens, dt)] = part
            else:
                sends[order[block.receiver]] = part.reshape(-1)
        elif block.receiver == position:
            receives.append(block)
    in_splits = [s.numel() for s in sends]
    out_splits = [0] * len(order)
    for block in receives:
        out_splits[order[block.sender]] = block.cells * width
    got = x.new_empty(sum(out_splits))
    dist.all_to_all_single(got, torch.cat(sends), out_splits, in_splits, group=group)
    offsets = [sum(out_splits[:g]) for g in range(len(order))]
    for block in receives:
        start = offsets[order[block.sender]]
        shape = (block.batch[1] - block.batch[0], block.tokens[1] - block.tokens[0], *x.shape[2:])
        out[_local(block.batch, db), _local(block.tokens, dt)] = got[start: start + block.cells * width].view(shape)
    return out


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, src: Layout, dst: Layout, position: int, order: tuple[int, ...],
                group: dist.ProcessGroup) -> Tensor:
        ctx.args = (src, dst, position, order, group)
        return _relayout(x, src, dst, position, order, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        src, dst, position, order, group = ctx.args
        back = _relayout(grad.contiguous(), dst, src, position, order, group)
        if src.data_degree != dst.data_degree:
            back = back * (src.data_degree / dst.data_degree)
        return back, None, None, None, None, None


@dataclass(frozen=True)
class Relayout:
    """A differentiable re-layout of this rank's piece from `src` to `dst` over its stage's ranks."""

    src: Layout
    dst: Layout
    position: int  # this rank's index in the stage's rank list
    ranks: tuple[int, ...]  # the stage's ranks, in list order
    group: dist.ProcessGroup  # a process group over exactly those ranks

    def __call__(self, x: Tensor) -> Tensor:
        order = tuple(dist.get_group_rank(self.group, r) for r in self.ranks)
        return _Relayout.apply(x, self.src, self.dst, self.position, order, self.group)
