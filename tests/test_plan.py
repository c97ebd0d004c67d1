"""Tests for plait.plan: the --strategy shorthand, hand-written plans, JSON/YAML files and validation."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml
from helpers import expect_error
from hypothesis import given, settings
from hypothesis import strategies as st

import plait.io
import plait.plan as plan_mod
from plait.errors import PlaitError
from plait.plan import (
    PLAN_VERSION,
    Pipeline,
    Plan,
    Stage,
    Strategy,
    load_plan,
    parse_strategy,
    recut_chunks,
    split_layers,
    uniform_plan,
    validate_plan,
)
from plait.spec.cluster import load_cluster
from plait.spec.model import PRESETS, ModelSpec, parse_inline

GPT175 = PRESETS["gpt3-175b"]
TINY = PRESETS["tiny-gpt"]  # 4 layers, hidden 128, 4 heads, seq 256
C1536 = load_cluster("192x8xA100-80GB")
C8 = load_cluster("1x8xA100-80GB")
C16 = load_cluster("2x8xH100-80GB")


def S(**kw) -> Strategy:  # short helper
    return Strategy(**kw)


def one_stage_plan(strategies: tuple[Strategy, ...], ranks=tuple(range(8)), mbs: int = 8, mb: int = 2,
                   model: ModelSpec = TINY, seq: int = 256, **plan_kw) -> Plan:
    stage = Stage(layers=(0, model.layers), ranks=tuple(ranks), strategies=strategies)
    kw = {"model": model.name, "seq_len": seq, "global_batch": mbs * mb,
          "pipelines": (Pipeline(stages=(stage,), micro_batches=mb, micro_batch_sequences=mbs),)}
    kw.update(plan_kw)
    return Plan(**kw)


# ---- the --strategy shorthand ----------------------------------------------------------------------------

def test_megatron_175b_interleaved() -> None:
    p = uniform_plan("tp=8,pp=8,dp=24,mbs=2,gbs=2304,recompute=full,vpp=2", GPT175, C1536, 2048)
    assert p.model == "gpt3-175b" and p.seq_len == 2048 and p.global_batch == 2304
    assert p.schedule == "interleaved" and p.chunks == 2 and p.pp == 8
    assert p.precision == "bf16" and p.overlap_grad_reduce and p.version == PLAN_VERSION
    assert len(p.pipelines) == 1
    pipe = p.pipelines[0]
    assert pipe.micro_batches == 48 and pipe.micro_batch_sequences == 48 and pipe.samples == 2304
    assert len(pipe.stages) == 16
    for j, stage in enumerate(pipe.stages):
        assert stage.layers == (6 * j, 6 * j + 6) and stage.num_layers == 6
        group = j % 8
        assert stage.ranks == tuple(range(192 * group, 192 * (group + 1)))
        assert stage.ranks == pipe.stages[group].ranks
        assert len(stage.strategies) == 1
        s = stage.strategy(6 * j)
        assert (s.tp, s.dp, s.cp, s.sp, s.zero, s.recompute) == (8, 24, 1, False, 0, "full")
        assert s.devices == 192
    assert p.ranks == tuple(range(1536))
    validate_plan(p, GPT175, C1536)  # idempotent


def test_defaults_infer_dp_and_gbs() -> None:
    p = uniform_plan("tp=2,pp=2", TINY, C8, 256)
    pipe = p.pipelines[0]
    s = pipe.stages[0].strategies[0]
    assert (s.tp, s.dp, s.cp, s.sp, s.zero, s.recompute, s.cp_mode) == (2, 2, 1, False, 0, "none", "ulysses")
    assert pipe.micro_batch_sequences == 2  # mbs=1 per replica x dp=2
    assert pipe.micro_batches == 8  # 4 * pp
    assert p.global_batch == 16
    assert p.schedule == "1f1b" and p.chunks == 1 and p.precision == "bf16" and p.overlap_grad_reduce
    assert [st.layers for st in pipe.stages] == [(0, 2), (2, 4)]
    assert [st.ranks for st in pipe.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_defaults_no_pipeline() -> None:
    p = uniform_plan("", TINY, C8, 256)
    pipe = p.pipelines[0]
    assert len(pipe.stages) == 1 and pipe.stages[0].strategies[0].dp == 8
    assert pipe.micro_batches == 1 and p.global_batch == 8


def test_all_keys() -> None:
    p = uniform_plan("tp=2, pp=1, cp=2, dp=2, mbs=2, gbs=16, recompute=selective, sp=1, zero=3, "
                     "schedule=gpipe, cp_mode=ring, precision=fp16, overlap=off", TINY, C8, 256)
    s = p.pipelines[0].stages[0].strategies[0]
    assert (s.tp, s.cp, s.dp, s.sp, s.zero, s.recompute, s.cp_mode) == (2, 2, 2, True, 3, "selective", "ring")
    assert p.schedule == "gpipe" and p.precision == "fp16" and not p.overlap_grad_reduce
    assert p.pipelines[0].micro_batch_sequences == 4 and p.pipelines[0].micro_batches == 4


def test_uneven_layer_split_puts_fewer_layers_first() -> None:
    m = parse_inline("gpt:layers=10,hidden=64,heads=4,vocab=100")
    p = uniform_plan("pp=4,dp=2", m, C8, 128)
    assert [s.num_layers for s in p.pipelines[0].stages] == [2, 2, 3, 3]
    assert split_layers(10, 4) == [2, 2, 3, 3]
    assert split_layers(96, 16) == [6] * 16
    assert split_layers(5, 5) == [1] * 5


def test_the_shorthand_prices_megatron_pipeline_exchanges_on_request() -> None:
    m = parse_inline("gpt:layers=8,hidden=64,heads=4,vocab=100")
    assert uniform_plan("pp=2,dp=4,p2p=async", m, C8, 128).p2p == "async"
    assert uniform_plan("pp=2,dp=4,p2p=megatron", m, C8, 128).p2p == "megatron"
    assert uniform_plan("pp=2,dp=4,p2p=torch", m, C8, 128).p2p == "torch"
    expect_error(lambda: uniform_plan("pp=2,dp=4,p2p=sync", m, C8, 128), "p2p")


def test_plans_are_priced_as_the_runtimes_schedules_exchange_by_default() -> None:
    """torch's Schedule1F1B waits on each steady-state op's sends (p2p=torch); ScheduleGPipe, torch >= 2.10's
    ScheduleInterleaved1F1B and the runtime's own schedules (here: fewer micro-batches than stages) do not."""
    m = parse_inline("gpt:layers=8,hidden=64,heads=4,vocab=100")
    assert uniform_plan("pp=2,dp=4", m, C8, 128).p2p == "torch"
    assert uniform_plan("pp=2,dp=4,schedule=gpipe", m, C8, 128).p2p == "async"
    assert uniform_plan("pp=2,dp=4,vpp=2", m, C8, 128).p2p == "async"
    assert uniform_plan("pp=4,dp=2,gbs=6", m, C8, 128).p2p == "async"  # 3 micro-batches, 4 stages
    assert uniform_plan("pp=1,dp=8", m, C8, 128).p2p == "async"


