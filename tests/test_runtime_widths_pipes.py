"""Stages of different widths beyond one vpp=1 pipeline of a decoder model: in one of several pipelines
(gradients across pipelines by `plait.runtime.placement.Replicas`; a tied table that one pipeline holds in
one stage and another in two), with interleaved chunks (the priced
interleaved order, `plait.runtime.pipeline_chunks`), and in T5 (the boundary carries the encoder and decoder
states, [B, T, 2H]) and LLaVA (the flat image and text up to the projector, then [B, T, H]); and several
pipelines with interleaved chunks of equal widths. Each trains to the single-process losses (gloo, 4 ranks,
one torchrun launch, fp32, 3 steps)."""

from __future__ import annotations

import pytest
from test_runtime import assert_same, reference_losses, text, train_together  # noqa: F401

from plait.executable import unsupported
from plait.plan import Pipeline, Plan, Stage, validate_plan
from plait.plan import Strategy as S
from plait.spec.cluster import local_ranks
from plait.spec.model import PRESETS

SEQ = 64
GBS = 4
STEPS = 3

Stages = list[tuple[tuple[int, int], tuple[int, ...], S]]


def _pipe(stages: Stages, micro_batches: int, size: int) -> Pipeline:
    return Pipeline(stages=tuple(Stage(layers=lay, ranks=r, strategies=(s,)) for lay, r, s in stages),
                    micro_batches=micro_batches, micro_batch_sequences=size)


def _plan(model: str, pipes: list[tuple[Stages, int, int]], chunks: int = 1, schedule: str = "1f1b") -> Plan:
    """Pipelines given as (stages as (layers, ranks, strategy), micro-batches, micro-batch size)."""
    pipelines = tuple(_pipe(*p) for p in pipes)
    return Plan(model=model, seq_len=SEQ, global_batch=sum(p.samples for p in pipelines), precision="fp32",
                chunks=chunks, schedule="interleaved" if chunks > 1 else schedule, pipelines=pipelines)


CASES = {
    "two pipelines: tp2 then one rank, beside one rank": _plan("tiny-llama", [
        ([((0, 2), (0, 1), S(tp=2)), ((2, 4), (2,), S())], 2, 1), ([((0, 4), (3,), S())], 2, 1)]),
    "two pipelines, tied: one rank then dp2 zero1, beside one rank": _plan("tiny-gpt", [
        ([((0, 1), (0,), S()), ((1, 4), (1, 2), S(dp=2, zero=1))], 1, 2), ([((0, 4), (3,), S())], 2, 1)]),
    "two pipelines, tied: one stage beside two stages of one rank": _plan("tiny-gpt", [
        ([((0, 4), (0,), S())], 2, 1), ([((0, 2), (1,), S()), ((2, 4), (2,), S())], 2, 1)]),
    "vpp2: dp2 and one rank, interleaved": _plan("tiny-llama", [
        ([((0, 1), (0, 1), S(dp=2)), ((1, 2), (2,), S()), ((2, 3), (0, 1), S(tp=2)), ((3, 4), (2,), S())],
         2, 2)], chunks=2),
    "vpp2, tied: one rank and tp2 sp, then dp2 zero3": _plan("tiny-gpt", [
        ([((0, 1), (0,), S()), ((1, 2), (1, 2), S(tp=2, sp=True)), ((2, 3), (0,), S()),
          ((3, 4), (1, 2), S(dp=2, zero=3))], 2, 2)], chunks=2),
    "two pipelines of vpp2, equal widths, ZeRO-1 across them": _plan("tiny-llama", [
        ([((0, 1), (0,), S(zero=1)), ((1, 2), (1,), S(zero=1)), ((2, 3), (0,), S(zero=1)),
          ((3, 4), (1,), S(zero=1))], 2, 1),
        ([((0, 1), (2,), S(zero=1)), ((1, 2), (3,), S(zero=1)), ((2, 3), (2,), S(zero=1)),
          ((3, 4), (3,), S(zero=1))], 2, 1)], chunks=2),
    "t5: tp2 encoder then one-rank decoder": _plan("tiny-t5", [
        ([((0, 2), (0, 1), S(tp=2)), ((2, 4), (2,), S())], 2, 2)]),
    "t5: one rank then cp2 (ulysses)": _plan("tiny-t5", [
        ([((0, 3), (0,), S()), ((3, 4), (1, 2), S(cp=2))], 2, 2)], schedule="gpipe"),
    "llava: cut in the tower (flat state), then after the projector": _plan("tiny-llava", [
        ([((0, 2), (0,), S()), ((2, 4), (1, 2), S(dp=2)), ((4, 6), (3,), S())], 2, 2)]),
    "llava: tp2 tower then one-rank text model": _plan("tiny-llava", [
        ([((0, 4), (0, 1), S(tp=2)), ((4, 6), (2,), S())], 2, 2)]),
}
MODELS = sorted({p.model for p in CASES.values()})


