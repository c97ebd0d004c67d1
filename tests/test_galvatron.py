"""Tests for plait.galvatron: Galvatron strategy files <-> Plans, Galvatron profiles -> Calibration.

Fixtures under tests/data/galvatron are Galvatron 2.4.0's own shipped files (see the README there).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.cost.calibration import Calibration, calibration_for
from plait.cost.comm import SINGLE
from plait.cost.layer import BlockContext, block_time
from plait.cost.precision import PRECISIONS
from plait.cost.price import price
from plait.errors import PlaitError
from plait.galvatron import (
    GalvatronVocabWarning,
    expressible,
    explain_calibration,
    galvatron_config,
    galvatron_limits,
    galvatron_problem,
    launch_flags,
    layer_types,
    load_galvatron_config,
    load_galvatron_profiles,
    save_galvatron_config,
    strategy_problem,
    to_calibration,
)
from plait.plan import Pipeline, Plan, Stage, Strategy, uniform_plan
from plait.planner.engine import DEFAULT_LIMITS, search
from plait.planner.space import HIERARCHY, block_strategies
from plait.spec.cluster import load_cluster
from plait.spec.model import PRESETS, ModelSpec, parse_inline

DATA = Path(__file__).parent / "data" / "galvatron"
CONFIGS = DATA / "configs"
GPT27_1NODE = CONFIGS / "galvatron_config_gpt-2.7b_1nodes_8gpus_per_node_40GB_bf16_example.json"
LLAMA_3D = CONFIGS / "galvatron_config_llama-7b_2nodes_8gpus_per_node_40GB_bf16_3D_example.json"
LLAMA_TPCONSEC_OFF = CONFIGS / "galvatron_config_hidden4096_head32_1nodes_8gpus_per_node_36GB_bf16_[tpconsec_off].json"
T5_3B_CONFIG = CONFIGS / "galvatron_config_t5-3B_1nodes_8gpus_per_node_34GB_bf16_[tpconsec_off].json"
HARDWARE = DATA / "hardware_configs"
GPT_PROFILE = "bf16_hidden4096_head32_seqlen2048"

ONE_NODE = load_cluster("1x8xA100-80GB")
TWO_NODES = load_cluster("2x8xA100-80GB")
GPT27 = PRESETS["gpt3-2.7b"]  # Galvatron's gpt-2.7b: 32 layers, hidden 2560, 32 heads
LLAMA7 = PRESETS["llama2-7b"]  # Galvatron's llama-7b: 32 layers, hidden 4096, 32 heads
GPT67 = PRESETS["gpt3-6.7b"]  # hidden 4096, 32 heads: the shape of gpt_hf's hidden4096_head32 profiles
SMALL = parse_inline("gpt:layers=8,hidden=256,heads=8,vocab=512,seq=1024")
A100 = calibration_for("A100-80GB")
T5_SMALL = parse_inline("t5:encoder_layers=4,decoder_layers=4,hidden=256,heads=4,vocab=1000")
T5_3B = parse_inline("t5:encoder_layers=24,decoder_layers=24,hidden=1024,heads=32,head_dim=128,ffn=16384,vocab=32128")
"""Galvatron's t5-3B (models/T5/meta_configs/t5-3B.json): d_model 1024, 32 heads of d_kv 128, d_ff 16384."""