def test_recut_chunks_moves_layers_between_the_chunks_of_an_interleaved_plan() -> None:
    """Llama 3's balance in small: 10 layers on pp=2, vpp=2, one layer fewer in the first and the last chunk."""
    m = parse_inline("gpt:layers=10,hidden=64,heads=4,vocab=100")
    p = uniform_plan("pp=2,vpp=2,dp=4", m, C8, 128)
    assert [s.num_layers for s in p.pipelines[0].stages] == [2, 2, 3, 3]
    q = recut_chunks(p, [2, 3, 3, 2], m, C8)
    assert [s.layers for s in q.pipelines[0].stages] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [s.ranks for s in q.pipelines[0].stages] == [s.ranks for s in p.pipelines[0].stages]
    assert q.chunks == 2 and q.pipelines[0].micro_batches == p.pipelines[0].micro_batches
    expect_error(lambda: recut_chunks(p, [2, 3, 3, 3], m, C8), "chunk_layers [2, 3, 3, 3]", "summing to the 10")
    expect_error(lambda: recut_chunks(p, [5, 5], m, C8), "must give 4 counts")
    expect_error(lambda: recut_chunks(p, [0, 4, 3, 3], m, C8), "each >= 1")


@given(layers=st.integers(1, 200), parts=st.integers(1, 50))
@settings(max_examples=100, deadline=None)
def test_split_layers_property(layers: int, parts: int) -> None:
    counts = split_layers(layers, parts)
    assert len(counts) == parts and sum(counts) == layers
    assert counts == sorted(counts) and max(counts) - min(counts) <= 1


def test_parse_strategy() -> None:
    assert parse_strategy("tp=8, pp=2,,recompute=full") == {"tp": "8", "pp": "2", "recompute": "full"}
    expect_error(lambda: parse_strategy("tp=8,foo=1"), "foo=1", "tp")
    expect_error(lambda: parse_strategy("tp"), "'tp'")