def test_cases_are_valid_and_executable() -> None:
    for name, plan in CASES.items():
        validate_plan(plan, PRESETS[plan.model], local_ranks(4))
        assert unsupported(plan, PRESETS[plan.model]) is None, name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text):  # noqa: F811
    """The single-process references, then every case in one four-rank torchrun job."""
    ref = reference_losses(tmp_path_factory.mktemp("reference"), text, [(m, GBS) for m in MODELS])
    cases = {name: (plan.model, plan) for name, plan in CASES.items()}
    proc, losses = train_together(tmp_path_factory.mktemp("widths-pipes"), text, 4, cases,
                                  {name: {"steps": STEPS} for name in cases})
    return ref, proc, losses


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(runs, name) -> None:
    """fp32 losses within 1e-5 of one process at each of 3 steps."""
    ref, proc, losses = runs
    plan = CASES[name]
    assert len(losses.get(name, [])) == STEPS, proc.stderr[-3000:]
    assert_same(losses[name], ref[(plan.model, GBS)][:STEPS])


FAMILY_BOUNDARIES = [("t5: tp2 encoder then one-rank decoder", 0, (SEQ, 2 * 64, False)),
                     ("t5: one rank then cp2 (ulysses)", 0, (SEQ, 2 * 64, False)),
                     ("llava: cut in the tower (flat state), then after the projector", 0,
                      (1, 17 * 64 + (SEQ - 16) * 128, True)),
                     ("llava: cut in the tower (flat state), then after the projector", 1, (SEQ, 128, False))]
"""(case, stage before the boundary, (tokens, elements per token, flat) it carries): T5's encoder and decoder
states side by side (2 x hidden 64); tiny-llava's tower (17 tokens of width 64, the class token first) and
the 48 text embeddings after the image, flat, then the projector's 64 positions of hidden 128."""


