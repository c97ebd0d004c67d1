"""p2p=megatron plans run on the runtime's own schedule with blocking exchanges
(`plait.runtime.pipeline_uneven`) and, between tensor-parallel stages without sequence parallelism,
Megatron-LM's scatter/gather (`plait.runtime.boundary.Boundary.split`). Each trains to the single-process
losses (gloo, 4 ranks, one torchrun launch, fp32, 3 steps); each sender's bytes are what the cost model
prices."""

from __future__ import annotations

import pytest
from test_runtime import assert_same, reference_losses, text, train_together  # noqa: F401
from test_runtime_widths_pipes import GBS, SEQ, STEPS, Stages, _pipe

from plait.executable import unsupported
from plait.plan import Plan, validate_plan
from plait.plan import Strategy as S
from plait.spec.cluster import local_ranks
from plait.spec.model import PRESETS


def _plan(stages: Stages, micro_batches: int, size: int, chunks: int = 1) -> Plan:
    pipe = _pipe(stages, micro_batches, size)
    return Plan(model="tiny-llama", seq_len=SEQ, global_batch=pipe.samples, precision="fp32", chunks=chunks,
                schedule="interleaved" if chunks > 1 else "1f1b", p2p="megatron", pipelines=(pipe,))


CASES = {
    "pp2 x tp2 without sp": _plan([((0, 2), (0, 1), S(tp=2)), ((2, 4), (2, 3), S(tp=2))], 2, 2),
    "pp4, 1f1b": _plan([((j, j + 1), (j,), S()) for j in range(4)], 4, 1),
    "pp2 x tp2 vpp2, interleaved": _plan([((j, j + 1), ((0, 1), (2, 3))[j % 2], S(tp=2)) for j in range(4)],
                                         2, 2, chunks=2),
}


def test_cases_are_valid_and_executable() -> None:
    for name, plan in CASES.items():
        validate_plan(plan, PRESETS[plan.model], local_ranks(4))
        assert unsupported(plan, PRESETS[plan.model]) is None, name
        assert plan.own_schedule(0), name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text):  # noqa: F811
    """The single-process reference, then every case in one four-rank torchrun job."""
    ref = reference_losses(tmp_path_factory.mktemp("reference"), text, [("tiny-llama", GBS)])
    cases = {name: (plan.model, plan) for name, plan in CASES.items()}
    proc, losses = train_together(tmp_path_factory.mktemp("megatron-p2p"), text, 4, cases,
                                  {name: {"steps": STEPS} for name in cases})
    return ref, proc, losses


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(runs, name) -> None:
    """fp32 losses within 1e-5 of one process at each of 3 steps."""
    ref, proc, losses = runs
    assert len(losses.get(name, [])) == STEPS, proc.stderr[-3000:]
    assert_same(losses[name], ref[("tiny-llama", GBS)][:STEPS])


def test_scatter_sends_the_priced_bytes(monkeypatch) -> None:
    """pp2 x tp2 without sp: each of the 2 senders sends half its [2, 64, 128] fp32 piece, 32768 bytes,
    which is `send_piece_bytes` / tp, the point-to-point term `send_time` prices with split = tp."""
    import torch
    from test_runtime_widths import _Mailbox

    from plait.cost.calibration import calibration_for
    from plait.cost.layer import BlockContext
    from plait.cost.precision import PRECISIONS
    from plait.cost.price import send_piece_bytes
    from plait.runtime import boundary as boundary_module
    from plait.runtime.boundary import boundaries
    from plait.spec.cluster import dgx

    plan = CASES["pp2 x tp2 without sp"]
    spec, pipe = PRESETS[plan.model], plan.pipelines[0]
    mail = _Mailbox()
    monkeypatch.setattr(boundary_module, "dist", mail)
    _, b = boundaries(plan, 0, 0, spec, None)
    assert b.split == 2
    x = torch.randn(b.batch, b.tokens, b.hidden)
    for mail.rank in b.senders:
        b.send(x, forward=True)
    assert mail.sent == {0: 32768, 1: 32768}
    assert {(src, dst) for src, dst, _ in mail.queues} == {(0, 2), (1, 3)}
    halves = x.reshape(-1).chunk(2)
    assert all(torch.equal(mail.queues[(p, 2 + p, 1)][0], halves[p]) for p in range(2))
    upper = pipe.stages[0].strategies[-1]
    ctx = BlockContext.for_ranks(spec, dgx(1, 8, "A100-80GB"), calibration_for("A100-80GB"),
                                 PRECISIONS["fp32"], SEQ, b.batch // upper.dp, upper, b.senders, b.senders)
    priced = send_piece_bytes(2, upper, b.batch, ctx, pipe.stages[1].strategies[0])
    assert priced / b.split == 32768