@pytest.mark.parametrize("text,needles", [
    ("tp=x", ("tp", "'x'")),
    ("tp=0", ("tp", "0")),
    ("dp=-2", ("dp", "-2")),
    ("recompute=some", ("recompute", "'some'")),
    ("schedule=zb", ("schedule", "'zb'")),
    ("precision=fp8", ("precision", "'fp8'")),
    ("cp_mode=hybrid", ("cp_mode", "'hybrid'")),
    ("zero=4", ("zero", "4")),
    ("sp=maybe", ("sp", "'maybe'")),
    ("tp=3", ("3", "8 devices")),  # 3 does not divide 8
    ("tp=2,dp=2", ("2*1*2*1", "dp=4")),  # 4 of 8 devices
    ("pp=8,vpp=2", ("pp*vpp = 16", "4 layers")),
    ("dp=8,mbs=1,gbs=12", ("gbs=12", "mbs*dp = 8")),
    ("tp=8", ("tp=8", "heads=4")),
    ("sp=1", ("sp", "tp")),
])
def test_strategy_errors(text: str, needles: tuple[str, ...]) -> None:
    expect_error(lambda: uniform_plan(text, TINY, C8, 256), *needles)


def test_one_micro_batch_is_valid() -> None:
    p = uniform_plan("pp=4,dp=2,schedule=1f1b,gbs=2", TINY, C8, 256)
    assert p.pipelines[0].micro_batches == 1 and p.global_batch == 2


def test_interleaved_needs_micro_batches_divisible_by_pp() -> None:
    m = parse_inline("gpt:layers=8,hidden=64,heads=4,vocab=100")
    expect_error(lambda: uniform_plan("pp=4,dp=2,vpp=2,gbs=12", m, C8, 128), "(6)", "(4)", "interleaved")
    assert uniform_plan("pp=4,dp=2,vpp=2,gbs=16", m, C8, 128).pipelines[0].micro_batches == 8


def test_chunks_need_interleaved_schedule() -> None:
    m = parse_inline("gpt:layers=8,hidden=64,heads=4,vocab=100")
    expect_error(lambda: uniform_plan("pp=2,dp=4,vpp=2,schedule=1f1b", m, C8, 128), "chunks=2", "interleaved")


def test_ulysses_cp_must_divide_heads() -> None:
    expect_error(lambda: uniform_plan("cp=8", TINY, C8, 256), "cp=8", "4 query")
    expect_error(lambda: uniform_plan("tp=2,cp=4", TINY, C8, 256), "cp=4", "2 query")
    # ring attention does not split heads
    p = uniform_plan("cp=8,cp_mode=ring", TINY, C8, 256)
    assert p.pipelines[0].stages[0].strategies[0].cp == 8
    assert uniform_plan("cp=4,dp=2", TINY, C8, 256).pipelines[0].stages[0].strategies[0].cp == 4


def test_cp_must_divide_seq_len() -> None:
    expect_error(lambda: uniform_plan("cp=8,cp_mode=ring", TINY, C8, 100), "cp=8", "seq_len=100")


# ---- validation of hand-written plans ------------------------------------------------------------------------

def test_degrees_must_multiply_to_stage_devices() -> None:
    p = one_stage_plan((S(tp=2, dp=2),))
    expect_error(lambda: validate_plan(p, TINY, C8), "2*2*1 = 4", "8 ranks")


def test_tp_must_divide_heads() -> None:
    p = one_stage_plan((S(tp=8),))
    expect_error(lambda: validate_plan(p, TINY, C8), "tp=8", "heads=4")
    gqa = parse_inline("llama:layers=4,hidden=128,heads=8,kv_heads=2,ffn=256,vocab=100")
    p4 = one_stage_plan((S(tp=4, dp=2),), model=gqa)
    expect_error(lambda: validate_plan(p4, gqa, C8), "tp=4", "kv_heads=2")


def test_sp_needs_tp() -> None:
    p = one_stage_plan((S(dp=8, sp=True),))
    expect_error(lambda: validate_plan(p, TINY, C8), "sp", "tp > 1")


def test_ranks_out_of_range() -> None:
    p = one_stage_plan((S(dp=8),), ranks=range(1, 9))
    expect_error(lambda: validate_plan(p, TINY, C8), "rank 8", "0..7")


def test_overlapping_ranks_between_stages() -> None:
    st0 = Stage(layers=(0, 2), ranks=(0, 1, 2, 3), strategies=(S(dp=4),))
    st1 = Stage(layers=(2, 4), ranks=(3, 4, 5, 6), strategies=(S(dp=4),))
    p = Plan(model="tiny-gpt", seq_len=256, global_batch=16,
             pipelines=(Pipeline(stages=(st0, st1), micro_batches=4, micro_batch_sequences=4),))
    expect_error(lambda: validate_plan(p, TINY, C8), "rank 3", "stage 0", "stage 1")


