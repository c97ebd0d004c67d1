"""Variable-length planning (FlexSP, ByteScale-style balance): costs, buckets, blaster, per-micro-batch layouts."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.errors import PlaitError
from plait.planner.varlen import (
    SequenceCost,
    balance_micro_batch,
    blast,
    buckets,
    homogeneous,
    plan_batch,
    plan_micro_batch,
    smallest_degree,
)
from plait.spec.cluster import dgx
from plait.spec.model import load_model

MODEL = load_model("llama2-7b")
CLUSTER = dgx(2, 8, "A100-80GB")
CAP = 8192


@pytest.fixture(scope="module")
def cost() -> SequenceCost:
    return SequenceCost(MODEL, CLUSTER)


@pytest.fixture(scope="module")
def ring() -> SequenceCost:
    return SequenceCost(MODEL, CLUSTER, cp_mode="ring")


def _padding(lengths, bounds):
    return sum(min(b for b in bounds if b >= n) - n for n in lengths)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=14), st.integers(1, 4))
def test_buckets_minimise_padding(lengths, count) -> None:
    got = buckets(lengths, count)
    assert sum(c for _, c in got) == len(lengths) and len(got) <= count and got[-1][0] == max(lengths)
    bounds = [b for b, _ in got]
    distinct = sorted(set(lengths))
    best = min(_padding(lengths, [*combo, max(lengths)])
               for k in range(min(count, len(distinct)))
               for combo in itertools.combinations(distinct[:-1], k))
    assert _padding(lengths, bounds) == best


def test_a_long_sequence_costs_quadratically_and_a_group_shares_it(cost) -> None:
    short, long_ = cost.seconds(4096, 1), cost.seconds(32768, 1)
    assert long_ > 8 * short * 1.3  # attention's s^2 on top of the linear part
    assert cost.seconds(32768, 8) < long_ / 4  # 8 devices on one long sequence
    assert cost.seconds(512, 8) > cost.seconds(512, 1) / 8  # short ones gain little from a group


def test_the_blaster_keeps_sorted_contiguous_chunks(cost) -> None:
    rng = random.Random(1)
    lengths = [rng.randint(100, 20000) for _ in range(60)]
    chunks = blast(lengths, 4, cost)
    assert sorted(n for c in chunks for n in c) == sorted(lengths)
    assert all(min(a) >= max(b) for a, b in itertools.pairwise(chunks))  # longest first, no overlap


def _check(mb, lengths, devices, capacity):
    assert Counter(n for g in mb.groups for n in g.lengths) == Counter(lengths)
    assert sum(g.degree for g in mb.groups) <= devices
    assert all(sum(g.lengths) <= g.degree * capacity for g in mb.groups)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flexsp_micro_batch_beats_every_homogeneous_layout(cost, seed) -> None:
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(50, 800), rng.randint(2000, 30000)]) for _ in range(40)]
    mb = plan_micro_batch(lengths, 16, cost, CAP * 4)
    assert mb is not None
    _check(mb, lengths, 16, CAP * 4)
    homo = [h.seconds for d in (1, 2, 4, 8, 16) if (h := homogeneous(lengths, d, 16, cost, CAP * 4)) is not None]
    assert mb.seconds <= min(homo) + 1e-12
    assert mb.seconds < 0.9 * max(homo)


def test_flexsp_batch_beats_static_and_full_sp(cost) -> None:
    rng = random.Random(3)
    lengths = [int(rng.lognormvariate(6.0, 1.3)) + 16 for _ in range(200)] + [30000]
    flex = plan_batch(lengths, 16, cost, CAP)
    low = plan_batch(lengths, 16, cost, CAP, "static")
    full = plan_batch(lengths, 16, cost, CAP, "static", 16)
    assert smallest_degree(30000, CAP, 16) == 4
    for p in (flex, low, full):
        for mb in p.micro_batches:
            assert all(sum(g.lengths) <= g.degree * CAP for g in mb.groups)
        assert sorted(n for mb in p.micro_batches for g in mb.groups for n in g.lengths) == sorted(lengths)
    assert flex.seconds < 0.8 * low.seconds and flex.seconds < 0.6 * full.seconds


def test_balance_scheduler_spreads_long_sequences_and_balances(ring) -> None:
    lengths = [20000, 9000, 3000, 2500, 800, 700, 100] * 2
    mb = balance_micro_batch(lengths, 16, ring, CAP)
    assert mb is not None
    assert Counter(n for g in mb.groups for n in g.lengths) == Counter(lengths)
    for g in mb.groups:  # a sequence over the capacity gets at least ceil(len / capacity) ranks
        assert g.degree >= max(-(-n // CAP) for n in g.lengths)
        assert g.degree == 1 or len(g.lengths) == 1
    plain = balance_micro_batch(lengths, 16, ring, CAP, rounds=0)
    assert {g.degree for g in plain.groups if g.degree > 1} == {2, 3}  # only the long ones, at their minimum
    assert mb.seconds <= plain.seconds


def test_balance_beats_a_static_data_x_context_mesh(ring) -> None:
    rng = random.Random(4)
    lengths = [int(rng.lognormvariate(6.0, 1.3)) + 16 for _ in range(200)] + [30000]
    balanced = plan_batch(lengths, 16, ring, CAP, "bytescale")
    static = plan_batch(lengths, 16, ring, CAP, "static")
    assert sorted(n for mb in balanced.micro_batches for g in mb.groups for n in g.lengths) == sorted(lengths)
    assert balanced.seconds < 0.8 * static.seconds


def test_too_long_is_bad_input(cost) -> None:
    with pytest.raises(PlaitError, match="tokens"):
        plan_batch([10, 16 * CAP + 1], 16, cost, CAP)
    with pytest.raises(PlaitError, match="--sp"):
        plan_batch([10, 3 * CAP], 16, cost, CAP, "static", 2)


# ---- plait varlen ---------------------------------------------------------------------------------------

@pytest.fixture
def lengths_file(tmp_path):
    rng = random.Random(5)
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(int(rng.lognormvariate(6.0, 1.3)) + 16) for _ in range(3000)) + "\n20000\n")
    return path


def _varlen(*args):
    from typer.testing import CliRunner

    from plait.cli import app

    return CliRunner().invoke(app, ["varlen", "--model", "llama2-7b", "--cluster", "2x8xA100-80GB", "--batches", "2",
                                    "--global-batch", "64", "--capacity", str(CAP), *map(str, args)])


def test_varlen_command_prints_json_and_flexsp_beats_static(lengths_file) -> None:
    import json

    res = {}
    for method in ("flexsp", "static", "bytescale"):
        out = _varlen("--lengths", lengths_file, "--method", method, "--json")
        assert out.exit_code == 0, out.output
        res[method] = json.loads(out.stdout)
        assert set(res[method]) == {"total_time_s", "solve_time_s", "states", "states_bytes_per_device", "pipeline",
                                    "per_batch"}
        assert res[method]["pipeline"] == {"stages": 1, "devices_per_stage": 16, "layers": [[0, 32]]}
        assert len(res[method]["per_batch"]) == 2
    assert res["flexsp"]["total_time_s"] <= res["static"]["total_time_s"]
    table = _varlen("--lengths", lengths_file)
    assert table.exit_code == 0 and "total planned time" in table.stdout


@pytest.mark.parametrize("args,needle", [
    (["--method", "nope"], "--method"),
    (["--method", "flexsp", "--sp", "4"], "--sp"),
    (["--method", "static", "--sp", "3"], "--sp"),
    (["--global-batch", "0"], "positive"),
    (["--states", "half"], "--states must be one of"),
    (["--offload-above", "-5"], "--offload-above is a length"),
    (["--states", "replicated", "--stages", "1"], "use --states sharded or more --stages"),  # 7B x 18 B > 80 GB
    (["--stages", "3"], "--stages must be one of 1, 2, 4, 8, 16"),
    (["--method", "static", "--sp", "16", "--stages", "2"], "--sp 16 exceeds the 8 devices of a stage"),
])
def test_varlen_bad_input(lengths_file, args, needle) -> None:
    res = _varlen("--lengths", lengths_file, *args)
    assert res.exit_code == 2 and needle in res.stderr and "Traceback" not in res.output


def test_states_are_priced_sharded_over_every_device() -> None:
    from plait.planner.varlen import states_bytes

    m = load_model("llama2-7b")
    assert states_bytes(m, 16, "bf16", "replicated") == m.params * 18  # bf16 weights, fp32 grads, Adam + master
    assert states_bytes(m, 16, "bf16", "sharded") == m.params * 16 / 16  # ZeRO-3: the master copy is the weights
    assert states_bytes(m, 4, "fp32", "sharded") == m.params * 16 / 4


def test_offloaded_sequences_are_priced_with_their_host_copies() -> None:
    from plait.planner.varlen import SequenceCost

    m, c = load_model("llama2-7b"), dgx(1, 8, "A100-80GB")
    plain, offload = SequenceCost(m, c), SequenceCost(m, c, offload_above=8192)
    assert offload.seconds(4096, 1) == plain.seconds(4096, 1)  # shorter than the threshold: kept on the device
    assert offload.seconds(8192, 2) > plain.seconds(8192, 2)  # swapped out and back beside the compute


def test_varlen_bad_lengths_file(tmp_path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nabc\n")
    res = _varlen("--lengths", bad)
    assert res.exit_code == 2 and "line 2" in res.stderr
    res = _varlen("--lengths", tmp_path / "missing.txt")
    assert res.exit_code == 2 and "cannot read" in res.stderr


def test_pipeline_of_variable_micro_batches_adds_the_longest_per_extra_stage() -> None:
    from plait.planner.varlen import BatchPlan, Group, MicroBatch, pipeline_seconds

    assert pipeline_seconds([1.0, 3.0, 2.0], 1) == 6.0
    assert pipeline_seconds([1.0, 3.0, 2.0], 4) == 6.0 + 3 * 3.0  # fill and drain: the longest, per extra stage
    mbs = [MicroBatch((Group(1, (n,), t, (0,)),)) for n, t in ((100, 0.5), (900, 2.0))]
    assert BatchPlan(mbs, stages=2).seconds == 4.5 and BatchPlan(mbs, stages=2).bubble_s == 2.0


def test_stages_price_the_slowest_stage_and_plans_use_a_stage_s_devices() -> None:
    from plait.planner.varlen import stage_layers

    whole, halves = SequenceCost(MODEL, CLUSTER), SequenceCost(MODEL, CLUSTER, stages=2)
    assert halves.cuts == stage_layers(32, 2) == [(0, 16), (16, 32)]
    for n in (512, 8192):  # half the layers each, plus the head's stage's logits and the hand-over
        assert whole.seconds(n, 1) / 2 < halves.seconds(n, 1) < whole.seconds(n, 1)
    lengths = [8000, 6000, 3000, 2000, 900, 500, 300, 100] * 4
    plan = plan_batch(lengths, 16, halves, CAP)
    assert plan.stages == 2 and max(r for mb in plan.micro_batches for g in mb.groups for r in g.ranks) < 8
    stage_s = [mb.seconds for mb in plan.micro_batches]
    assert plan.seconds == pytest.approx(sum(stage_s) + max(stage_s))


def test_the_fewest_stages_whose_states_fit_are_chosen() -> None:
    from plait.planner.varlen import fewest_stages, states_bytes

    m = load_model("llama3-8b")
    memory = 80 * 2**30
    assert states_bytes(m, 8, "bf16", "replicated", 2) == m.params * 18 / 2  # each device: half the model, whole
    assert fewest_stages(m, 8, "bf16", "replicated", memory) == 2  # 8.03B x 18 B = 134.6 GiB; halves fit
    assert fewest_stages(m, 8, "bf16", "sharded", memory) == 1
    with pytest.raises(PlaitError, match="do not fit"):
        fewest_stages(m, 8, "bf16", "replicated", 2**30)


def test_varlen_command_chooses_and_prints_the_stage_plan(lengths_file) -> None:
    import json

    from typer.testing import CliRunner

    from plait.cli import app

    args = ["varlen", "--model", "llama3-8b", "--cluster", "1x8xA100-80GB", "--batches", "2", "--global-batch", "64",
            "--capacity", "16384", "--lengths", str(lengths_file), "--states", "replicated"]
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "pipeline of 2 stages x 4 devices (layers 0-15 | 16-31)" in " ".join(table.stdout.split())
    result = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert result["pipeline"] == {"stages": 2, "devices_per_stage": 4, "layers": [[0, 16], [16, 32]]}
    assert all(0 < b["bubble_s"] < b["time_s"] for b in result["per_batch"])
