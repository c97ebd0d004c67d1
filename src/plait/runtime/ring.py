"""Ring attention over a group of ranks, with document masks: each rank holds some of a row's tokens (any
split, e.g. `packing.zigzag`), passes its keys and values around the ring, and merges the partial softmax
of every block by its log-sum-exp. Backward sends the keys and values around again, with the gradients
of each block travelling one hop behind and arriving home after a full turn.

Shapes: q, k, v [B, heads, T_local, D] (k and v with as many heads as q). Every rank knows every rank's
token places in the row and their document numbers (`layout`), so it builds each block's mask itself;
under a sliding window the mask keeps only the keys inside each query's window, and a block it leaves empty
is skipped (its keys and values still travel on). Attention sinks (GPT-OSS: a logit per head in every
softmax's denominator) join the merge as one more block of a single key whose value is zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from plait.runtime.packing import document_mask
from plait.runtime.recompute import ring_keep


@dataclass(frozen=True)
class RingLayout:
    """Group `group` (its global ranks `ranks`), and for each of its members the row places ([T_local]) and
    document numbers ([T_local]) of the tokens it holds."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    index: tuple[Tensor, ...]
    documents: tuple[Tensor, ...]

    @property
    def me(self) -> int:
        return self.ranks.index(dist.get_rank())

    def mask(self, j: int, window: int = 0) -> Tensor:
        """Keys of member j this rank's queries may see (within a sliding `window` of tokens; 0: all earlier
        ones): bool [T_local, T_local_j]."""
        i = self.me
        return document_mask(self.documents[i], self.index[i], self.documents[j], self.index[j], window)


def _exchange(send: Tensor, layout: RingLayout) -> Tensor:
    """Send `send` to the next member of the ring and receive the previous member's (same shape)."""
    n, i = len(layout.ranks), layout.me
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, layout.ranks[(i + 1) % n], layout.group),
           dist.P2POp(dist.irecv, recv, layout.ranks[(i - 1) % n], layout.group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return recv


def _block(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Masked scores of one block, float32 [B, heads, Tq, Tk] (-inf where masked)."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    return s.masked_fill(~mask.to(s.device), float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, window: int,  # noqa: ANN001
                sinks: Tensor | None) -> Tensor:
        n, me = len(layout.ranks), layout.me
        ctx.window = window
        scale = 1.0 / math.sqrt(q.shape[-1])
        dk = k.shape[-1]
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.cat([k, v], dim=-1).contiguous()  # one message; values may be narrower (latent attention)
        for step in range(n):
            j = (me - step) % n
            mask = layout.mask(j, ctx.window)
            nxt = _exchange(kv, layout) if step < n - 1 else None
            if mask.any():
                s = _block(q, kv[..., :dk], mask, scale)
                block_lse = torch.logsumexp(s, dim=-1)  # -inf for rows with no key here
                new = torch.logaddexp(lse, block_lse)
                seen = torch.isfinite(new)
                p = torch.where(seen[..., None], torch.exp(s - new.where(seen, 0)[..., None]), 0.0)
                keep = torch.where(seen, torch.exp(lse - new.where(seen, 0)), 0.0)
                out = out * keep[..., None] + p @ kv[..., dk:].float()
                lse = new
            if nxt is not None:
                kv = nxt
        if sinks is not None:  # a key of score sink[head] and value 0: the denominator grows, nothing is added
            new = torch.logaddexp(lse, sinks.float()[None, :, None].expand_as(lse))
            out, lse = out * torch.exp(lse - new)[..., None], new
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.layout = layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        layout: RingLayout = ctx.layout
        n, me = len(layout.ranks), layout.me
        scale = 1.0 / math.sqrt(q.shape[-1])
        dout = dout.float()
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = k.shape[-1]
        kv = torch.cat([k, v], dim=-1).contiguous()
        # gradients of the block held now, travelling along
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(n):
            j = (me - step) % n
            mask = layout.mask(j, ctx.window)
            nxt = _exchange(kv, layout) if step < n - 1 else None
            if mask.any():
                kj, vj = kv[..., :dk].float(), kv[..., dk:].float()
                p = torch.exp(_block(q, kj, mask, scale) - lse[..., None])
                dkv[..., dk:] += p.transpose(-1, -2) @ dout
                ds = p * (dout @ vj.transpose(-1, -2) - delta)
                dq += (ds @ kj) * scale
                dkv[..., :dk] += (ds.transpose(-1, -2) @ q.float()) * scale
            dkv = _exchange(dkv, layout)  # one hop on; after n hops each block's gradients are home
            if nxt is not None:
                kv = nxt
        dsinks = None
        if sinks:  # the sink key's score gradient p_sink (dO . 0 - delta), summed over its rows
            p_sink = torch.exp(sinks[0].float()[None, :, None] - lse)
            dsinks = -(p_sink * delta[..., 0]).sum(dim=(0, 2)).to(sinks[0].dtype)
        return dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), None, None, dsinks


def ring_attention(q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, window: int = 0,
                   sinks: Tensor | None = None) -> Tensor:
    """Document-masked causal attention of this rank's queries over the whole row's keys (those within a
    sliding `window` of tokens; 0: all earlier ones), with the heads' `sinks` [heads] if given: q, k
    [B, heads, T_local, D], v [B, heads, T_local, Dv] -> [B, heads, T_local, Dv].
    Differentiable (ring backward). Under recompute=attn_kept it runs outside the recomputed region
    (plait.runtime.recompute.RingKeep)."""
    if (keep := ring_keep()) is None:
        return _RingAttention.apply(q, k, v, layout, window, sinks)
    return keep.run(lambda: _RingAttention.apply(q, k, v, layout, window, sinks), q.dtype)


@dataclass(frozen=True)
class RingContext:
    """Ring context parallelism for whole causal sequences (set as `Attention.context_parallel`): member j
    of the group holds positions [j T, (j + 1) T) of every sequence (T = seq_len / members, the runtime's
    contiguous split); the attention core keeps its chunk of the queries and sends keys and values around."""

    layout: RingLayout
    start: int
    splits_heads = False

    @classmethod
    def contiguous(cls, group: dist.ProcessGroup, seq_len: int) -> RingContext:
        ranks = tuple(dist.get_process_group_ranks(group))
        part = seq_len // len(ranks)
        index = tuple(torch.arange(j * part, (j + 1) * part) for j in range(len(ranks)))
        layout = RingLayout(group, ranks, index, tuple(torch.zeros(part, dtype=torch.long) for _ in ranks))
        return cls(layout, layout.me * part)

    @property
    def degree(self) -> int:
        return len(self.layout.ranks)

    def to_heads(self, x: Tensor) -> Tensor:
        return x  # the sequence stays split; keys and values travel instead

    def to_sequence(self, x: Tensor) -> Tensor:
        return x

    def rope(self, freqs: Tensor) -> Tensor:
        """The rotary angles of this rank's positions."""
        return freqs[self.start:]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int = 0, sinks: Tensor | None = None) -> Tensor:
        return ring_attention(q, k, v, self.layout, window, sinks)