def test_overlapping_ranks_between_pipelines() -> None:
    a = Pipeline(stages=(Stage(layers=(0, 4), ranks=(0, 1, 2, 3), strategies=(S(dp=4),)),),
                 micro_batches=1, micro_batch_sequences=4)
    b = Pipeline(stages=(Stage(layers=(0, 4), ranks=(2, 3, 4, 5), strategies=(S(dp=4),)),),
                 micro_batches=1, micro_batch_sequences=4)
    p = Plan(model="tiny-gpt", seq_len=256, global_batch=8, pipelines=(a, b))
    expect_error(lambda: validate_plan(p, TINY, C8), "rank 2", "pipeline 0", "pipeline 1")


def test_layers_must_cover_model() -> None:
    p = one_stage_plan((S(dp=8),))
    short = p.model_copy(update={"pipelines": (Pipeline(
        stages=(Stage(layers=(0, 3), ranks=tuple(range(8)), strategies=(S(dp=8),)),),
        micro_batches=2, micro_batch_sequences=8),)})
    expect_error(lambda: validate_plan(short, TINY, C8), "0..2", "4 layers", "end at 4")
    long = one_stage_plan((S(dp=8),), model=TINY.with_(layers=6))
    expect_error(lambda: validate_plan(long, TINY, C8), "0..5", "4 layers")


def test_gap_between_stages() -> None:
    st0 = Stage(layers=(0, 1), ranks=(0, 1, 2, 3), strategies=(S(dp=4),))
    st1 = Stage(layers=(2, 4), ranks=(4, 5, 6, 7), strategies=(S(dp=4),))
    p = Plan(model="tiny-gpt", seq_len=256, global_batch=16,
             pipelines=(Pipeline(stages=(st0, st1), micro_batches=4, micro_batch_sequences=4),))
    expect_error(lambda: validate_plan(p, TINY, C8), "stage 1", "layer 2", "expected 1")
    overlap = p.model_copy(update={"pipelines": (Pipeline(
        stages=(st0.model_copy(update={"layers": (0, 3)}), st1), micro_batches=4, micro_batch_sequences=4),)})
    expect_error(lambda: validate_plan(overlap, TINY, C8), "layer 2", "expected 3")


def test_global_batch_mismatch() -> None:
    p = one_stage_plan((S(dp=8),), global_batch=17)
    expect_error(lambda: validate_plan(p, TINY, C8), "16 sequences", "global_batch is 17")


def test_chunk_ranks_must_repeat_device_groups() -> None:
    stages = (
        Stage(layers=(0, 1), ranks=(0, 1, 2, 3), strategies=(S(dp=4),)),
        Stage(layers=(1, 2), ranks=(4, 5, 6, 7), strategies=(S(dp=4),)),
        Stage(layers=(2, 3), ranks=(4, 5, 6, 7), strategies=(S(dp=4),)),  # should be group 0
        Stage(layers=(3, 4), ranks=(0, 1, 2, 3), strategies=(S(dp=4),)),
    )
    p = Plan(model="tiny-gpt", seq_len=256, global_batch=16, schedule="interleaved", chunks=2,
             pipelines=(Pipeline(stages=stages, micro_batches=4, micro_batch_sequences=4),))
    expect_error(lambda: validate_plan(p, TINY, C8), "stage 2", "stage 0")
    three = p.model_copy(update={"pipelines": (Pipeline(stages=stages[:3], micro_batches=4, micro_batch_sequences=4),)})
    expect_error(lambda: validate_plan(three, TINY, C8), "3 stages", "chunks=2")


def test_hand_written_interleaved_plan_validates() -> None:
    g0, g1 = (0, 1, 2, 3), (4, 5, 6, 7)
    stages = tuple(Stage(layers=(i, i + 1), ranks=g, strategies=(S(dp=2, tp=2),))
                   for i, g in enumerate((g0, g1, g0, g1)))
    p = Plan(model="tiny-gpt", seq_len=256, global_batch=8, schedule="interleaved", chunks=2,
             pipelines=(Pipeline(stages=stages, micro_batches=4, micro_batch_sequences=2),))
    validate_plan(p, TINY, C8)
    assert p.pp == 2 and p.ranks == tuple(range(8))


def test_interleaved_micro_batches_hand_written() -> None:
    g0, g1 = (0, 1, 2, 3), (4, 5, 6, 7)
    stages = tuple(Stage(layers=(i, i + 1), ranks=g, strategies=(S(dp=4),))
                   for i, g in enumerate((g0, g1, g0, g1)))
    p = Plan(model="tiny-gpt", seq_len=256, global_batch=12, schedule="interleaved", chunks=2,
             pipelines=(Pipeline(stages=stages, micro_batches=3, micro_batch_sequences=4),))
    expect_error(lambda: validate_plan(p, TINY, C8), "(3)", "(2)")


