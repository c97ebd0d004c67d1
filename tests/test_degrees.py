"""One object owns a layer's degrees: coordinates and groups in Megatron order, shared by the layout of
activations, the cost model's groups and the runtime's meshes."""

from __future__ import annotations

import itertools

import pytest
from helpers import expect_error

from plait.layout import Layout
from plait.plan import Strategy
from plait.spec.degrees import Degrees


def test_groups_partition_the_stage_in_megatron_order() -> None:
    d = Degrees(dp=2, cp=2, tp=2)
    ranks = tuple(range(10, 18))
    assert d.group(ranks, "tp") == (10, 11)
    assert d.group(ranks, "cp") == (10, 12)
    assert d.group(ranks, "dp") == (10, 14)
    assert d.group(ranks, "data") == (10, 12, 14, 16)
    assert d.group(ranks, "tp", position=5) == (14, 15)
    assert d.group(ranks, "data", position=5) == (11, 13, 15, 17)


@pytest.mark.parametrize("dp,cp,tp", [(a, b, c) for a, b, c in itertools.product((1, 2, 3), (1, 2), (1, 2, 4))])
def test_every_rank_is_in_exactly_one_group_of_each_dimension(dp: int, cp: int, tp: int) -> None:
    d = Degrees(dp=dp, cp=cp, tp=tp)
    ranks = tuple(range(d.stage_devices))
    for dim, size in (("tp", tp), ("cp", cp), ("dp", dp), ("data", dp * cp)):
        groups = {d.group(ranks, dim, p) for p in ranks}
        assert sorted(r for g in groups for r in g) == list(ranks)
        assert all(len(g) == size for g in groups)
        for p in ranks:  # a group's members differ from `p` in `dim`'s coordinates only
            for q in d.group(ranks, dim, p):
                same = [a == b for a, b in zip(d.coords(p), d.coords(q), strict=True)]
                keep = {"dp": (1, 2), "cp": (0, 2), "tp": (0, 1), "data": (2,)}[dim]
                assert all(same[i] for i in keep)


def test_strategy_and_layout_use_the_same_coordinates() -> None:
    s = Strategy(dp=2, cp=2, tp=2, sp=True)
    assert s.degrees == Degrees(dp=2, cp=2, tp=2)
    assert all(Layout.of(s).coords(p) == s.degrees.coords(p) for p in range(8))
    assert s.degrees.mesh_shape == (2, 2, 2) and s.degrees.data == 4


def test_degrees_refuse_bad_values() -> None:
    expect_error(lambda: Degrees(tp=0), "tp must be a positive integer")
    expect_error(lambda: Degrees(dp=2, ep=4), "ep=4 must divide dp*cp")
