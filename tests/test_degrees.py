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
    assert s.degrees == Degrees(dp=2, cp=2, tp=2, etp=2)  # experts split like the attention unless told
    assert all(Layout.of(s).coords(p) == s.degrees.coords(p) for p in range(8))
    assert s.degrees.mesh_shape == (2, 2, 2) and s.degrees.data == 4


def test_degrees_refuse_bad_values() -> None:
    expect_error(lambda: Degrees(tp=0), "tp must be a positive integer")
    expect_error(lambda: Degrees(dp=2, ep=4), "ep*etp = 4*1 must divide the stage's dp*cp*tp = 2")
    expect_error(lambda: Degrees(dp=2, tp=2, ep=2, etp=4), "ep*etp = 2*4")


def test_expert_groups_fold_over_the_stage_ranks() -> None:
    """Megatron's parallel folding: experts lay out etp fastest, then ep, then expert data parallel, over
    the same ranks as the attention's (dp, cp, tp), whatever those are."""
    d = Degrees(dp=2, tp=4, ep=4, etp=2)  # attention: dp2 x tp4; experts: edp1 x ep4 x etp2
    ranks = tuple(range(8))
    assert d.edp == 1
    assert d.expert_group(ranks, "etp") == (0, 1)
    assert d.expert_group(ranks, "ep") == (0, 2, 4, 6)
    assert d.expert_group(ranks, "ep", position=3) == (1, 3, 5, 7)
    assert d.expert_group(ranks, "edp") == (0,)
    e = Degrees(dp=4, tp=2, ep=2)  # experts: edp4 x ep2 x etp1
    assert e.edp == 4 and e.expert_group(ranks, "ep", 5) == (4, 5) and e.expert_group(ranks, "edp", 1) == (1, 3, 5, 7)


@pytest.mark.parametrize("dp,tp,ep,etp", [(4, 2, 2, 1), (2, 4, 4, 2), (8, 1, 8, 1), (2, 2, 1, 4), (1, 8, 2, 2)])
def test_every_rank_is_in_exactly_one_expert_group_of_each_dimension(dp: int, tp: int, ep: int, etp: int) -> None:
    d = Degrees(dp=dp, tp=tp, ep=ep, etp=etp)
    ranks = tuple(range(100, 100 + d.stage_devices))
    for dim, size in (("etp", etp), ("ep", ep), ("edp", d.edp)):
        groups = {d.expert_group(ranks, dim, p) for p in range(len(ranks))}  # type: ignore[arg-type]
        assert sorted(r for g in groups for r in g) == list(ranks)
        assert all(len(g) == size for g in groups)
        for p in range(len(ranks)):
            for q in d.expert_group(ranks, dim, p):  # type: ignore[arg-type]
                same = [a == b for a, b in zip(d.expert_coords(p), d.expert_coords(q - 100), strict=True)]
                keep = {"edp": (1, 2), "ep": (0, 2), "etp": (0, 1)}[dim]
                assert all(same[i] for i in keep)


def test_hsdp_shard_and_replicate_groups_cut_the_data_ranks() -> None:
    d = Degrees(dp=8, tp=2, shard=4)  # 16 ranks: data ranks of tp coordinate 0 are 0, 2, ..., 14
    ranks = tuple(range(16))
    assert d.shard_size == 4 and d.replicas == 2
    assert d.group(ranks, "shard") == (0, 2, 4, 6)
    assert d.group(ranks, "replicate") == (0, 8)
    assert d.group(ranks, "shard", position=11) == (9, 11, 13, 15)
    assert d.group(ranks, "replicate", position=11) == (3, 11)
    plain = Degrees(dp=8, tp=2)
    assert plain.shard_size == 8 and plain.replicas == 1
    assert plain.group(ranks, "shard") == plain.group(ranks, "data") and plain.group(ranks, "replicate") == (0,)
    for position in range(16):  # every data-parallel rank is in one shard group and one replicate group
        shard, replicate = d.group(ranks, "shard", position), d.group(ranks, "replicate", position)
        assert set(shard) & set(replicate) == {ranks[position]}
        assert set(shard) | set(replicate) <= set(d.group(ranks, "data", position))


def test_shard_must_divide_the_data_ranks() -> None:
    expect_error(lambda: Degrees(dp=8, shard=3), "shard=3", "divide")