def test_chunks_without_interleaved_hand_written() -> None:
    g0, g1 = (0, 1, 2, 3), (4, 5, 6, 7)
    stages = tuple(Stage(layers=(i, i + 1), ranks=g, strategies=(S(dp=4),))
                   for i, g in enumerate((g0, g1, g0, g1)))
    p = Plan(model="tiny-gpt", seq_len=256, global_batch=16, schedule="gpipe", chunks=2,
             pipelines=(Pipeline(stages=stages, micro_batches=4, micro_batch_sequences=4),))
    expect_error(lambda: validate_plan(p, TINY, C8), "chunks=2", "'interleaved'")


def test_ulysses_cp_hand_written() -> None:
    p = one_stage_plan((S(cp=8),), mbs=1)
    expect_error(lambda: validate_plan(p, TINY, C8), "Ulysses cp=8", "4 query")


def test_micro_batch_not_divisible_by_dp() -> None:
    p = one_stage_plan((S(dp=8),), mbs=12, mb=1)
    expect_error(lambda: validate_plan(p, TINY, C8), "12 sequences", "dp=8")


def test_galvatron_per_layer_plan() -> None:
    layer_strats = (
        S(dp=8, zero=3),
        S(dp=4, tp=2, sp=True),
        S(dp=2, tp=2, cp=2, recompute="selective"),
        S(dp=2, tp=4, sp=True, zero=1, recompute="full"),
    )
    p = one_stage_plan(layer_strats)
    validate_plan(p, TINY, C8)
    stage = p.pipelines[0].stages[0]
    assert [stage.strategy(layer) for layer in range(4)] == list(layer_strats)
    assert stage.layer_strategies() == [(s, 1) for s in layer_strats]
    assert layer_strats[3].short() == "dp2 tp4 sp zero1 rc=full"
    assert layer_strats[2].short() == "dp2 tp2 cp2 rc=selective"
    assert S(dp=1, tp=1, cp=2, cp_mode="ring").short() == "dp1 tp1 cp2-ring"


def test_layer_strategies_runs() -> None:
    a, b = S(dp=8), S(tp=2, dp=4)
    stage = Stage(layers=(3, 8), ranks=tuple(range(8)), strategies=(a, a, b, b, a))
    assert stage.layer_strategies() == [(a, 2), (b, 2), (a, 1)]
    assert stage.strategy(5) == b and stage.strategy(7) == a
    single = Stage(layers=(3, 8), ranks=tuple(range(8)), strategies=(a,))
    assert single.layer_strategies() == [(a, 5)] and single.strategy(6) == a


def test_malleus_two_different_pipelines_one_device_left_out() -> None:
    fast = Pipeline(stages=(
        Stage(layers=(0, 1), ranks=(0, 1), strategies=(S(dp=2),)),
        Stage(layers=(1, 4), ranks=(2, 3), strategies=(S(tp=2),)),
    ), micro_batches=4, micro_batch_sequences=2)
    slow = Pipeline(stages=(
        Stage(layers=(0, 3), ranks=(4, 5), strategies=(S(tp=2, sp=True),)),
        Stage(layers=(3, 4), ranks=(6,), strategies=(S(),)),
    ), micro_batches=3, micro_batch_sequences=2)
    p = Plan(model="tiny-gpt", seq_len=256, global_batch=14, pipelines=(fast, slow))
    validate_plan(p, TINY, C8.with_slow({7: 4.0}))
    assert p.ranks == (0, 1, 2, 3, 4, 5, 6)  # rank 7 (the straggler) is left out
    assert [pl.samples for pl in p.pipelines] == [8, 6]
    assert p.pp == 2
    back = Plan.model_validate_json(p.to_json())
    assert back == p


def test_stage_shape_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="give 1 or 2"):
        Stage(layers=(0, 2), ranks=(0,), strategies=(S(), S(), S()))
    with pytest.raises(ValueError, match="without repeats"):
        Stage(layers=(0, 2), ranks=(0, 0), strategies=(S(),))
    with pytest.raises(ValueError, match=r"\[2, 2\]"):
        Stage(layers=(2, 2), ranks=(0,), strategies=(S(),))
    with pytest.raises(ValueError):
        Strategy(tp=0)
    with pytest.raises(ValueError):
        Strategy(zero=4)
    with pytest.raises(ValueError):
        Strategy(dp=1, bogus=1)


def test_models_are_frozen() -> None:
    s = S(dp=2)
    with pytest.raises(ValueError):
        s.dp = 4  # type: ignore[misc]