def expect_error(fn, *needles: str) -> PlaitError:
    """Call fn, require a one-line PlaitError whose message contains every needle."""
    with pytest.raises(PlaitError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return info.value


def load_quiet(path, model, cluster, seq_len=2048, **kw) -> Plan:
    """load_galvatron_config, ignoring the vocabulary-layout warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GalvatronVocabWarning)
        return load_galvatron_config(path, model, cluster, seq_len, **kw)


def write_config(tmp_path: Path, layers: int = 8, name: str = "galvatron_config_test.json", **fields) -> Path:
    """A Galvatron strategy file in Galvatron's own format (as SearchEngine.save_results writes it)."""
    cfg = {
        "pp_deg": 1,
        "tp_sizes_enc": ",".join(["1"] * layers),
        "tp_consecutive_flags": ",".join(["1"] * layers),
        "dp_types_enc": ",".join(["0"] * layers),
        "use_sp": ",".join(["0"] * layers),
        "checkpoint": ",".join(["0"] * layers),
        "global_bsz": 64,
        "chunks": 4,
        "pp_division": str(layers),
        "pipeline_type": "pipedream_flush",
        "default_dp_type": "zero2",
        "vtp": 1,
        "vsp": 0,
        "embed_sdp": 0,
    }
    for key, value in fields.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = tmp_path / name
    path.write_text(json.dumps(cfg, indent=4))
    return path


def runs(stage: Stage) -> list[tuple[str, int]]:
    return [(s.short(), n) for s, n in stage.layer_strategies()]


# ==== loading Galvatron's shipped strategy files ==================================================

def test_shipped_gpt_config_with_per_layer_tp_and_sdp():
    with pytest.warns(GalvatronVocabWarning, match="embedding and LM head"):
        plan = load_galvatron_config(GPT27_1NODE, GPT27, ONE_NODE, 2048)
    assert plan.schedule == "1f1b" and plan.chunks == 1 and plan.precision == "bf16"
    assert plan.global_batch == 64 and plan.seq_len == 2048 and plan.model == GPT27.name
    (pipe,) = plan.pipelines
    assert (pipe.micro_batches, pipe.micro_batch_sequences) == (4, 16)
    first, second = pipe.stages
    assert (first.layers, first.ranks) == ((0, 16), (0, 1, 2, 3))
    assert (second.layers, second.ranks) == ((16, 32), (4, 5, 6, 7))
    # tp_sizes_enc 2x9,1x7 | 2x10,1x6; dp_types_enc all 1 = ZeRO-3; checkpoint all 0.
    assert runs(first) == [("dp2 tp2 zero3", 9), ("dp4 tp1 zero3", 7)]
    assert runs(second) == [("dp2 tp2 zero3", 10), ("dp4 tp1 zero3", 6)]


def test_shipped_llama_config_with_per_layer_recompute_and_dp_types():
    plan = load_quiet(LLAMA_TPCONSEC_OFF, LLAMA7, ONE_NODE, 4096)
    (stage,) = plan.pipelines[0].stages
    assert stage.ranks == tuple(range(8)) and stage.layers == (0, 32)
    # dp_types_enc 1x26,0x3,1x3 with default zero2; checkpoint 1x29,0x3.
    assert runs(stage) == [("dp8 tp1 zero3 rc=full", 26), ("dp8 tp1 zero2 rc=full", 3), ("dp8 tp1 zero3", 3)]
    assert (plan.pipelines[0].micro_batches, plan.pipelines[0].micro_batch_sequences) == (8, 8)


def test_shipped_3d_config_on_two_nodes():
    plan = load_quiet(LLAMA_3D, LLAMA7, TWO_NODES, 4096)
    first, second = plan.pipelines[0].stages
    assert first.ranks == tuple(range(8)) and second.ranks == tuple(range(8, 16))
    assert first.strategies == second.strategies == (Strategy(dp=4, tp=2, zero=2),)
    assert (plan.pipelines[0].micro_batches, plan.pipelines[0].micro_batch_sequences) == (32, 8)


def test_vocab_layout_that_plait_cannot_express_warns_or_raises():
    # The 3D example has tp=2 blocks but (no vtp key) a vocabulary TP degree of 1.
    with pytest.warns(GalvatronVocabWarning, match="tp1 cp1 zero2"):
        load_galvatron_config(LLAMA_3D, LLAMA7, TWO_NODES, 4096)
    expect_error(lambda: load_galvatron_config(LLAMA_3D, LLAMA7, TWO_NODES, 4096, strict_vocab=True),
                 "embedding and LM head", "first block has tp2", "strict_vocab")


def test_matching_vocab_layout_loads_silently(tmp_path):
    path = write_config(tmp_path, tp_sizes_enc=",".join(["2"] * 8), vtp=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = load_galvatron_config(path, SMALL, ONE_NODE, 1024, strict_vocab=True)
    assert plan.pipelines[0].stages[0].strategies == (Strategy(dp=4, tp=2, zero=2),)


def test_precision_from_the_file_name_or_argument(tmp_path):
    assert load_quiet(LLAMA_3D, LLAMA7, TWO_NODES).precision == "bf16"
    fp16 = write_config(tmp_path, name="galvatron_config_x_1nodes_8gpus_per_node_40GB_fp16.json")
    assert load_quiet(fp16, SMALL, ONE_NODE, 1024).precision == "fp16"
    assert load_quiet(fp16, SMALL, ONE_NODE, 1024, precision="fp32").precision == "fp32"
    plain = write_config(tmp_path)
    assert load_quiet(plain, SMALL, ONE_NODE, 1024).precision == "bf16"
    expect_error(lambda: load_quiet(plain, SMALL, ONE_NODE, 1024, precision="int8"), "bf16, fp16 or fp32")


def test_sequence_parallel_launch_flag_sets_sp_on_tp_blocks(tmp_path):
    path = write_config(tmp_path, tp_sizes_enc="2,2,2,2,1,1,1,1")
    plan = load_quiet(path, SMALL, ONE_NODE, 1024, sequence_parallel=True)
    strategies = plan.pipelines[0].stages[0].strategies
    assert [s.sp for s in strategies] == [True] * 4 + [False] * 4


def test_use_sp_is_ulysses_sequence_parallelism(tmp_path):
    path = write_config(tmp_path, tp_sizes_enc="4,4,4,4,2,2,2,2", use_sp="1,1,1,1,0,0,0,0", vtp=4, vsp=1)
    plan = load_quiet(path, SMALL, ONE_NODE, 1024)
    stage = plan.pipelines[0].stages[0]
    assert stage.strategy(0) == Strategy(dp=2, tp=1, cp=4, cp_mode="ulysses", zero=2)
    assert stage.strategy(7) == Strategy(dp=4, tp=2, cp=1, zero=2)


def test_non_consecutive_tp_cannot_be_expressed(tmp_path):
    path = write_config(tmp_path, tp_sizes_enc="2,2,2,2,2,2,2,2", tp_consecutive_flags="1,1,1,0,1,1,1,1")
    expect_error(lambda: load_quiet(path, SMALL, ONE_NODE, 1024), "layer 3", "non-consecutive tensor-parallel",
                 "tp-fastest")
    ulysses = write_config(tmp_path, tp_sizes_enc="2,2,2,2,2,2,2,2", use_sp="1,1,1,1,1,1,1,1",
                           tp_consecutive_flags="0,1,1,1,1,1,1,1")
    expect_error(lambda: load_quiet(ulysses, SMALL, ONE_NODE, 1024), "layer 0", "sequence-parallel")


def test_consecutive_flag_is_irrelevant_without_data_or_tensor_parallel_split(tmp_path):
    # tp=1 (no TP group) and tp=8 (no DP group) order the ranks the same either way.
    path = write_config(tmp_path, tp_sizes_enc="1,1,1,1,8,8,8,8", tp_consecutive_flags="0,0,0,0,0,0,0,0",
                        global_bsz=64, chunks=8)
    plan = load_quiet(path, SMALL, ONE_NODE, 1024)
    assert [s.tp for s in plan.pipelines[0].stages[0].strategies] == [1] * 4 + [8] * 4


def test_missing_optional_keys_take_galvatron_defaults(tmp_path):
    # Galvatron's runtime defaults: even pp_division with the rest on the last stage, pipeline_type gpipe,
    # default_dp_type ddp, no checkpointing, no use_sp, consecutive TP, vtp 1.
    path = write_config(tmp_path, layers=8, pp_deg=4, pp_division=None, pipeline_type=None,
                        default_dp_type=None, checkpoint=None, use_sp=None, tp_consecutive_flags=None,
                        vtp=None, vsp=None, embed_sdp=None, chunks=8)
    plan = load_quiet(path, SMALL, ONE_NODE, 1024)
    assert plan.schedule == "gpipe"
    stages = plan.pipelines[0].stages
    assert [s.layers for s in stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.ranks for s in stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(s.strategies == (Strategy(dp=2),) for s in stages)
    uneven = write_config(tmp_path, layers=10, pp_deg=4, pp_division=None, chunks=8)
    model10 = parse_inline("gpt:layers=10,hidden=256,heads=8,vocab=512,seq=1024")
    assert [s.num_layers for s in load_quiet(uneven, model10, ONE_NODE, 1024).pipelines[0].stages] == [2, 2, 2, 4]


@pytest.mark.parametrize("fields, needles", [
    ({"tp_sizes_enc": "1,1,1"}, ["tp_sizes_enc has 3 entries", "8 layers"]),
    ({"pp_deg": 3}, ["pp_deg=3", "8 devices"]),
    ({"pp_deg": 2, "pp_division": "3,4"}, ["pp_division [3, 4]", "adding up to 8"]),
    ({"global_bsz": 1024, "chunks": 41}, ["global_bsz=1024", "chunks=41"]),  # Galvatron's swin-huge config
    ({"default_dp_type": "zero1"}, ["default_dp_type", "'zero1'"]),
    ({"pipeline_type": "1f1b"}, ["pipeline_type", "pipedream_flush or gpipe"]),
    ({"tp_sizes_enc": "3,1,1,1,1,1,1,1"}, ["layer 0", "tp_size 3"]),
    ({"dp_types_enc": "0,0,2,0,0,0,0,0"}, ["dp_types_enc", "0 or 1"]),
    ({"checkpoint": "0,x,0,0,0,0,0,0"}, ["checkpoint", "comma-separated integers"]),
    ({"pp_deg": None}, ["no 'pp_deg'"]),
    ({"global_bsz": "64"}, ["global_bsz must be an integer"]),
    ({"global_bsz": -4, "chunks": 2}, ["global_bsz=-4", "must be positive"]),
    ({"global_bsz": 8, "chunks": 0}, ["chunks=0", "must be positive"]),
    ({"global_bsz": 8, "chunks": 4}, ["micro-batch of 2", "dp=8"]),  # validate_plan
])
def test_bad_strategy_files_give_one_line_errors(tmp_path, fields, needles):
    path = write_config(tmp_path, **fields)
    expect_error(lambda: load_quiet(path, SMALL, ONE_NODE, 1024), *needles)


def test_unreadable_strategy_files(tmp_path):
    expect_error(lambda: load_quiet(tmp_path / "absent.json", SMALL, ONE_NODE, 1024), "cannot read")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    expect_error(lambda: load_quiet(bad, SMALL, ONE_NODE, 1024), "not valid JSON")
    bad.write_text("[1, 2]")
    expect_error(lambda: load_quiet(bad, SMALL, ONE_NODE, 1024), "not a JSON object")


def test_strategy_searched_for_another_cluster(tmp_path):
    # Galvatron files do not name their cluster: the two-node 3D example also loads on one node (4 devices
    # per stage, dp=2), and is refused where pp_deg does not divide the devices.
    plan = load_quiet(LLAMA_3D, LLAMA7, ONE_NODE, 4096)
    assert [s.ranks for s in plan.pipelines[0].stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    expect_error(lambda: load_quiet(LLAMA_3D, LLAMA7, load_cluster("1x1xA100-80GB"), 4096), "pp_deg=2")


# ==== saving ======================================================================================

@pytest.mark.parametrize("path, model, cluster", [
    (GPT27_1NODE, GPT27, ONE_NODE),
    (LLAMA_TPCONSEC_OFF, LLAMA7, ONE_NODE),
    (LLAMA_3D, LLAMA7, TWO_NODES),
    (T5_3B_CONFIG, T5_3B, ONE_NODE),
])
def test_shipped_configs_round_trip(tmp_path, path, model, cluster):
    plan = load_quiet(path, model, cluster)
    out = tmp_path / path.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GalvatronVocabWarning)
        save_galvatron_config(plan, model, out)
    assert load_quiet(out, model, cluster) == plan
    ours, theirs = json.loads(out.read_text()), json.loads(path.read_text())
    for key in ("pp_deg", "tp_sizes_enc", "tp_consecutive_flags", "checkpoint", "global_bsz", "chunks",
                "pp_division", "pipeline_type"):
        assert ours[key] == theirs.get(key, ours[key]), key


def test_saved_file_has_galvatrons_keys_order_and_encoding(tmp_path):
    plan = uniform_plan("tp=2,pp=2,dp=2,mbs=2,gbs=32,recompute=full,zero=2", SMALL, ONE_NODE, 1024)
    out = tmp_path / "galvatron_config.json"
    save_galvatron_config(plan, SMALL, out)
    text = out.read_text()
    assert text == json.dumps(json.loads(text), indent=4)  # Galvatron's write_json_config
    cfg = json.loads(text)
    assert list(cfg) == ["pp_deg", "tp_sizes_enc", "tp_consecutive_flags", "dp_types_enc", "use_sp", "checkpoint",
                         "global_bsz", "chunks", "pp_division", "pipeline_type", "default_dp_type", "vtp", "vsp",
                         "embed_sdp"]
    assert cfg == {
        "pp_deg": 2, "tp_sizes_enc": "2,2,2,2,2,2,2,2", "tp_consecutive_flags": "1,1,1,1,1,1,1,1",
        "dp_types_enc": "0,0,0,0,0,0,0,0", "use_sp": "0,0,0,0,0,0,0,0", "checkpoint": "1,1,1,1,1,1,1,1",
        "global_bsz": 32, "chunks": 8, "pp_division": "4,4", "pipeline_type": "pipedream_flush",
        "default_dp_type": "zero2", "vtp": 2, "vsp": 0, "embed_sdp": 0,
    }
    assert load_galvatron_config(out, SMALL, ONE_NODE, 1024) == plan


@pytest.mark.parametrize("text", [
    "tp=1,pp=1,dp=8,mbs=1,gbs=64",
    "tp=4,pp=2,dp=1,mbs=4,gbs=32,zero=3,recompute=full,schedule=gpipe",
    "tp=1,cp=4,pp=1,dp=2,mbs=1,gbs=16,zero=2",
])
def test_uniform_plans_round_trip(tmp_path, text):
    plan = uniform_plan(text, SMALL, ONE_NODE, 1024)
    out = tmp_path / "g.json"
    save_galvatron_config(plan, SMALL, out)
    assert load_galvatron_config(out, SMALL, ONE_NODE, 1024) == plan


def _plans(draw) -> tuple[Plan, object]:
    cluster = draw(st.sampled_from([ONE_NODE, TWO_NODES]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4, 8) if p <= SMALL.layers]))
    per = cluster.world_size // pp
    cuts = sorted(draw(st.sets(st.integers(1, SMALL.layers - 1), min_size=pp - 1, max_size=pp - 1)))
    bounds = [0, *cuts, SMALL.layers]
    zeros = draw(st.sampled_from([(0, 3), (2, 3)]))
    degrees = [d for d in (1, 2, 4, 8) if per % d == 0 and d <= SMALL.heads]
    layer = st.builds(lambda d, ulysses, zero, rc: Strategy(  # no replica (dp x cp = 1): the default shards nothing
        dp=per // d, tp=1 if ulysses and d > 1 else d, cp=d if ulysses and d > 1 else 1,
        zero=0 if zero == 2 and per // d * (d if ulysses else 1) == 1 else zero, recompute=rc),
        st.sampled_from(degrees), st.booleans(), st.sampled_from(zeros), st.sampled_from(["none", "full"]))
    stages = []
    for k in range(pp):
        own = tuple(draw(st.lists(layer, min_size=bounds[k + 1] - bounds[k], max_size=bounds[k + 1] - bounds[k])))
        stages.append(Stage(layers=(bounds[k], bounds[k + 1]), ranks=tuple(range(k * per, (k + 1) * per)),
                            strategies=own[:1] if len(set(own)) == 1 else own))
    mbs = per * draw(st.integers(1, 2))
    m = draw(st.integers(1, 8))
    plan = Plan(model=SMALL.name, seq_len=1024, global_batch=m * mbs, schedule=draw(st.sampled_from(["1f1b", "gpipe"])),
                pipelines=(Pipeline(stages=tuple(stages), micro_batches=m, micro_batch_sequences=mbs),))
    return plan.model_copy(update={"p2p": plan.runtime_p2p()}), cluster  # a config read back is priced so


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_representable_plans_round_trip(tmp_path_factory, data):
    plan, cluster = _plans(data.draw)
    out = tmp_path_factory.mktemp("rt") / "g.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GalvatronVocabWarning)
        save_galvatron_config(plan, SMALL, out)
        assert load_galvatron_config(out, SMALL, cluster, 1024) == plan


def _two_pipelines() -> Plan:
    stage = Stage(layers=(0, 8), ranks=(0, 1, 2, 3), strategies=(Strategy(dp=4),))
    other = Stage(layers=(0, 8), ranks=(4, 5, 6, 7), strategies=(Strategy(dp=4),))
    return Plan(model=SMALL.name, seq_len=1024, global_batch=16,
                pipelines=(Pipeline(stages=(stage,), micro_batches=2, micro_batch_sequences=4),
                           Pipeline(stages=(other,), micro_batches=2, micro_batch_sequences=4)))


def _one_stage(*strategies: Strategy, ranks=tuple(range(8)), **plan_fields) -> Plan:
    stage = Stage(layers=(0, 8), ranks=ranks, strategies=strategies)
    return Plan(model=SMALL.name, seq_len=1024, global_batch=16, **plan_fields,
                pipelines=(Pipeline(stages=(stage,), micro_batches=2, micro_batch_sequences=8),))


@pytest.mark.parametrize("plan, needles", [
    (_two_pipelines(), ["2 pipelines"]),
    (uniform_plan("tp=1,pp=2,dp=4,mbs=1,gbs=16,vpp=2", SMALL, ONE_NODE, 1024), ["interleaved"]),
    (_one_stage(*[Strategy(dp=4, tp=2, sp=True)] * 4, *[Strategy(dp=4, tp=2)] * 4), ["layer 4", "tp2 without",
                                                                                       "--sequence-parallel"]),
    (_one_stage(Strategy(dp=8, ep=2)), ["experts"]),
    (_one_stage(Strategy(dp=8, zero=3, shard=4)), ["HSDP"]),
    (_one_stage(Strategy(dp=8, swap=0.5)), ["swaps activations"]),
    (_one_stage(Strategy(dp=8, zero=3, offload="optim")), ["offloads the optimizer"]),
    (_one_stage(Strategy(dp=8, zero=1)), ["ZeRO-1"]),
    (_one_stage(Strategy(dp=8, recompute="selective")), ["selective"]),
    (_one_stage(Strategy(dp=8, recompute="gemm_kept")), ["gemm_kept"]),
    (_one_stage(Strategy(dp=2, tp=2, cp=2)), ["cp2", "tp2"]),
    (_one_stage(Strategy(dp=4, cp=2, cp_mode="ring")), ["ring"]),
    (_one_stage(*[Strategy(dp=8, zero=0)] * 4, *[Strategy(dp=8, zero=2)] * 4), ["ZeRO-0 and ZeRO-2"]),
    (_one_stage(Strategy(dp=8), ranks=tuple(reversed(range(8)))), ["ranks 0..7 in order"]),
    (_one_stage(Strategy(dp=8), overlap_grad_reduce=False), ["overlap"]),
])
def test_plans_galvatron_cannot_represent(tmp_path, plan, needles):
    expect_error(lambda: save_galvatron_config(plan, SMALL, tmp_path / "g.json"), *needles)
    assert not (tmp_path / "g.json").exists()


def test_layers_without_replicas_fit_either_default_dp_type(tmp_path):
    plan = _one_stage(*[Strategy(dp=8, zero=2)] * 4, *[Strategy(tp=8)] * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GalvatronVocabWarning)
        assert galvatron_config(plan, SMALL)["default_dp_type"] == "zero2"
        save_galvatron_config(plan, SMALL, tmp_path / "g.json")
        assert load_galvatron_config(tmp_path / "g.json", SMALL, ONE_NODE, 1024) == plan
    expect_error(lambda: galvatron_limits(DEFAULT_LIMITS, False, "zero1"), "ddp, zero2")


def test_sequence_parallel_plans_export_with_galvatrons_launch_flag(tmp_path):
    """Megatron SP on every tensor-parallel layer is Galvatron's --sequence-parallel: the file is written, the
    flag is among the launch flags, and the file read with the flag is the plan."""
    plan = _one_stage(*[Strategy(dp=4, tp=2, sp=True)] * 4, *[Strategy(dp=8)] * 4)
    out = tmp_path / "g.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GalvatronVocabWarning)
        save_galvatron_config(plan, SMALL, out)
        assert load_galvatron_config(out, SMALL, ONE_NODE, 1024, sequence_parallel=True) == plan
        assert load_galvatron_config(out, SMALL, ONE_NODE, 1024) != plan  # without the flag: no sp
    assert launch_flags(plan) == ("--mixed_precision", "bf16", "--sequence-parallel")
    assert launch_flags(_one_stage(Strategy(dp=4, tp=2), precision="fp16")) == ("--mixed_precision", "fp16")
    first = plan.pipelines[0].stages[0].strategy(0)
    assert galvatron_problem(plan, SMALL, sequence_parallel=False) == f"layer 0 {strategy_problem(first, False)}"


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("default_dp_type, zeros", [("ddp", {0, 3}), ("zero2", {0, 2, 3})])
def test_galvatron_limits_keep_the_layer_strategies_galvatron_can_say(sequence_parallel, default_dp_type, zeros):
    limits = galvatron_limits(replace(DEFAULT_LIMITS, **HIERARCHY), sequence_parallel, default_dp_type)
    kept = block_strategies(SMALL.stack[0], ONE_NODE, 8, 8, 1024, limits)
    assert all(strategy_problem(s, sequence_parallel) is None for s in kept)
    assert {(s.tp, s.cp, s.sp) for s in kept} == {(1, 1, False), (1, 2, False), (1, 4, False), (1, 8, False),
                                                 *((tp, 1, sequence_parallel) for tp in (2, 4, 8))}
    assert {s.zero for s in kept} == zeros and {s.recompute for s in kept} == {"none", "full"}
    assert {s.zero for s in kept if s.tp == 8} == {0}  # no replica: nothing to shard
    assert {(s.swap, s.offload, s.ep) for s in kept} == {(0.0, "none", 1)}
    assert len(kept) == 3 * 2 * 2 + 3 * 2 * 2 + 2  # dp>1 layouts x zero 0/3 x recompute, + tp8 (dp 1) x recompute


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_search_restricted_to_galvatron_finds_plans_that_round_trip(tmp_path, sequence_parallel):
    """gpt3-2.7b on 8 GPUs of 20 GiB: unrestricted, the search picks an interleaved pipeline Galvatron cannot
    run; restricted, it finds a plan that Galvatron's file says exactly."""
    cluster = ONE_NODE.with_memory(20.0)
    free = search(GPT27, cluster, 2048, 32).plan
    assert free is not None and "interleaved" in (galvatron_problem(free, GPT27) or "")
    plan = search(GPT27, cluster, 2048, 32, limits=galvatron_limits(DEFAULT_LIMITS, sequence_parallel),
                  restrict=expressible(GPT27, sequence_parallel)).plan
    assert plan is not None and galvatron_problem(plan, GPT27, sequence_parallel) is None
    layers = [s for stage in plan.pipelines[0].stages for s in stage.strategies]
    assert all(s.sp == (sequence_parallel and s.tp > 1) for s in layers)
    assert not sequence_parallel or any(s.tp > 1 for s in layers)  # the flag mattered
    out = tmp_path / "g.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GalvatronVocabWarning)
        save_galvatron_config(plan, GPT27, out)
        assert load_galvatron_config(out, GPT27, cluster, 2048, sequence_parallel=sequence_parallel) == plan


def test_save_checks_the_model_and_the_vocabulary_layout(tmp_path):
    plan = _one_stage(Strategy(dp=8))
    expect_error(lambda: galvatron_config(plan, SMALL.with_(layers=12)), "covers 8 layers", "has 12")
    mixed = _one_stage(*[Strategy(dp=4, tp=2)] * 7, Strategy(dp=8))
    with pytest.warns(GalvatronVocabWarning, match="last block"):
        cfg = galvatron_config(mixed, SMALL)
    assert cfg["vtp"] == 2
    expect_error(lambda: galvatron_config(mixed, SMALL, strict_vocab=True), "last block has tp1")


# ==== profiles ====================================================================================

def test_profiles_keep_galvatrons_numbers_and_units():
    galv = load_galvatron_profiles(DATA / "gpt_hf", HARDWARE, "A100-80GB", profile=GPT_PROFILE)
    raw = json.loads((DATA / "gpt_hf" / f"computation_profiling_{GPT_PROFILE}.json").read_text())
    assert (galv.gpu_name, galv.precision, galv.hidden, galv.heads) == ("A100-80GB", "bf16", 4096, 32)
    (times,) = galv.layer_times
    assert len(times.forward_ms_per_sample) == 16
    assert times.forward_ms_per_sample[(1, 2048)] == raw["layertype_0_bsz1"]
    assert times.forward_ms_per_sample[(16, 2048)] == raw["layertype_0_bsz16"]
    assert times.other_ms_per_sample[(3, 2048)] == raw["layertype_other_0_bsz3"]
    plain, sp = galv.layer_memory
    assert not plain.sequence_parallel and sp.sequence_parallel
    assert plain.seq_len == 2048 and plain.parameter_mib == 768.859375
    assert plain.activation_mib_per_sample == {1: 272.28173828125, 2: 176.156494140625, 4: 128.0938720703125,
                                               8: 104.14166259765625}
    assert plain.checkpoint_activation_mib_per_sample == 16.0
    # One block of hidden 4096: 12 h^2 + 13 h parameters at 4 bytes; with flash attention and no parallelism
    # Korthikanti's 34 s h bytes of activations per sequence, and 2 s h under full recomputation.
    assert plain.parameter_mib == pytest.approx(GPT67.block_params * 4 / 2**20, rel=0.002)
    assert plain.activation_mib_per_sample[1] == pytest.approx(34 * 2048 * 4096 / 2**20, rel=0.05)
    assert plain.checkpoint_activation_mib_per_sample == 2 * 2048 * 4096 / 2**20
    shapes = {(h.nodes, h.gpus_per_node): h for h in galv.hardware}
    assert set(shapes) == {(1, 4), (1, 8), (2, 8)}
    assert shapes[(1, 8)].allreduce_busbw_gbps[(8, True)] == 154.203
    assert shapes[(2, 8)].allreduce_busbw_gbps[(2, False)] == 8.13007
    assert shapes[(2, 8)].p2p_busbw_gbps == {2: 7.65998, 4: 8.02132, 8: 8.76278, 16: 8.13177}
    assert shapes[(1, 8)].allreduce_ms[(8, 1024)] == 8.1409
    assert shapes[(1, 8)].all2all_ms[(2, 1)] == 0.0709
    assert shapes[(2, 8)].allreduce_ms == {}
    assert galv.overlap_coefficient == 1.125552573612729
    assert len(galv.files) == 2 + 8


def test_sequence_mode_and_static_profiles():
    seq = load_galvatron_profiles(DATA / "gpt_hf" / "computation_profiling_bf16_hidden4096_head32.json", None, "A100-80GB")
    forward = seq.layer_times[0].forward_ms_per_sample
    assert sorted(forward) == [(1, s) for s in range(4096, 65537, 4096)]
    assert forward[(1, 65536)] == 335.72465209960944
    assert seq.layer_memory == () and seq.hardware == () and seq.overlap_coefficient is None
    # Old static profile: a bare layertype_0 measured at the one batch size of its raw runs (bsz2).
    static = load_galvatron_profiles(DATA / "gpt_hf", None, "A100-80GB", profile="bf16_hidden2560_head32_seqlen2048")
    assert static.layer_times[0].forward_ms_per_sample == {(2, 2048): 2.0644979476928724}
    raw = json.loads((DATA / "gpt_hf" / "computation_profiling_bf16_hidden2560_head32_seqlen2048.json").read_text())
    assert (raw["layernum[12]_bsz2"] - raw["layernum[6]_bsz2"]) / 6 / 2 == pytest.approx(2.0644979476928724)


def test_profile_selection_errors(tmp_path):
    expect_error(lambda: load_galvatron_profiles(DATA / "gpt_hf", None, "A100-80GB"), "holds 3 computation profiles",
                 "give one file instead of the directory", "GPU:")
    empty = tmp_path / "empty"
    empty.mkdir()
    expect_error(lambda: load_galvatron_profiles(empty, None, "A100-80GB"), "holds no computation_profiling_*.json")
    with pytest.raises(PlaitError) as caught:
        load_galvatron_profiles(empty, None, "A100-80GB")
    assert "profile=" not in str(caught.value)
    expect_error(lambda: load_galvatron_profiles(DATA / "gpt_hf", None, "A100-80GB", profile="bf16_x"), "no computation")
    expect_error(lambda: load_galvatron_profiles(tmp_path / "none", None, "A100-80GB"), "does not exist")
    expect_error(lambda: load_galvatron_profiles(DATA / "llama_fa", tmp_path / "none", "A100-80GB"), "hardware")
    expect_error(lambda: load_galvatron_profiles(DATA / "llama_fa", None, ""), "GPU type")
    expect_error(lambda: load_galvatron_profiles(GPT27_1NODE, None, "A100-80GB"), "not a computation_profiling")


def test_malformed_profiles(tmp_path):
    (tmp_path / "computation_profiling_bf16_m.json").write_text(json.dumps({"layertype_0_bsz1_seq512": "fast"}))
    expect_error(lambda: load_galvatron_profiles(tmp_path, None, "A100-80GB"), "must be a number")
    (tmp_path / "computation_profiling_bf16_m.json").write_text(json.dumps({"layernum[1]_bsz1": 3.0}))
    expect_error(lambda: load_galvatron_profiles(tmp_path, None, "A100-80GB"), "no layertype")
    (tmp_path / "computation_profiling_bf16_m.json").write_text(json.dumps({"layertype_0_bsz1_seq512": 1.0}))
    (tmp_path / "memory_profiling_bf16_m.json").write_text(json.dumps({"layertype_0": {"512": {"parameter_size": 1}}}))
    expect_error(lambda: load_galvatron_profiles(tmp_path, None, "A100-80GB"), "lacks parameter_size")
    (tmp_path / "memory_profiling_bf16_m.json").unlink()
    hw = tmp_path / "hw"
    hw.mkdir()
    (hw / "overlap_coefficient.json").write_text(json.dumps({"overlap_coe": 0.8}))
    expect_error(lambda: load_galvatron_profiles(tmp_path, hw, "A100-80GB"), "below 1")


def _forward_s(cal: Calibration, model: ModelSpec, batch: int, seq: int) -> float:
    ctx = BlockContext(model, ONE_NODE, cal, PRECISIONS["bf16"], seq, batch, SINGLE, SINGLE, SINGLE)
    return block_time(ctx.model.block, Strategy(), ctx).forward


def test_calibration_from_shipped_profiles():
    galv = load_galvatron_profiles(DATA / "gpt_hf", HARDWARE, "A100-80GB", profile=GPT_PROFILE)
    cal = to_calibration(galv, GPT67, ONE_NODE, A100)
    # Only the four constants the profiles speak to change, and the memory profile's terms join.
    assert cal.memory is not None
    assert replace(cal, gemm_efficiency=A100.gemm_efficiency, nvlink_efficiency=A100.nvlink_efficiency,
                   network_efficiency=A100.network_efficiency, overlap_efficiency=A100.overlap_efficiency,
                   memory=None) == A100
    # gemm_efficiency: plait's block forward now sits in the middle of Galvatron's measured points.
    ratios = [_forward_s(cal, GPT67, b, s) / (ms * 1e-3 * b)
              for (b, s), ms in galv.layer_times[0].forward_ms_per_sample.items()]
    assert min(ratios) <= 1.0 + 1e-6 and max(ratios) >= 1.0 - 1e-6
    assert float(np.median(ratios)) == pytest.approx(1.0, abs=0.03)
    assert 0.05 < cal.gemm_efficiency < 0.95
    # nvlink_efficiency: slope of the measured 8-GPU all-reduce times (sp_time) as plait's bus bandwidth.
    sp = json.loads((HARDWARE / "sp_time_1nodes_8gpus_per_node.json").read_text())
    mib = [int(k.split("_")[3][:-2]) for k in sp if k.startswith("allreduce_size_8_")]
    ms = [v for k, v in sp.items() if k.startswith("allreduce_size_8_")]
    slope_s_per_byte = np.polyfit(np.array(mib) * 2**20, np.array(ms) * 1e-3, 1)[0]
    busbw = 2 * 7 / 8 / slope_s_per_byte
    assert cal.nvlink_efficiency == pytest.approx(busbw / 300e9, rel=1e-6)
    assert cal.nvlink_efficiency == pytest.approx(0.763, abs=0.005)
    # network_efficiency: 16-GPU all-reduce over 2 nodes / (8 GPUs x 25 GB/s NICs of a DGX A100).
    assert cal.network_efficiency == pytest.approx(44.682 / (8 * 25), rel=1e-6)
    # overlap_efficiency: 1 / Galvatron's slowdown coefficient.
    assert cal.overlap_efficiency == pytest.approx(1 / 1.125552573612729)
    notes = explain_calibration(galv, GPT67, ONE_NODE, A100)
    assert set(notes) == {"gemm_efficiency", "nvlink_efficiency", "network_efficiency", "overlap_efficiency",
                          "memory"}
    assert "sp_time" in notes["nvlink_efficiency"] and "2x8" in notes["network_efficiency"]
    # The same profile on the two-node cluster: in-node NVLink is the same node, so the same value.
    assert to_calibration(galv, GPT67, TWO_NODES, A100).nvlink_efficiency == cal.nvlink_efficiency


def test_calibration_keeps_base_where_profiles_say_nothing():
    galv = load_galvatron_profiles(DATA / "llama_fa", None, "A100-80GB")
    cal = to_calibration(galv, LLAMA7, ONE_NODE, A100)
    assert replace(cal, gemm_efficiency=A100.gemm_efficiency, memory=None) == A100
    notes = explain_calibration(galv, LLAMA7, ONE_NODE, A100)
    assert "non-positive points skipped" in notes["gemm_efficiency"]  # llama_fa has negative bsz1/4/5 times
    assert notes["overlap_efficiency"].startswith("kept")
    # 4 GPUs per node: only the size-averaged 4-GPU all-reduce exists (a lower bound), no multi-node file.
    four = load_cluster("1x4xA100-80GB")
    with_hw = load_galvatron_profiles(DATA / "llama_fa", HARDWARE, "A100-80GB")
    cal4 = to_calibration(with_hw, LLAMA7, four, A100)
    assert cal4.nvlink_efficiency == pytest.approx(158.018 / 300)
    assert cal4.network_efficiency == A100.network_efficiency
    assert "lower bound" in explain_calibration(with_hw, LLAMA7, four, A100)["nvlink_efficiency"]


def test_a_profile_is_never_applied_to_another_gpu_or_model(tmp_path):
    galv = load_galvatron_profiles(DATA / "gpt_hf", HARDWARE, "A100-80GB", profile=GPT_PROFILE)
    expect_error(lambda: to_calibration(galv, GPT67, load_cluster("1x8xH100-80GB"), A100),
                 "measured on A100-80GB", "H100-80GB")
    for name in ("A100", "a100-80gb"):  # the type without its memory size, or in another case, matches
        short = load_galvatron_profiles(DATA / "gpt_hf", HARDWARE, name, profile=GPT_PROFILE)
        assert to_calibration(short, GPT67, ONE_NODE, A100) == to_calibration(galv, GPT67, ONE_NODE, A100)
    expect_error(lambda: to_calibration(load_galvatron_profiles(DATA / "gpt_hf", HARDWARE, "A100-40GB",
                                                                profile=GPT_PROFILE), GPT67, ONE_NODE, A100),
                 "measured on A100-40GB")
    expect_error(lambda: to_calibration(galv, GPT27, ONE_NODE, A100), "hidden=4096", "hidden=2560")
    wide = GPT67.with_(ffn=8 * 4096)  # same hidden and heads, twice the MLP
    expect_error(lambda: to_calibration(galv, wide, ONE_NODE, A100), "768.9 MiB", "use the profile of this model")
    (tmp_path / "computation_profiling_bf16_t5.json").write_text(json.dumps(
        {"layertype_0_bsz1_seq512": 1.3, "layertype_1_bsz1_seq512": 2.3}))
    t5 = load_galvatron_profiles(tmp_path, None, "A100-80GB")
    expect_error(lambda: to_calibration(t5, SMALL, ONE_NODE, A100), "2 layer types")


# ==== several layer types ==========================================================================

def test_layer_types_are_the_models_kinds_in_order():
    encoder, decoder = layer_types(PRESETS["t5-11b"])
    assert [(b.kind, n) for b, n in encoder] == [("encoder", 24)]
    assert [(b.kind, n) for b, n in decoder] == [("cross_decoder", 24)]
    assert [[b.kind for b, _ in t] for t in layer_types(PRESETS["llava-llama3-8b"])] == [
        ["patch_embed"], ["vision"], ["projector"], ["decoder"]]
    assert [[b.kind for b, _ in t] for t in layer_types(PRESETS["deepseek-moe-16b"])] == [["decoder"], ["moe"]]
    (gemma,) = layer_types(PRESETS["gemma2-9b"])  # windowed and global decoder layers: one kind, two shapes
    assert sorted(n for _, n in gemma) == [21, 21] and {b.window for b, _ in gemma} == {0, 4096}
    assert layer_types(SMALL) == (((SMALL.block, SMALL.layers),),)


def test_shipped_t5_config_covers_encoder_then_decoder_layers():
    plan = load_quiet(T5_3B_CONFIG, T5_3B, ONE_NODE, 512)
    (stage,) = plan.pipelines[0].stages
    assert stage.layers == (0, 48)
    # dp_types_enc 1x22,0x7,1x19 with default zero2: encoder 0-21 zero3, 22-23 and decoder 24-28 zero2.
    assert runs(stage) == [("dp8 tp1 zero3 rc=full", 22), ("dp8 tp1 zero2 rc=full", 7),
                           ("dp8 tp1 zero3 rc=full", 19)]
    half = parse_inline("t5:encoder_layers=12,decoder_layers=12,hidden=1024,heads=32,head_dim=128,ffn=16384,vocab=32128")
    expect_error(lambda: load_quiet(T5_3B_CONFIG, half, ONE_NODE, 512), "48 entries",
                 "24 layers (12 encoder + 12 cross_decoder)")


def _t5_plan(model: ModelSpec) -> Plan:
    """Two stages cut inside the encoder, per-layer strategies that differ between encoder and decoder."""
    cut = model.kind_counts()["encoder"] // 2
    enc = Strategy(dp=2, tp=4, zero=3, recompute="full")
    dec = Strategy(dp=4, tp=2, zero=2)
    ulysses = Strategy(dp=2, cp=4, zero=2)
    second = tuple(enc if b.kind == "encoder" else dec for b in model.stack[cut:-1]) + (ulysses,)
    return Plan(model=model.name, seq_len=512, global_batch=32, schedule="gpipe",
                pipelines=(Pipeline(stages=(
                    Stage(layers=(0, cut), ranks=tuple(range(8)), strategies=(enc,)),
                    Stage(layers=(cut, model.layers), ranks=tuple(range(8, 16)), strategies=second)),
                    micro_batches=8, micro_batch_sequences=4),))


@pytest.mark.parametrize("model", [T5_SMALL, PRESETS["t5-11b"]], ids=["t5-small-inline", "t5-11b"])
def test_multi_kind_plans_round_trip(tmp_path, model):
    plan = _t5_plan(model)
    out = tmp_path / "g.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GalvatronVocabWarning)
        save_galvatron_config(plan, model, out)
        assert load_galvatron_config(out, model, TWO_NODES, 512) == plan
    cfg = json.loads(out.read_text())
    enc, dec = model.kind_counts()["encoder"], model.kind_counts()["cross_decoder"]
    assert cfg["tp_sizes_enc"] == ",".join(["4"] * enc + ["2"] * (dec - 1) + ["4"])
    assert cfg["use_sp"] == ",".join(["0"] * (enc + dec - 1) + ["1"])
    assert cfg["pp_division"] == f"{enc // 2},{enc - enc // 2 + dec}"
    expect_error(lambda: galvatron_config(plan, PRESETS["gpt3-2.7b"]), "32 layers; save it with the model")
    expect_error(lambda: galvatron_config(plan, T5_3B if model is T5_SMALL else T5_SMALL),
                 "(4 encoder + 4 cross_decoder)" if model is not T5_SMALL else "(24 encoder + 24 cross_decoder)")


def _forward_ms_per_sample(block, model: ModelSpec, efficiency: float, batch: int, seq: int) -> float:
    """plait's forward milliseconds per sequence of one layer on one GPU at a given gemm_efficiency."""
    ctx = BlockContext(model, ONE_NODE, replace(A100, gemm_efficiency=efficiency), PRECISIONS["bf16"], seq, batch,
                       SINGLE, SINGLE, SINGLE)
    return price(block, Strategy(), ctx).time.forward * 1e3 / batch


def _write_t5_profiles(directory: Path, model: ModelSpec, efficiency: float, swap: bool = False) -> None:
    """A computation and memory profile pair keyed as Galvatron's T5 files (models/T5/configs/*_t5-3B.json):
    layertype_0 = encoder, layertype_1 = decoder, times that plait's own prices give at `efficiency`
    (`swap`: each type gets the other kind's numbers)."""
    blocks = [t[0][0] for t in layer_types(model)]
    if swap:
        blocks.reverse()
    times: dict[str, float] = {}
    for bsz in (1, 2, 4, 8):
        for i, block in enumerate(blocks):
            times[f"layertype_{i}_bsz{bsz}_seq512"] = _forward_ms_per_sample(block, model, efficiency, bsz, 512)
        times[f"layertype_other_bsz{bsz}_seq[512,512]"] = 1.0
    times["layernum[2,2]_bsz8_seq[512,512]"] = 23.6  # raw runs, not read
    memory = {f"layertype_{i}_sp": {"512": {"parameter_size": block.params * 4 / 2**20,
                                            "tp_activation_per_bsz_dict": {"1": 52.5, "2": 28.0, "checkpoint": 1.0}}}
              for i, block in enumerate(blocks)}
    memory["other_memory_pp_off_sp"] = {"[512,512]": {"model_states": {"1": 1684.8}, "activation": {"1": 89.6}}}
    (directory / "computation_profiling_bf16_t5-small.json").write_text(json.dumps(times, indent=4))
    (directory / "memory_profiling_bf16_t5-small.json").write_text(json.dumps(memory, indent=4))


def test_two_layertype_profiles_map_to_the_models_two_kinds(tmp_path):
    _write_t5_profiles(tmp_path, T5_SMALL, efficiency=0.5)
    galv = load_galvatron_profiles(tmp_path, None, "A100-80GB")
    assert len(galv.layer_times) == 2
    assert [(m.layer_type, m.seq_len, m.sequence_parallel) for m in galv.layer_memory] == [(0, 512, True), (1, 512, True)]
    assert sorted(galv.layer_times[1].forward_ms_per_sample) == [(b, 512) for b in (1, 2, 4, 8)]
    # Each type is priced with its own kind: the fit recovers the efficiency the times were made with.
    assert to_calibration(galv, T5_SMALL, ONE_NODE, A100).gemm_efficiency == pytest.approx(0.5, rel=1e-3)
    assert "8 (layer type, batch, seq) points of 2 layer types" in explain_calibration(
        galv, T5_SMALL, ONE_NODE, A100)["gemm_efficiency"]
    # Types in the other order: the decoder's larger parameter size lands on the encoder.
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    _write_t5_profiles(swapped, T5_SMALL, efficiency=0.5, swap=True)
    expect_error(lambda: to_calibration(load_galvatron_profiles(swapped, None, "A100-80GB"), T5_SMALL, ONE_NODE, A100),
                 "layertype_0 (encoder)", "use the profile of this model")


def test_shipped_t5_profiles_calibrate_a_t5_3b():
    galv = load_galvatron_profiles(DATA / "T5", None, "A100-80GB")
    raw = json.loads((DATA / "T5" / "computation_profiling_bf16_t5-3B.json").read_text())
    assert galv.layer_times[1].forward_ms_per_sample[(8, 512)] == raw["layertype_1_bsz8_seq512"]
    assert [m.parameter_mib for m in galv.layer_memory] == [192.107421875, 258.19140625]
    cal = to_calibration(galv, T5_3B, ONE_NODE, A100)
    assert replace(cal, gemm_efficiency=A100.gemm_efficiency) == A100
    assert 0.05 < cal.gemm_efficiency < 0.95


def test_layer_type_counts_that_differ_are_refused(tmp_path):
    _write_t5_profiles(tmp_path, T5_SMALL, efficiency=0.5)
    two = load_galvatron_profiles(tmp_path, None, "A100-80GB")
    expect_error(lambda: to_calibration(two, SMALL, ONE_NODE, A100), "2 layer types", "1 layer kind (decoder)",
                 "one layer type per kind")
    expect_error(lambda: to_calibration(two, PRESETS["llava-llama3-8b"], ONE_NODE, A100),
                 "4 layer kinds (patch_embed, vision, projector, decoder)")
    one = load_galvatron_profiles(DATA / "gpt_hf", None, "A100-80GB", profile=GPT_PROFILE)
    expect_error(lambda: to_calibration(one, T5_SMALL, ONE_NODE, A100), "1 layer type but",
                 "2 layer kinds (encoder, cross_decoder)")
    # A memory profile with more types than the computation profile counts too.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "computation_profiling_bf16_t5-small.json").write_text(json.dumps({"layertype_0_bsz1_seq512": 1.0}))
    (mixed / "memory_profiling_bf16_t5-small.json").write_text((tmp_path / "memory_profiling_bf16_t5-small.json").read_text())
    expect_error(lambda: to_calibration(load_galvatron_profiles(mixed, None, "A100-80GB"), SMALL, ONE_NODE, A100),
                 "2 layer types")


def test_a_profile_named_as_galvatron_2_4_reads_it_takes_the_given_sequence_length(tmp_path):
    """Galvatron 2.4's search reads `computation_profiling_bf16_llama-7b.json` with keys that hold no sequence
    length: it is the run's (`seq_len`); without one the refusal says what is missing, words spaced."""
    raw = json.loads((DATA / "llama_fa" / f"computation_profiling_{GPT_PROFILE}.json").read_text())
    (tmp_path / "computation_profiling_bf16_llama-7b.json").write_text(json.dumps(raw))
    galv = load_galvatron_profiles(tmp_path, None, "A100-80GB", seq_len=4096)
    named = load_galvatron_profiles(DATA / "llama_fa", None, "A100-80GB")  # seqlen2048 in its file name
    want = {(b, 4096): ms for (b, _), ms in named.layer_times[0].forward_ms_per_sample.items()}
    assert galv.precision == "bf16" and len(want) > 5 and galv.layer_times[0].forward_ms_per_sample == want
    with pytest.raises(PlaitError) as refused:
        load_galvatron_profiles(tmp_path, None, "A100-80GB")
    assert "times (or the sequence length" in str(refused.value) and "times(or" not in str(refused.value)


def test_a_llama_7b_profile_is_not_applied_to_llama3_8b():
    """Same hidden size, heads and layer count; grouped-query attention and a larger ffn make llama3-8b's
    block 7.6% larger, which the parameter check sees (the profile's own model within 0.2%)."""
    galv = load_galvatron_profiles(DATA / "llama_fa", None, "A100-80GB")
    to_calibration(galv, LLAMA7, ONE_NODE, A100)
    with pytest.raises(PlaitError, match="use the profile of this model") as refused:
        to_calibration(galv, PRESETS["llama3-8b"], ONE_NODE, A100)
    assert "773.3 MiB" in str(refused.value)
