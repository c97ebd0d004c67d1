"""Several pipeline schedule runs a step (`Plan.schedule_runs`, NeMo AutoModel's gradient accumulation under
pipeline parallelism: one `schedule.step()` per accumulation step): the runtime calls the schedule once per
run and trains to the single-process losses; the cost model pays each run's fill and drain."""

from __future__ import annotations

import pytest
from test_runtime import STEPS, _losses, reference_losses, text, train_together  # noqa: F401

from plait.cost.pipeline import StageTimes, repeat_runs, simulate_pipeline
from plait.errors import PlaitError
from plait.plan import uniform_plan
from plait.spec.cluster import local_ranks
from plait.spec.model import load_model

RUNS = {  # torch's 1F1B, torch's interleaved 1F1B, plait's own schedule (2 micro-batches a run < 4 stages)
    "pp2 dp2 runs2": ("tiny-llama", "pp=2,dp=2,mbs=1,gbs=8,schedule_runs=2"),
    "pp2 vpp2 dp2 runs2": ("tiny-gpt", "pp=2,vpp=2,dp=2,mbs=1,gbs=8,schedule_runs=2"),
    "pp4 runs2 short": ("tiny-llama", "pp=4,mbs=1,gbs=4,schedule_runs=2"),
}


def test_runs_pay_their_own_fill_and_drain() -> None:
    """Two runs of 1F1B over 4 identical stages of 1 s forward, 2 s backward, 4 micro-batches each: one
    run takes (m + p - 1)(f + b) = 21 s, two back to back 42 s, against 33 s for one run of 8."""
    stages = [StageTimes(1.0, 2.0)] * 4
    one = simulate_pipeline(stages, 4, "1f1b")
    two = repeat_runs(one, 2)
    assert one.makespan_s == pytest.approx(21.0)
    assert two.makespan_s == pytest.approx(42.0)
    assert simulate_pipeline(stages, 8, "1f1b").makespan_s == pytest.approx(33.0)
    assert two.busy_s == pytest.approx((24.0,) * 4)
    assert two.last_backward_end_s[0] == pytest.approx(42.0)


def test_recorded_runs_number_their_micro_batches_on() -> None:
    one = simulate_pipeline([StageTimes(1.0, 2.0)] * 2, 2, "1f1b", record=True)
    ops = repeat_runs(one, 3).ops
    assert len(ops) == 3 * len(one.ops)
    assert sorted({o.micro_batch for o in ops}) == [0, 1, 2, 3, 4, 5]


def test_simulated_step_prices_the_runs() -> None:
    """The plan knob reaches the report: 4 runs of 8 micro-batches take 4 times one run of 8 (same stage
    costs), longer than one schedule of 32."""
    from plait.simulate import simulate
    from plait.spec.cluster import dgx

    model, cluster = load_model("llama2-7b"), dgx(2, 8, "H100-80GB")
    base = "tp=2,pp=4,dp=2,mbs=1,vpp=2"
    one = simulate(uniform_plan(base + ",gbs=64", model, cluster, 4096), model, cluster)
    quarter = simulate(uniform_plan(base + ",gbs=16", model, cluster, 4096), model, cluster)
    four = simulate(uniform_plan(base + ",gbs=64,schedule_runs=4", model, cluster, 4096), model, cluster)
    assert four.pipelines[0].makespan_s == pytest.approx(4 * quarter.pipelines[0].makespan_s, rel=1e-12)
    assert four.iteration_time_s > one.iteration_time_s
    assert four.peak_memory_gib <= one.peak_memory_gib


def test_runs_must_split_the_micro_batches() -> None:
    with pytest.raises(PlaitError, match="schedule_runs=3"):
        uniform_plan("pp=2,mbs=1,gbs=8,schedule_runs=3", load_model("tiny-llama"), local_ranks(2), 64)


def test_schedule_runs_match_single_process(tmp_path_factory, text) -> None:  # noqa: F811
    ref = reference_losses(tmp_path_factory.mktemp("one"), text,
                           [("tiny-llama", 8), ("tiny-gpt", 8), ("tiny-llama", 4)])
    runs = train_together(tmp_path_factory.mktemp("runs"), text, 4, RUNS)
    for key, (model, strategy) in RUNS.items():
        gbs = int(strategy.rsplit("gbs=", 1)[1].split(",")[0])
        assert _losses(runs, key) == pytest.approx(ref[(model, gbs)], abs=1e-5), key