# ---- files ------------------------------------------------------------------------------------------------

def test_json_round_trip(tmp_path: Path) -> None:
    p = uniform_plan("tp=8,pp=8,dp=24,mbs=2,gbs=2304,recompute=full,vpp=2", GPT175, C1536, 2048)
    path = tmp_path / "plan.json"
    p.save(path)
    assert os.listdir(tmp_path) == ["plan.json"]  # no temp files left behind
    back = load_plan(path)
    assert back == p
    assert back.pp == p.pp and back.ranks == p.ranks
    raw = json.loads(path.read_text())
    assert raw["version"] == PLAN_VERSION and raw["chunks"] == 2
    assert raw["pipelines"][0]["stages"][3]["layers"] == [18, 24]
    validate_plan(back, GPT175, C1536)


def test_yaml_round_trip(tmp_path: Path) -> None:
    p = one_stage_plan((S(dp=8, zero=3), S(dp=4, tp=2, sp=True), S(dp=2, tp=2, cp=2, cp_mode="ring"),
                        S(dp=2, tp=4, recompute="full")), precision="fp16", overlap_grad_reduce=False)
    for name in ("plan.yaml", "plan.yml"):
        path = tmp_path / name
        p.save(path)
        raw = yaml.safe_load(path.read_text())
        assert raw["precision"] == "fp16" and raw["pipelines"][0]["stages"][0]["strategies"][1]["sp"] is True
        assert load_plan(path) == p
    assert sorted(os.listdir(tmp_path)) == ["plan.yaml", "plan.yml"]


def test_save_creates_directories_and_overwrites(tmp_path: Path) -> None:
    p = uniform_plan("tp=2,pp=2", TINY, C8, 256)
    q = uniform_plan("dp=8", TINY, C8, 256)
    path = tmp_path / "a" / "b" / "plan.json"
    p.save(str(path))
    q.save(path)
    assert load_plan(str(path)) == q
    assert os.listdir(path.parent) == ["plan.json"]


def test_save_is_atomic_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = uniform_plan("tp=2,pp=2", TINY, C8, 256)
    path = tmp_path / "plan.json"
    p.save(path)
    before = path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(plait.io.os, "replace", broken_replace)
    with pytest.raises(PlaitError) as caught:
        uniform_plan("dp=8", TINY, C8, 256).save(path)
    assert str(caught.value) == f"cannot write {str(path)!r}: disk full; choose a writable path with free space"
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["plan.json"]


def test_equality_ignores_cached_properties() -> None:
    a = uniform_plan("tp=2,pp=2", TINY, C8, 256)
    b = Plan.model_validate_json(a.to_json())
    assert a.pp == 2 and a.ranks == tuple(range(8))  # fills a's cache only
    assert a == b


def test_load_plan_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "none.json"
    expect_error(lambda: load_plan(missing), str(missing))


def test_load_plan_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"model": "x",')
    expect_error(lambda: load_plan(path), str(path), "JSON")


