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
        ([((0, 1), (0, 1), S(dp=2)), ((1, 2), (2,), S()), ((2, 3), (0, 1), S(tp=2)), ((3, 4), (2,), S())], 2, 2)],
        chunks=2),
    "vpp2, tied: one rank and tp2 sp, then dp2 zero3": _plan("tiny-gpt", [
        ([((0, 1), (0,), S()), ((1, 2), (1, 2), S(tp=2, sp=True)), ((2, 3), (0,), S()),
          ((3, 4), (1, 2), S(dp=2, zero=3))], 2, 2)], chunks=2),
    "two pipelines of vpp2, equal widths": _plan("tiny-llama", [
        ([((0, 1), (0,), S()), ((1, 2), (1,), S()), ((2, 3), (0,), S()), ((3, 4), (1,), S())], 2, 1),
        ([((0, 1), (2,), S()), ((1, 2), (3,), S()), ((2, 3), (2,), S()), ((3, 4), (3,), S())], 2, 1)], chunks=2),
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
