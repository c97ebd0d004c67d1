"""MoE models in plans of several pipelines: each pipeline holds whole experts per stage (ep and etp inside
a stage), so expert gradients, after their expert-data-parallel reduction inside the stage, are reduced
across pipelines like any layer's (`plait.runtime.placement.Replicas`), weighted by each pipeline's share
of the global batch; the router and its balancing loss stay per token. Such plans train to the
single-process losses (gloo, 4 ranks, one torchrun launch, fp32)."""

from __future__ import annotations

import pytest
from test_runtime import STEPS, _losses, assert_same, text, train_together  # noqa: F401 (fixture)

from plait.executable import holders, shard_shape, unsupported
from plait.plan import Pipeline, Plan, Stage, validate_plan
from plait.plan import Strategy as S
from plait.spec.cluster import local_ranks
from plait.spec.model import PRESETS

MODEL = "tiny-moe"  # layer 0 dense, layers 1-3 MoE (8 experts, top-2, shared experts)
SEQ = 64
GBS = 4


def _plan(pipes: list[tuple[list[tuple[tuple[int, int], tuple[int, ...], S]], int, int]]) -> Plan:
    """Pipelines given as (stages as (layers, ranks, strategy), micro-batches, micro-batch size)."""
    pipelines = tuple(Pipeline(stages=tuple(Stage(layers=lay, ranks=r, strategies=(s,)) for lay, r, s in st),
                               micro_batches=m, micro_batch_sequences=b) for st, m, b in pipes)
    return Plan(model=MODEL, seq_len=SEQ, global_batch=sum(p.samples for p in pipelines), precision="fp32",
                pipelines=pipelines)


CASES = {
    # whole gradients: a one-rank stage and a dp2-ep2 stage shard the MoE layers differently
    "pp2 pipeline beside a dp2-ep2 stage": _plan([
        ([((0, 2), (0,), S()), ((2, 4), (1,), S())], 2, 1), ([((0, 4), (2, 3), S(dp=2, ep=2))], 1, 2)]),
    # whole gradients: same widths and dp, different expert degrees
    "dp2-ep2 stage beside a dp2 stage": _plan([
        ([((0, 4), (0, 1), S(dp=2, ep=2))], 1, 2), ([((0, 4), (2, 3), S(dp=2))], 1, 2)]),
    # shard by shard: both pipelines hold the experts alike, batch shares 3/4 and 1/4
    "two tp2-sp-ep2 stages, micro-batches 3 and 1": _plan([
        ([((0, 4), (0, 1), S(tp=2, sp=True, ep=2, etp=1))], 3, 1),
        ([((0, 4), (2, 3), S(tp=2, sp=True, ep=2, etp=1))], 1, 1)]),
    # ZeRO inside a stage: FSDP2 units on the experts over edp, then whole gradients across pipelines
    "dp2-ep2 zero3 stage beside a pp2 pipeline": _plan([
        ([((0, 4), (0, 1), S(dp=2, ep=2, zero=3))], 1, 2), ([((0, 2), (2,), S()), ((2, 4), (3,), S())], 2, 1)]),
    # ZeRO inside a stage, shard by shard across pipelines
    "two dp2-ep2 zero2 stages": _plan([([((0, 4), r, S(dp=2, ep=2, zero=2))], 1, 2) for r in ((0, 1), (2, 3))]),
    # expert tensor parallelism inside a stage (each rank half of every expert's width), whole gradients
    "tp2-sp etp2 stage beside a pp2 pipeline": _plan([
        ([((0, 4), (0, 1), S(tp=2, sp=True, etp=2))], 2, 1), ([((0, 2), (2,), S()), ((2, 4), (3,), S())], 2, 1)]),
    # ZeRO across pipelines (a one-rank ZeRO stage) beside ZeRO inside a stage; rank 3 left out
    "one-rank zero1 stage beside a dp2-ep2 zero1 stage": _plan([
        ([((0, 4), (0,), S(zero=1))], 2, 1), ([((0, 4), (1, 2), S(dp=2, ep=2, zero=1))], 1, 2)]),
}