def test_load_plan_bad_yaml(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("model: [x\n")
    expect_error(lambda: load_plan(path), str(path), "YAML")


def test_load_plan_unknown_field(tmp_path: Path) -> None:
    raw = json.loads(uniform_plan("tp=2,pp=2", TINY, C8, 256).to_json())
    raw["pipelines"][0]["stages"][1]["strategies"][0]["experts_per_rank"] = 2
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    expect_error(lambda: load_plan(path), str(path), "pipelines.0.stages.1.strategies.0.experts_per_rank")
    raw = json.loads(uniform_plan("tp=2,pp=2", TINY, C8, 256).to_json())
    raw["micro_batch"] = 3
    path.write_text(json.dumps(raw))
    expect_error(lambda: load_plan(path), "micro_batch")


def test_load_plan_bad_values(tmp_path: Path) -> None:
    good = json.loads(uniform_plan("tp=2,pp=2", TINY, C8, 256).to_json())
    path = tmp_path / "plan.json"
    bad = json.loads(json.dumps(good))
    bad["schedule"] = "zero-bubble"
    path.write_text(json.dumps(bad))
    expect_error(lambda: load_plan(path), "schedule")
    bad = json.loads(json.dumps(good))
    bad["pipelines"][0]["stages"][0]["strategies"] = [good["pipelines"][0]["stages"][0]["strategies"][0]] * 3
    path.write_text(json.dumps(bad))
    expect_error(lambda: load_plan(path), "pipelines.0.stages.0", "3 strategies", "give 1 or 2")
    bad = json.loads(json.dumps(good))
    del bad["global_batch"]
    path.write_text(json.dumps(bad))
    expect_error(lambda: load_plan(path), "global_batch")
    path.write_text("[]")
    expect_error(lambda: load_plan(path), str(path))


# ---- property: uniform plans validate and round-trip ------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def uniform_cases(draw):
    nodes = draw(st.sampled_from([1, 2, 4]))
    per_node = draw(st.sampled_from([1, 2, 4, 8]))
    world = nodes * per_node
    tp = draw(st.sampled_from(divisors(world)))
    pp = draw(st.sampled_from(divisors(world // tp)))
    dp = world // tp // pp
    head_dim = draw(st.sampled_from([8, 16]))
    heads = tp * draw(st.integers(1, 3))
    layers = pp * draw(st.integers(1, 3)) + draw(st.integers(0, pp - 1))
    vpp = draw(st.integers(1, max(1, layers // pp))) if pp > 1 else 1  # chunks interleave over stages
    mbs = draw(st.integers(1, 3))
    micro = (pp if vpp > 1 else 1) * draw(st.integers(1, 4))
    sp = tp > 1 and draw(st.booleans())
    zero = draw(st.integers(0, 3))
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    family = draw(st.sampled_from(["gpt", "llama"]))
    spec = f"{family}:layers={layers},hidden={heads * head_dim},heads={heads},vocab=128"
    text = (f"tp={tp},pp={pp},dp={dp},mbs={mbs},gbs={mbs * dp * micro},vpp={vpp},sp={int(sp)},"
            f"zero={zero},recompute={recompute}")
    return f"{nodes}x{per_node}xA100-40GB", spec, text, (tp, pp, dp, vpp, mbs, micro)


@given(uniform_cases())
@settings(max_examples=60, deadline=None)
def test_uniform_plan_property(case) -> None:
    cluster_ref, spec, text, (tp, pp, dp, vpp, mbs, micro) = case
    cluster, model = load_cluster(cluster_ref), parse_inline(spec)
    p = uniform_plan(text, model, cluster, seq_len=64)
    validate_plan(p, model, cluster)
    pipe = p.pipelines[0]
    assert len(pipe.stages) == pp * vpp and p.pp == pp and p.chunks == vpp
    assert pipe.micro_batches == micro and pipe.micro_batch_sequences == mbs * dp
    assert p.ranks == tuple(range(cluster.world_size))
    assert [s.layers[0] for s in pipe.stages[1:]] == [s.layers[1] for s in pipe.stages[:-1]]
    assert pipe.stages[-1].layers[1] == model.layers
    for j, stage in enumerate(pipe.stages):
        assert stage.ranks == pipe.stages[j % pp].ranks
        assert stage.strategies[0].devices == len(stage.ranks) == tp * dp
    back = Plan.model_validate_json(p.to_json())
    assert back == p
    validate_plan(back, model, cluster)


def test_vpp_without_a_pipeline_is_refused() -> None:
    expect_error(lambda: uniform_plan("dp=8,vpp=2", TINY, C8, 256), "chunks=2 (vpp)", "pp=1", "set vpp=1")


def test_repeated_strategy_key_is_refused() -> None:
    expect_error(lambda: uniform_plan("dp=8,dp=4", TINY, C8, 256), "dp is given twice (dp=8 and dp=4)")


def test_micro_batches_are_capped() -> None:
    expect_error(lambda: uniform_plan("dp=8,gbs=1000000000000000000", TINY, C8, 256),
                 "runs 125000000000000000 micro-batches over 1 stage(s)", f"at most {plan_mod.MAX_MICRO_BATCH_STAGES}")
    assert uniform_plan(f"dp=8,gbs={8 * plan_mod.MAX_MICRO_BATCH_STAGES}", TINY, C8, 256).pipelines[0].micro_batches \
        == plan_mod.MAX_MICRO_BATCH_STAGES


def test_plan_for_another_architecture_is_refused(tmp_path: Path) -> None:
    other = parse_inline("llama:layers=4,hidden=128,heads=4,vocab=256")
    assert other.layers == TINY.layers and other.fingerprint != TINY.fingerprint
    path = tmp_path / "plan.json"
    uniform_plan("dp=8", TINY, C8, 256).stamped(TINY).save(path)
    plan = load_plan(path)
    assert plan.model_fingerprint == TINY.fingerprint
    validate_plan(plan, TINY, C8)
    expect_error(lambda: validate_plan(plan, other, C8), f"made for {TINY.name}", "architecture differs")


# ---- known problems (xfail until fixed in src) ---------------------------------------------------------------

def test_load_plan_error_names_the_format_it_parsed(tmp_path: Path) -> None:
    path = tmp_path / "plan.txt"
    path.write_text('{"model": ')
    expect_error(lambda: load_plan(path), "JSON")


def test_saved_plan_has_normal_permissions(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    uniform_plan("dp=8", TINY, C8, 256).save(path)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


# ---- plan file versions -----------------------------------------------------------------------------

def test_version_1_plans_are_migrated_when_read(tmp_path: Path) -> None:
    plan = uniform_plan("dp=2,tp=2,mbs=2,gbs=16", PRESETS["tiny-llama"], load_cluster("1x4xA100-80GB"), 64)
    old = json.loads(plan.model_dump_json())
    old["version"] = 1
    for pipe in old["pipelines"]:
        pipe["micro_batch_size"] = pipe.pop("micro_batch_sequences")
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    read = load_plan(path)
    assert read == plan and read.version == plan_mod.PLAN_VERSION
    assert read.pipelines[0].micro_batch_sequences == 4  # mbs=2 per replica x dp=2
    assert read.pipelines[0].per_replica(read.pipelines[0].stages[0].strategies[0]) == 2


def test_newer_plans_are_refused_in_one_line(tmp_path: Path) -> None:
    plan = uniform_plan("dp=2,gbs=4", PRESETS["tiny-llama"], load_cluster("1x2xA100-80GB"), 64)
    raw = json.loads(plan.model_dump_json())
    raw["version"] = plan_mod.PLAN_VERSION + 1
    path = tmp_path / "future.json"
    path.write_text(json.dumps(raw))
    expect_error(lambda: load_plan(path), f"version {plan_mod.PLAN_VERSION + 1}", "upgrade plait")


def test_version_2_plans_read_with_default_expert_degrees(tmp_path: Path) -> None:
    plan = uniform_plan("tp=2,pp=2", TINY, C8, 256)
    raw = json.loads(plan.to_json())
    raw["version"] = 2
    for stage in raw["pipelines"][0]["stages"]:
        for s in stage["strategies"]:
            del s["ep"], s["etp"]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(raw))
    read = load_plan(path)
    assert read == plan and read.version == PLAN_VERSION
    assert all(s.ep == 1 and s.expert_tp == s.tp for st in read.pipelines[0].stages for s in st.strategies)


def test_expert_degrees_in_the_shorthand() -> None:
    moe = PRESETS["deepseek-moe-16b"]
    plan = uniform_plan("tp=2,sp=1,ep=4,etp=1,gbs=64", moe, C8, 256)
    s = plan.pipelines[0].stages[0].strategies[0]
    assert (s.ep, s.expert_tp) == (4, 1) and s.short() == "dp4 tp2 sp ep4 etp1"
    t = uniform_plan("tp=2,sp=1,ep=2,gbs=64", moe, C8, 256).pipelines[0].stages[0].strategies[0]
    assert t.expert_tp == 2 and t.degrees.edp == 2  # etp defaults to tp, as in Megatron
    expect_error(lambda: uniform_plan("tp=2,sp=1,ep=3,gbs=64", moe, C8, 256), "ep*etp = 3*2")
    expect_error(lambda: uniform_plan("tp=2,sp=0,ep=2,gbs=64", moe, C8, 256), "sequence parallelism")
    expect_error(lambda: uniform_plan("ep=8,etp=2,gbs=64", moe, C8, 256), "ep*etp = 8*2")


def test_version_3_plans_read_without_hsdp_and_with_the_default_reduce(tmp_path: Path) -> None:
    plan = uniform_plan("dp=8,zero=3", TINY, C8, 256)
    raw = json.loads(plan.to_json())
    raw["version"] = 3
    del raw["grad_reduce"]
    for stage in raw["pipelines"][0]["stages"]:
        for s in stage["strategies"]:
            del s["shard"], s["swap"], s["offload"]
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(raw))
    read = load_plan(path)
    assert read == plan and read.version == PLAN_VERSION
    assert read.grad_reduce == "auto" and read.pipelines[0].stages[0].strategies[0].shard == 0


def test_hsdp_and_reduce_precision_in_the_shorthand() -> None:
    plan = uniform_plan("dp=8,zero=3,shard=4,grad_reduce=bf16", TINY, C8, 256)
    s = plan.pipelines[0].stages[0].strategies[0]
    assert s.shard == 4 and plan.grad_reduce == "bf16" and "shard4" in s.short()
    expect_error(lambda: uniform_plan("dp=8,zero=3,shard=3", TINY, C8, 256), "shard=3", "divide")
    expect_error(lambda: uniform_plan("dp=8,shard=4", TINY, C8, 256), "shard=4", "zero")
    expect_error(lambda: uniform_plan("dp=8,zero=3,grad_reduce=fp8", TINY, C8, 256), "grad_reduce", "fp32 or bf16")