@pytest.mark.parametrize(("name", "index", "shape"), FAMILY_BOUNDARIES)
def test_boundary_carries_the_family_state_and_the_cost_model_prices_its_bytes(monkeypatch, name, index,
                                                                                shape) -> None:
    """Each receiver gets exactly its piece of the state (each sender its gradient's piece), under the
    boundary's own tags; the busiest rank's bytes are what `send_piece_bytes` prices there."""
    import torch
    from test_runtime_widths import _Mailbox, _piece

    from plait.cost.calibration import calibration_for
    from plait.cost.layer import BlockContext
    from plait.cost.precision import PRECISIONS
    from plait.cost.price import send_piece_bytes
    from plait.runtime import boundary as boundary_module
    from plait.runtime.boundary import boundaries
    from plait.spec.cluster import dgx

    plan = CASES[name]
    spec, pipe = PRESETS[plan.model], plan.pipelines[0]
    mail = _Mailbox()
    monkeypatch.setattr(boundary_module, "dist", mail)
    _, b = boundaries(plan, 0, index, spec, None)
    assert (b.tokens, b.hidden, b.flat) == shape
    x, g = torch.randn(b.batch, b.tokens, b.hidden), torch.randn(b.batch, b.tokens, b.hidden)
    state = (lambda t: t.flatten(1)) if b.flat else (lambda t: t)  # noqa: E731
    for p, mail.rank in enumerate(b.senders):
        b.send(state(_piece(x, b.src, p)), forward=True)
    for q, mail.rank in enumerate(b.receivers):
        assert torch.equal(b.receive(True, torch.float32), state(_piece(x, b.dst, q)))
        b.send(state(_piece(g, b.dst, q)), forward=False)
    for p, mail.rank in enumerate(b.senders):
        want = state(_piece(g, b.src, p)) * (b.src.data_degree / b.dst.data_degree)
        assert torch.allclose(b.receive(False, torch.float32), want, rtol=0, atol=1e-6)
    assert {tag for *_, tag in mail.queues} == {1 + 2 * index, 2 + 2 * index}
    upper = pipe.stages[index].strategies[-1]
    layer = pipe.stages[index + 1].layers[0]
    ctx = BlockContext.for_ranks(spec, dgx(1, 8, "A100-80GB"), calibration_for("A100-80GB"),
                                 PRECISIONS["fp32"], SEQ, b.batch // upper.dp, upper, b.senders, b.senders)
    busiest = max(*mail.sent.values(), *mail.received.values())
    assert send_piece_bytes(layer, upper, b.batch, ctx, pipe.stages[index + 1].strategies[0]) == busiest


def test_simulate_prices_every_case_with_the_order_the_runtime_runs() -> None:
    """`plait simulate` prices every case; with interleaved chunks each device group's stages run in the
    cost model's interleaved order (`schedule_order`), every stage's forward of a micro-batch before its
    backward: 2 device groups x 2 chunks x 2 micro-batches x (F, B) = 8 ops per group."""
    from plait.cost.pipeline import schedule_order
    from plait.runtime.pipeline_chunks import ChunkedSchedule
    from plait.simulate import simulate

    for name, plan in CASES.items():
        report = simulate(plan, PRESETS[plan.model], local_ranks(4))
        assert report.iteration_time_s > 0 and report.fits, name
    plan = CASES["vpp2: dp2 and one rank, interleaved"]
    for group in range(2):
        steps = ChunkedSchedule({}, group, 2, 2, 2).steps
        assert steps == schedule_order("interleaved", 2, 2, 2)[group] and len(steps) == 8
        assert {j for _, _, j in steps} == {group, group + 2}
        assert all(steps.index(("F", k, j)) < steps.index(("B", k, j)) for _, k, j in steps)
        stages = plan.pipelines[0].stages
        assert {stages[j].ranks for _, _, j in steps} == {stages[group].ranks}


def test_the_straggler_planner_prices_several_pipelines_of_different_widths_and_all_run() -> None:
    """On 8 ranks with rank 1 three times slower, Malleus's shrunk tensor-parallel unit (its healthy rank
    alone) beside whole tp2 units gives 24 of the 180 plans the straggler planner prices several pipelines,
    some of whose stages differ in width; the runtime refuses none of the 180."""
    from plait.planner.straggler import plan_around_stragglers

    seen: dict[str, Plan] = {}
    plan_around_stragglers(PRESETS["tiny-llama"], local_ranks(8).with_slow({1: 3.0}), SEQ, 16, precision="fp32",
                           record=lambda p: seen.setdefault(p.model_dump_json(), p))
    several_uneven = [p for p in seen.values()
                      if len(p.pipelines) > 1 and not all(pipe.even_widths for pipe in p.pipelines)]
    assert len(seen) == 180 and len(several_uneven) == 24
    assert all(unsupported(p, PRESETS[p.model]) is None for p in seen.values())