def _shapes(plan: Plan, layer: int) -> set[tuple]:
    return {shard_shape(st, layer) for st in holders(plan, layer)}


def test_cases_run_and_cover_both_reduction_paths() -> None:
    """Cases 1, 2, 4, 6 and 7 hold MoE layer 3 in two shapes (whole gradients), 3 and 5 in one (shard by
    shard)."""
    spec = PRESETS[MODEL]
    assert [b.kind for b in spec.stack] == ["decoder", "moe", "moe", "moe"]
    assert [len(_shapes(plan, 3)) for plan in CASES.values()] == [2, 2, 1, 2, 1, 2, 2]
    for name, plan in CASES.items():
        validate_plan(plan, spec, local_ranks(4))  # raises on an invalid plan
        assert unsupported(plan, spec) is None, name


def test_what_does_not_run_is_refused_in_one_line() -> None:
    """Every pipeline's expert degrees are checked (not only the first's)."""
    spec = PRESETS[MODEL]
    ep3 = _plan([([((0, 4), (0,), S())], 1, 1), ([((0, 4), (1, 2, 3), S(dp=3, ep=3))], 1, 3)])
    assert unsupported(ep3, spec) == ("pipeline 1 layer 1 (moe, dp3 tp1 ep3): ep=3 does not divide the 8 experts; "
                                      "pick an ep that divides them")


REFERENCE = "one process"
"""The single-process reference, run in the same launch (one launch, not two): a plan of rank 0 alone, one
micro-batch of GBS sequences (as `reference_losses`' dp=1), the other ranks idle. Measured against a
separate one-process launch: equal within 3e-7 relative."""


@pytest.fixture(scope="module")
def moe_pipe_runs(tmp_path_factory, text):  # noqa: F811
    """The reference and every case in one four-rank torchrun job."""
    alone = _plan([([((0, 4), (0,), S())], 1, GBS)])
    cases = {name: (MODEL, plan) for name, plan in {REFERENCE: alone, **CASES}.items()}
    runs = train_together(tmp_path_factory.mktemp("moe-pipes"), text, 4, cases)
    ref = _losses(runs, REFERENCE)
    assert ref[-1] < ref[0] - 0.5, "the reference must learn, or the comparison proves little"
    return ref, runs


@pytest.mark.parametrize("name", list(CASES))
def test_moe_pipelines_match_single_process(moe_pipe_runs, name) -> None:
    ref, runs = moe_pipe_runs
    losses = _losses(runs, name)  # STEPS (5) of them
    assert len(losses) == len(ref) == STEPS
    assert_same(losses, ref)


def test_simulate_prices_whole_expert_gradients_across_pipelines() -> None:
    """dp2-ep2 beside dp2: each stage reduces its layers shard by shard as beside a stage of its own shape,
    plus the whole gradients of every holder. The ep2 stage's extra is the larger: the same whole gradient
    (all 8 experts, not the 4 an ep2 rank holds) all-reduced, after gathering it over ep."""
    from plait.simulate import simulate

    def sync_s(plan: Plan) -> list[float]:  # per device group: ep2 (or first) stage, then dp2 stage
        report = simulate(plan, PRESETS[MODEL], local_ranks(4), validate=False)
        return [d.parts["dp_comm_exposed"] for d in report.devices]

    mixed = sync_s(CASES["dp2-ep2 stage beside a dp2 stage"])
    ep = sync_s(_plan([([((0, 4), r, S(dp=2, ep=2))], 1, 2) for r in ((0, 1), (2, 3))]))
    dp = sync_s(_plan([([((0, 4), r, S(dp=2))], 1, 2) for r in ((0, 1), (2, 3))]))
    assert len(mixed) == 2 and mixed[0] - ep[0] > mixed[1] - dp[1] > 0
