"""Pipeline stages of different widths: the boundary moves each piece straight into the next stage's layout
(`plait.runtime.boundary`), the runtime's own schedule runs them (`plait.runtime.pipeline_uneven`), plans
train to the single-process losses (gloo, 4 ranks, one torchrun launch, fp32), and the cost model prices
the bytes the boundary sends."""

from __future__ import annotations

import pytest
import torch
from test_runtime import SEQ, assert_same, reference_losses, text, train_together  # noqa: F401

from plait.cost.calibration import calibration_for
from plait.cost.layer import BlockContext
from plait.cost.precision import PRECISIONS
from plait.cost.price import send_piece_bytes
from plait.executable import unsupported
from plait.layout import Layout
from plait.plan import Pipeline, Plan, Stage, Strategy
from plait.runtime import boundary as boundary_module
from plait.runtime.boundary import Boundary
from plait.runtime.pipeline_uneven import order
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS

S = Strategy
MODEL = "tiny-llama"
GBS = 4


def _plan(stages: list[tuple[tuple[int, int], tuple[int, ...], Strategy]], micro_batches: int,
          schedule: str = "1f1b", model: str = MODEL) -> Plan:
    pipe = Pipeline(stages=tuple(Stage(layers=lay, ranks=r, strategies=(s,)) for lay, r, s in stages),
                    micro_batches=micro_batches, micro_batch_sequences=GBS // micro_batches)
    return Plan(model=model, seq_len=SEQ, global_batch=GBS, schedule=schedule, precision="fp32", pipelines=(pipe,))


CASES = {
    "2 then 1: tp2 then one rank": _plan([((0, 2), (0, 1), S(tp=2)), ((2, 4), (2,), S())], 2),
    "2 then 1: dp2 zero3 then one rank, gpipe": _plan([((0, 2), (0, 1), S(dp=2, zero=3)), ((2, 4), (2,), S())], 2,
                                                      "gpipe"),
    "1 then 2: one rank then dp2": _plan([((0, 1), (0,), S()), ((1, 4), (1, 2), S(dp=2))], 2),
    "1 then 2: one rank then tp2 sp, gpipe": _plan([((0, 3), (0,), S()), ((3, 4), (1, 2), S(tp=2, sp=True))], 2,
                                                   "gpipe"),
    "1 then 2 then 1: tp2 in the middle": _plan([((0, 1), (0,), S()), ((1, 3), (1, 2), S(tp=2)),
                                                 ((3, 4), (3,), S())], 4),
    "gpt, tied embedding: 1 then dp2 then 1, 3 stages 2 micro-batches": _plan([
        ((0, 1), (0,), S()), ((1, 3), (1, 2), S(dp=2)), ((3, 4), (3,), S())], 2, model="tiny-gpt"),
    "2 then 2: tp2-sp then dp2 (equal widths, torch schedule)": _plan([((0, 2), (0, 1), S(tp=2, sp=True)),
                                                                       ((2, 4), (2, 3), S(dp=2))], 2),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text) -> dict[str, list[float]]:  # noqa: F811
    curves = reference_losses(tmp_path_factory.mktemp("reference"), text, [(MODEL, GBS), ("tiny-gpt", GBS)])
    return {model: losses for (model, _), losses in curves.items()}


RESUME_AT = 3  # the saved run (stages of widths 2 then 1) stops after step 3; the resumed one trains 4 and 5
SAVE, RESUME = "saved at widths 2 then 1", "resumed at widths 1 then 2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> tuple:  # noqa: F811
    """Every case in one 4-rank torchrun job; the last two save a checkpoint under one plan of different widths
    and resume it under another."""
    ckpt = tmp_path_factory.mktemp("checkpoint")
    cases = {k: (p.model, p) for k, p in CASES.items()}
    cases |= {SAVE: (MODEL, CASES["2 then 1: tp2 then one rank"]),
              RESUME: (MODEL, CASES["1 then 2: one rank then dp2"])}
    options = {SAVE: {"steps": RESUME_AT, "checkpoint_dir": str(ckpt)}, RESUME: {"checkpoint_dir": str(ckpt)}}
    return train_together(tmp_path_factory.mktemp("widths"), text, 4, cases, options)


@pytest.mark.parametrize("name", list(CASES))
def test_stages_of_different_widths_match_single_process(runs, reference, name) -> None:
    """fp32 losses within 1e-5 of one process, every step (5 steps)."""
    proc, losses = runs
    plan = CASES[name]
    assert unsupported(plan, PRESETS[plan.model]) is None
    assert name in losses and len(losses[name]) == len(reference[plan.model]) == 5, proc.stderr[-3000:]
    assert_same(losses[name], reference[plan.model])


def test_checkpoint_moves_between_plans_of_different_widths(runs, reference) -> None:
    """A checkpoint saved by a tp2 stage and a one-rank stage loads into a one-rank stage and a dp2 stage:
    the saved and resumed losses are the single-process ones (steps 1-3, then 4-5)."""
    proc, losses = runs
    saved, resumed = losses.get(SAVE), losses.get(RESUME)
    assert saved is not None and len(saved) == RESUME_AT, proc.stderr[-3000:]
    assert resumed is not None and len(resumed) == 5 - RESUME_AT, proc.stderr[-3000:]
    assert_same(saved + resumed, reference[MODEL])


def test_orders_run_every_forward_before_its_backward() -> None:
    """GPipe: every forward then every backward; 1F1B: stages-1-index warm-up forwards, then alternating."""
    assert order("gpipe", 2, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert order("1f1b", 3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2),
                                      ("B", 3)]
    assert order("1f1b", 3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


class _Mailbox:
    """In-process stand-ins for `dist.isend`, `dist.irecv` and `dist.get_rank`: messages by (from, to, tag)."""

    def __init__(self) -> None:
        self.rank = 0
        self.queues: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self.sent: dict[int, int] = {}  # bytes each rank sent
        self.received: dict[int, int] = {}

    def get_rank(self) -> int:
        return self.rank

    def isend(self, tensor, dst, group=None, tag=0):
        self.queues.setdefault((self.rank, dst, tag), []).append(tensor.clone())
        self.sent[self.rank] = self.sent.get(self.rank, 0) + tensor.numel() * tensor.element_size()
        return self

    def irecv(self, tensor, src, group=None, tag=0):
        tensor.copy_(self.queues[(src, self.rank, tag)].pop(0))
        self.received[self.rank] = self.received.get(self.rank, 0) + tensor.numel() * tensor.element_size()
        return self

    def wait(self) -> None:
        pass


def _piece(x: torch.Tensor, layout: Layout, position: int) -> torch.Tensor:
    (b0, b1), (t0, t1) = layout.piece(position, x.shape[0], x.shape[1])
    return x[b0:b1, t0:t1]


BOUNDARIES = [(S(tp=2), S()), (S(tp=2, sp=True), S()), (S(dp=2), S()), (S(), S(dp=2)), (S(), S(tp=2)),
              (S(dp=2), S(tp=2, sp=True, dp=2)), (S(dp=2, tp=2), S(cp=2)), (S(cp=2), S(dp=2, tp=2, sp=True))]


@pytest.mark.parametrize(("upper", "lower"), BOUNDARIES, ids=lambda s: s.short())
def test_boundary_moves_each_piece_and_the_cost_model_prices_its_bytes(monkeypatch, upper, lower) -> None:
    """Every receiver gets exactly its piece of the activation (and every sender its piece of the gradient,
    times d_upper / d_lower); the busiest rank's bytes, over both directions, are what `send_piece_bytes`
    prices for that boundary."""
    mail = _Mailbox()
    monkeypatch.setattr(boundary_module, "dist", mail)
    batch, hidden = 4, PRESETS[MODEL].hidden
    src, dst = Layout.of(upper), Layout.of(lower)
    senders = tuple(range(upper.devices))
    receivers = tuple(range(upper.devices, upper.devices + lower.devices))
    b = Boundary(src, dst, senders, receivers, batch, SEQ, hidden, None)
    x, g = torch.randn(batch, SEQ, hidden), torch.randn(batch, SEQ, hidden)
    for p, mail.rank in enumerate(senders):
        b.send(_piece(x, src, p), forward=True)
    for q, mail.rank in enumerate(receivers):
        assert torch.equal(b.receive(True, torch.float32), _piece(x, dst, q))
        b.send(_piece(g, dst, q), forward=False)
    for p, mail.rank in enumerate(senders):
        want = _piece(g, src, p) * (src.data_degree / dst.data_degree)
        assert torch.allclose(b.receive(False, torch.float32), want, rtol=0, atol=1e-6)
    busiest = max(*mail.sent.values(), *mail.received.values())
    ctx = BlockContext.for_ranks(PRESETS[MODEL], dgx(1, 8, "A100-80GB"), calibration_for("A100-80GB"),
                                 PRECISIONS["fp32"], SEQ, batch // upper.dp, upper, senders, senders)
    assert send_piece_bytes(2, upper, batch, ctx, lower) == busiest
    # one direction's bytes differ from the other where the narrow side holds copies (tp without sp)
    forward_most = max(mail.received[r] for r in receivers)
    assert forward_most == batch * SEQ * hidden * 4 // (dst.dp * dst.token_parts)


def test_simulate_prices_the_boundary_as_the_transfer_it_sends() -> None:
    """`plait simulate`'s send between a tp2 stage and a one-rank stage is one point-to-point time of the
    busiest rank's bytes: both tp copies receive the whole gradient, 2x the activation (fp32 [2, 64, 128])."""
    from plait.cost import comm
    from plait.simulate import price_plan

    cluster = dgx(1, 4, "A100-80GB")
    priced = price_plan(CASES["2 then 1: tp2 then one rank"], PRESETS[MODEL], cluster)
    whole = 2 * SEQ * PRESETS[MODEL].hidden * 4  # bytes of one micro-batch's hidden state
    assert priced.costs[0][0].send == comm.p2p(2 * whole, False, cluster, priced.cal)
    priced = price_plan(CASES["1 then 2: one rank then dp2"], PRESETS[MODEL], cluster)
    assert priced.costs[0][0].send == comm.p2p(whole, False, cluster, priced.cal)  # one rank sends it all
