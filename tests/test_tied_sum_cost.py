"""The cost model prices the sum of a tied table's two copies held on one stage (time and bytes)."""

import sys

from plait.cost import comm
from plait.cost.calibration import calibration_for
from plait.cost.layer import BlockContext
from plait.cost.precision import PRECISIONS
from plait.cost.price import TIED_SUM_PASSES, tied_copies_sum, tied_gather_bytes
from plait.cost.compute import elementwise_time
from plait.executable import tied_copies
from plait.plan import Pipeline, Plan, Stage, Strategy
from plait.simulate import simulate
from plait.spec.cluster import load_cluster
from plait.spec.model import load_model

S = Strategy


def _plan(first: Strategy, last: Strategy) -> Plan:
    stage = Stage(layers=(0, 4), ranks=(0, 1), strategies=(first, S(dp=2), S(dp=2), last))
    return Plan(model="tiny-gpt", seq_len=256, global_batch=4, precision="fp32", overlap_grad_reduce=False,
                pipelines=(Pipeline(stages=(stage,), micro_batches=1, micro_batch_sequences=4),))


def _ctx(model, cluster):
    cal = calibration_for(cluster.gpu.name)
    return BlockContext(model, cluster, cal, PRECISIONS["fp32"], 256, 1, comm.SINGLE, comm.SINGLE, comm.SINGLE)


def test_one_stage_tied_sum_bytes_and_time() -> None:
    model, cluster = load_model("tiny-gpt"), load_cluster("1x2xA100-80GB")
    ctx = _ctx(model, cluster)
    table = model.vocab * model.hidden * 4  # fp32 gradient bytes
    # tp2 embedding copy: half the table comes in; dp2 ZeRO-2 head copy: half; a replicated copy: none.
    assert tied_gather_bytes(S(tp=2), S(dp=2, zero=2), ctx) == (table / 2, table / 2)
    assert tied_gather_bytes(S(tp=2), S(dp=2), ctx) == (table / 2, 0.0)
    seconds = tied_copies_sum(S(tp=2), S(dp=2), (0, 1), ctx)
    gather = comm.all_gather(table, comm.GroupShape(2, 1, 2), cluster, ctx.cal)
    local = elementwise_time(TIED_SUM_PASSES * table, cluster.gpu, ctx.cal, kernels=3)
    assert seconds == gather + local > gather > 0


def test_simulate_adds_the_tied_sum_to_the_gradient_reduction(monkeypatch) -> None:
    model, cluster = load_model("tiny-gpt"), load_cluster("1x2xA100-80GB")
    plan = _plan(S(tp=2), S(dp=2))
    assert tied_copies(plan) and not tied_copies(_plan(S(dp=2), S(dp=2)))
    priced = simulate(plan, model, cluster).breakdown["dp_comm_exposed"]
    monkeypatch.setattr(sys.modules["plait.simulate"], "tied_copies_sum", lambda *_: 0.0)
    unpriced = simulate(plan, model, cluster).breakdown["dp_comm_exposed"]
    expected = tied_copies_sum(S(tp=2), S(dp=2), (0, 1), _ctx(model, cluster))
    assert abs(priced - unpriced - expected) < 1e-12 * max(1.0, priced)
    assert expected > 1e-7
