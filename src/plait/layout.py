"""How a layer strategy splits the hidden state over its stage, and what changing strategy moves.

A strategy splits a micro-batch's hidden state [B, T, H] over the n ranks of its stage, by their position
i in the stage's rank list (Megatron order: tp fastest, then cp, then dp). Position i holds the sequences
of its data-parallel part and the tokens of its context chunk, and with Megatron sequence parallelism only
its tensor-parallel part of that chunk; positions that differ in tp alone (without sp) hold copies.

Between consecutive layers (or pipeline stages) whose layouts differ, every position must end with its new
piece. `exchange` says who sends what: a position keeps what it already holds, and a piece held by several
replicas is sent by one of them (spread over the receivers). The runtime executes it as one all-to-all;
the cost model prices the same bytes (`received_fraction`, computed from the layouts' shapes without
listing the blocks), so planner and runtime agree on the traffic. Between pipeline stages of different
widths, `transfer` plans the same way over the two stages' ranks (every block is sent), and
`transfer_fraction` gives the cost model the busiest rank's share of those blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from math import gcd, lcm

from plait.plan import Strategy
from plait.spec.degrees import Degrees


@dataclass(frozen=True, order=True)
class Layout:
    """How a strategy splits a [B, T, ...] activation over its stage's positions."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    sp: bool = False

    @staticmethod
    def of(strategy: Strategy) -> Layout:
        return Layout(strategy.dp, strategy.cp, strategy.tp, strategy.sp and strategy.tp > 1)

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp

    def coords(self, position: int) -> tuple[int, int, int]:
        """(dp, cp, tp) coordinates of a position in the stage's rank list."""
        return Degrees(dp=self.dp, tp=self.tp, cp=self.cp).coords(position)

    @property
    def token_parts(self) -> int:
        """Parts the sequence is cut into (context chunks, each cut again by sp)."""
        return self.cp * (self.tp if self.sp else 1)

    @property
    def copies(self) -> int:
        """Consecutive positions holding the same piece (the tp ranks of a chunk without sp)."""
        return 1 if self.sp else self.tp

    @property
    def data_degree(self) -> int:
        """Replicas over which this layout's weights average their gradients (dp x cp)."""
        return self.dp * self.cp

    def piece(self, position: int, batch: int, tokens: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """([first, end) sequences, [first, end) tokens) of a [batch, tokens, ...] activation held by
        `position`. A batch that dp does not divide splits in near-equal blocks, the first batch % dp
        one sequence longer."""
        d, c, t = self.coords(position)
        part = c * self.tp + t if self.sp else c
        q, r = divmod(batch, self.dp)
        first, n = d * q + min(d, r), tokens // self.token_parts
        return (first, first + q + (d < r)), (part * n, (part + 1) * n)


@dataclass(frozen=True)
class Block:
    """Sequences [b0, b1) x tokens [t0, t1) of the whole activation that `sender` gives `receiver`."""

    sender: int
    receiver: int
    batch: tuple[int, int]
    tokens: tuple[int, int]

    @property
    def cells(self) -> int:
        return (self.batch[1] - self.batch[0]) * (self.tokens[1] - self.tokens[0])


def scatter_split(src: Layout, dst: Layout) -> int:
    """Ranks that each send 1/split of a piece at a pipeline boundary from layout `src` to `dst` under
    Megatron-LM's scatter/gather (p2p=megatron; Narayanan et al., SC21, Sec. 4.1): the tp ranks holding the
    same piece (no sequence parallelism) between stages of one layout; else 1. The runtime sends these
    parts (`plait.runtime.boundary`) and the cost model prices them (`plait.cost.price.send_time`)."""
    return src.copies if src == dst else 1


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@lru_cache(maxsize=4096)
def exchange(src: Layout, dst: Layout, batch: int, tokens: int) -> tuple[Block, ...]:
    """Every block moved (or kept: sender == receiver) so that each position of a stage holding `src`
    pieces of a [batch, tokens, ...] activation ends with its `dst` piece."""
    return _blocks(src, dst, batch, tokens, keep=True)


@lru_cache(maxsize=4096)
def transfer(src: Layout, dst: Layout, batch: int, tokens: int) -> tuple[Block, ...]:
    """Every block sent between pipeline stages of different widths: the `src.devices` positions of one
    stage hold `src` pieces of a [batch, tokens, ...] activation, and each of the `dst.devices` positions of
    the next (other ranks, so nothing is kept) receives its `dst` piece; a piece held by several replicas is
    sent by one of them, spread over the receivers. Senders index the first stage, receivers the second."""
    return _blocks(src, dst, batch, tokens, keep=False)


def _blocks(src: Layout, dst: Layout, batch: int, tokens: int, keep: bool) -> tuple[Block, ...]:
    """The blocks giving each `dst` position its piece from the `src` positions (`keep`: the same ranks, so a
    position keeps what it holds)."""
    holders: dict[tuple, list[int]] = {}
    for j in range(src.devices):
        holders.setdefault(src.piece(j, batch, tokens), []).append(j)
    blocks = []
    for i in range(dst.devices if not keep else src.devices):  # the same stage: its src.devices positions
        want_b, want_t = dst.piece(i, batch, tokens)
        for (have_b, have_t), owners in holders.items():
            b, t = _overlap(want_b, have_b), _overlap(want_t, have_t)
            if b is None or t is None:
                continue
            sender = i if keep and i in owners else owners[i % len(owners)]
            blocks.append(Block(sender, i, b, t))
    return tuple(blocks)


def _busiest(blocks: tuple[Block, ...], senders: int, receivers: int) -> int:
    """The most cells any sender sends or any receiver receives in `blocks`."""
    sent, received = [0] * senders, [0] * receivers
    for block in blocks:
        sent[block.sender] += block.cells
        received[block.receiver] += block.cells
    return max(*sent, *received)


@cache
def transfer_fraction(src: Layout, dst: Layout) -> float:
    """The most any rank sends or receives in a `transfer` between stages of different widths, in the slower
    direction (`src` to `dst` the activation forward, `dst` to `src` its gradient backward), as a fraction of
    the whole activation: the cost model's bytes for that boundary, from the blocks the runtime sends."""
    batch, tokens = lcm(src.dp, dst.dp), lcm(src.token_parts, dst.token_parts)
    most = max(_busiest(transfer(src, dst, batch, tokens), src.devices, dst.devices),
               _busiest(transfer(dst, src, batch, tokens), dst.devices, src.devices))
    return most / (batch * tokens)


def _kept_cells(src: Layout, dst: Layout, position: int, batch: int, tokens: int) -> int:
    """Cells of `position`'s `dst` piece it already holds in `src` (a [batch, tokens] activation)."""
    (sb, st), (db, dt) = src.piece(position, batch, tokens), dst.piece(position, batch, tokens)
    b, t = _overlap(sb, db), _overlap(st, dt)
    return 0 if b is None or t is None else (b[1] - b[0]) * (t[1] - t[0])


def _distinct_positions(src: Layout, dst: Layout) -> range:
    """Positions that between them meet every (src piece, dst piece) overlap a position can have.

    Pieces change only every `copies` positions, so both are constant on runs of gcd(copies) positions.
    With equal device counts, shifting a position by devices / gcd(src.dp, dst.dp) moves both its pieces by
    the same batch offset and keeps their token ranges, so one such period suffices: lcm(src.dp *
    src.token_parts, dst.dp * dst.token_parts) / gcd(src.dp, dst.dp) positions, never all pairs of devices.
    Stages of different sizes (where they meet) compare the positions both have."""
    if src.devices != dst.devices:
        return range(0, min(src.devices, dst.devices), gcd(src.copies, dst.copies))
    return range(0, src.devices // gcd(src.dp, dst.dp), gcd(src.copies, dst.copies))


@cache
def received_fraction(src: Layout, dst: Layout) -> float:
    """The most any position receives from others when switching from `src` to `dst`, as a fraction of
    the whole activation (0 when the layouts are equal): what `exchange`'s blocks move, from the shapes.

    Every position wants a dst piece of the same size and receives the part it does not hold in src, so
    the most received is that size less the least kept over the distinct positions."""
    if src == dst:
        return 0.0
    batch, tokens = lcm(src.dp, dst.dp), lcm(src.token_parts, dst.token_parts)
    wanted = batch // dst.dp * (tokens // dst.token_parts)
    kept = min(_kept_cells(src, dst, p, batch, tokens) for p in _distinct_positions(src, dst))
    return (wanted - kept) / (batch * tokens)
