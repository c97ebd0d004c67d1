"""The re-layout plan between strategies: every position ends with exactly its new piece, moving as
little as possible, and the cost model prices the bytes the runtime moves."""

from __future__ import annotations

import itertools
from math import lcm

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.layout import Layout, exchange, received_fraction
from plait.plan import Strategy


def layouts(n: int) -> list[Layout]:
    """Every layout of n positions (dp x cp x tp = n, sp only with tp > 1)."""
    out = []
    for dp, cp in itertools.product(range(1, n + 1), repeat=2):
        if n % (dp * cp):
            continue
        tp = n // (dp * cp)
        out += [Layout(dp, cp, tp, sp) for sp in ((False, True) if tp > 1 else (False,))]
    return out


def test_pieces_follow_megatron_order() -> None:
    lay = Layout(dp=2, cp=2, tp=2, sp=True)
    assert [lay.coords(i) for i in range(8)] == [(d, c, t) for d in range(2) for c in range(2) for t in range(2)]
    # position 3: dp 0, cp 1, tp 1 -> sequences [0, 4), the 4th quarter of the tokens
    assert lay.piece(3, 8, 64) == ((0, 4), (48, 64))
    assert Layout(tp=2).piece(1, 8, 64) == ((0, 8), (0, 64))  # tp without sp: a full copy
    assert Layout.of(Strategy(dp=2, tp=2, sp=True, zero=3)) == Layout(dp=2, tp=2, sp=True)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.data())
def test_every_position_ends_with_exactly_its_piece(n, data) -> None:
    src = data.draw(st.sampled_from(layouts(n)))
    dst = data.draw(st.sampled_from(layouts(n)))
    batch, tokens = 8 * n, 16 * n
    blocks = exchange(src, dst, batch, tokens)
    for i in range(n):
        (b0, b1), (t0, t1) = dst.piece(i, batch, tokens)
        covered = set()
        for blk in (b for b in blocks if b.receiver == i):
            cells = {(b, t) for b in range(*blk.batch) for t in range(*blk.tokens)}
            assert not covered & cells, "a cell arrives twice"
            covered |= cells
            # the sender really holds what it sends
            (sb0, sb1), (st0, st1) = src.piece(blk.sender, batch, tokens)
            assert sb0 <= blk.batch[0] and blk.batch[1] <= sb1 and st0 <= blk.tokens[0] and blk.tokens[1] <= st1
        assert covered == {(b, t) for b in range(b0, b1) for t in range(t0, t1)}
    # what a position already holds is never sent to it
    for blk in blocks:
        if blk.sender != blk.receiver:
            (sb0, sb1), (st0, st1) = src.piece(blk.receiver, batch, tokens)
            assert not (sb0 < blk.batch[1] and blk.batch[0] < sb1 and st0 < blk.tokens[1] and blk.tokens[0] < st1)


@pytest.mark.parametrize("src,dst,fraction", [
    (Layout(dp=2), Layout(tp=2), 0.5),  # gather the other half of the batch
    (Layout(tp=2), Layout(dp=2), 0.0),  # keep a half of the copy
    (Layout(dp=4), Layout(tp=4), 0.75),
    (Layout(dp=2, tp=2), Layout(dp=4), 0.0),
    (Layout(dp=4), Layout(dp=2, tp=2), 0.25),
    (Layout(tp=2, sp=True), Layout(tp=2), 0.5),  # sequence parallel -> replicated: an all-gather
    (Layout(cp=2), Layout(dp=2), 0.25),  # tokens split -> sequences split: swap a quarter
    (Layout(dp=2, tp=2), Layout(dp=2, tp=2), 0.0),
])
def test_received_fraction(src, dst, fraction) -> None:
    assert received_fraction(src, dst) == pytest.approx(fraction)


def enumerated_fraction(src: Layout, dst: Layout) -> float:
    """The most any position receives, summed over `exchange`'s blocks (the reference for the closed form)."""
    batch, tokens = lcm(src.dp, dst.dp), lcm(src.token_parts, dst.token_parts)
    got = [0] * src.devices
    for block in exchange(src, dst, batch, tokens):
        if block.sender != block.receiver:
            got[block.receiver] += block.cells
    return max(got) / (batch * tokens)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.integers(1, 64), st.sampled_from([12, 16, 24, 32, 36, 48, 60, 64])), st.data())
def test_received_fraction_equals_the_exchange(n, data) -> None:
    src = data.draw(st.sampled_from(layouts(n)))
    dst = data.draw(st.sampled_from(layouts(n)))
    assert received_fraction(src, dst) == enumerated_fraction(src, dst)


def test_received_fraction_equals_the_exchange_for_every_pair_of_24() -> None:
    for src, dst in itertools.product(layouts(24), repeat=2):
        assert received_fraction(src, dst) == enumerated_fraction(src, dst), (src, dst)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), st.data())
def test_stages_of_different_sizes_compare_the_positions_both_have(n, m, data) -> None:
    src = data.draw(st.sampled_from(layouts(n)))
    dst = data.draw(st.sampled_from(layouts(m)))
    assert received_fraction(src, dst) == enumerated_fraction(src, dst)
