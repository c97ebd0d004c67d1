"""Several pipelines of different shapes (Malleus): a layer split differently in each pipeline (tensor
parallel in one, data parallel or ZeRO inside another's stage, a shrunk tensor-parallel unit beside a full
one) has its whole gradient summed over every holder (`plait.runtime.placement.Replicas`). Such plans train
to the single-process losses (gloo, 4 ranks, one torchrun launch, fp32). ZeRO across pipelines splits the
optimizer state of a layer held alike among its holders (`plait.runtime.replica_zero`), as simulate prices."""

from __future__ import annotations

import pytest
from test_runtime import STEPS, _losses, assert_same, reference_losses, text, train_together  # noqa: F401

from plait.executable import shard_shape, tied_copies, unsupported
from plait.plan import Pipeline, Plan, Stage, validate_plan
from plait.plan import Strategy as S
from plait.spec.cluster import local_ranks
from plait.spec.model import PRESETS

SEQ = 64
GBS = 4


def _plan(model: str, pipes: list[tuple[list[tuple[tuple[int, int], tuple[int, ...], S]], int, int]]) -> Plan:
    """Pipelines given as (stages as (layers, ranks, strategy), micro-batches, micro-batch size)."""
    pipelines = tuple(Pipeline(stages=tuple(Stage(layers=lay, ranks=r, strategies=(s,)) for lay, r, s in st),
                               micro_batches=m, micro_batch_sequences=b) for st, m, b in pipes)
    return Plan(model=model, seq_len=SEQ, global_batch=sum(p.samples for p in pipelines), precision="fp32",
                pipelines=pipelines)


CASES = {
    "dp2 stage beside a pp2 pipeline": _plan("tiny-llama", [
        ([((0, 4), (0, 1), S(dp=2))], 1, 2), ([((0, 2), (2,), S()), ((2, 4), (3,), S())], 2, 1)]),
    "dp2 zero3 stage beside a tp2 sp stage": _plan("tiny-llama", [
        ([((0, 4), (0, 1), S(dp=2, zero=3))], 1, 2), ([((0, 4), (2, 3), S(tp=2, sp=True))], 2, 1)]),
    "shrunk tp1 unit beside a tp2 unit, micro-batches 3 and 1, rank 3 left out": _plan("tiny-llama", [
        ([((0, 4), (0, 1), S(tp=2))], 3, 1), ([((0, 4), (2,), S())], 1, 1)]),
    "tied: a one-rank stage beside a cp2 stage": _plan("tiny-gpt", [
        ([((0, 4), (0, 1), S(cp=2))], 1, 2), ([((0, 4), (2,), S())], 2, 1)]),
    "ZeRO across pipelines: a one-rank zero1 stage beside a dp2 zero1 stage": _plan(
        "tiny-llama", [([((0, 4), (0,), S(zero=1))], 2, 1), ([((0, 4), (1, 2), S(dp=2, zero=1))], 1, 2)]),
}
ALIKE = {
    "ZeRO across pipelines: one-rank zero2 stages, micro-batches 3 and 1": _plan(
        "tiny-gpt", [([((0, 4), (0,), S(zero=2))], 3, 1), ([((0, 4), (3,), S(zero=2))], 1, 1)]),
    "ZeRO across pipelines: a one-rank zero1 stage beside a pp2 zero1 pipeline": _plan(
        "tiny-llama", [([((0, 4), (0,), S(zero=1))], 2, 1), ([((0, 2), (1,), S(zero=1)), ((2, 4), (2,), S(zero=1))], 2, 1)]),
}
"""Cases whose pipelines shard every layer alike (reduced shard by shard), run in the same job."""


def _one_stage(ranks: tuple[int, ...], strategies: tuple[S, ...], micro_batches: int, size: int) -> Plan:
    """tiny-gpt (tied embedding and head) in one stage with one strategy per layer."""
    pipe = Pipeline(stages=(Stage(layers=(0, 4), ranks=ranks, strategies=strategies),),
                    micro_batches=micro_batches, micro_batch_sequences=size)
    return Plan(model="tiny-gpt", seq_len=SEQ, global_batch=pipe.samples, precision="fp32", pipelines=(pipe,))


TIED_COPIES = {
    "tied one stage: first layer tp2, the rest dp2": _one_stage(
        (0, 1), (S(tp=2), S(dp=2), S(dp=2), S(dp=2)), 2, 2),
    "tied one stage: zero3 first and last layers around tp2 sp layers": _one_stage(
        (2, 3), (S(dp=2, zero=3), S(tp=2, sp=True), S(tp=2, sp=True), S(dp=2, zero=3)), 2, 2),
    "tied one stage of 4 ranks: first layer tp2 x dp2, last dp4 zero2": _one_stage(
        (0, 1, 2, 3), (S(tp=2, dp=2), S(dp=4), S(dp=4), S(dp=4, zero=2)), 1, 4),
    "tied one stage tp2 then dp2 beside a one-rank pipeline, which holds two copies too": Plan(
        model="tiny-gpt", seq_len=SEQ, global_batch=GBS, precision="fp32", pipelines=(
            _one_stage((0, 1), (S(tp=2), S(dp=2), S(dp=2), S(dp=2)), 1, 2).pipelines[0],
            _one_stage((2,), (S(),), 2, 1).pipelines[0])),
}
"""One stage holding the tied table twice (`plait.executable.tied_copies`), run in the same job: the
embedding's copy laid out like the first layer, the head's like the last, whole gradients summed."""


SAVED_FROM = "tied one stage: first layer tp2, the rest dp2"
SAVED, RESUMED, SAVED_STEPS = "tied table held twice, saved", "resumed holding it once", 3
RESUMED_AS = _one_stage((0, 1), (S(dp=2),), 2, 2)
"""A checkpoint of the two copies (after 3 steps), resumed by a stage holding one table, in the same job."""


ZERO_SAVED, ZERO_RESUMED = "ZeRO across pipelines, saved", "resumed under ZeRO across three pipelines"
ZERO_SAVED_FROM = "ZeRO across pipelines: a one-rank zero1 stage beside a pp2 zero1 pipeline"
ZERO_RESUMED_AS = _plan("tiny-llama", [([((0, 4), (r,), S(zero=1))], m, 1) for r, m in ((0, 2), (2, 1), (3, 1))])
"""A checkpoint of ZeRO across two pipelines (each holder keeping half of the AdamW moments, after 3 steps),
resumed in the same job by three one-rank pipelines, each keeping a third: moments gathered on save, sliced
on load (`plait.runtime.replica_zero.whole_view`)."""


def test_pipelines_shard_their_layers_differently() -> None:
    """Every case holds some layer in two different shapes (else it would test the shard-by-shard path)
    and is executable."""
    for name, plan in CASES.items():
        shapes = {shard_shape(next(st for st in p.stages if st.layers[0] <= 0 < st.layers[1]), 0)
                  for p in plan.pipelines}
        assert len(shapes) == 2, name
        assert unsupported(plan, PRESETS[plan.model]) is None, name
    for name, plan in {**CASES, **ALIKE, **TIED_COPIES, RESUMED: RESUMED_AS, ZERO_RESUMED: ZERO_RESUMED_AS}.items():
        validate_plan(plan, PRESETS[plan.model], local_ranks(4))  # raises on a malformed case
    for name, plan in TIED_COPIES.items():
        assert tied_copies(plan) and unsupported(plan, PRESETS[plan.model]) is None, name


def test_a_tied_table_in_one_stage_beside_one_in_two_is_executable() -> None:
    """Every pipeline then holds the table twice (`tied_copies`); tests/test_runtime_widths_pipes.py runs it."""
    tied_mixed = _plan("tiny-gpt", [([((0, 4), (0,), S())], 2, 1),
                                    ([((0, 2), (1,), S()), ((2, 4), (2,), S())], 2, 1)])
    assert tied_copies(tied_mixed) and unsupported(tied_mixed, PRESETS["tiny-gpt"]) is None


@pytest.fixture(scope="module")
def hetero_runs(tmp_path_factory, text):  # noqa: F811
    """The single-process references, then every case in one four-rank torchrun job."""
    pairs = [("tiny-llama", GBS), ("tiny-gpt", GBS)]
    ref = reference_losses(tmp_path_factory.mktemp("reference"), text, pairs)
    cases = {name: (plan.model, plan) for name, plan in {**CASES, **ALIKE, **TIED_COPIES}.items()}
    tmp = tmp_path_factory.mktemp("hetero")
    ckpt = {"checkpoint_dir": str(tmp / "tied-checkpoint")}
    cases |= {SAVED: ("tiny-gpt", TIED_COPIES[SAVED_FROM]), RESUMED: ("tiny-gpt", RESUMED_AS)}
    zero = {"checkpoint_dir": str(tmp / "zero-checkpoint")}
    cases |= {ZERO_SAVED: ("tiny-llama", ALIKE[ZERO_SAVED_FROM]), ZERO_RESUMED: ("tiny-llama", ZERO_RESUMED_AS)}
    options = {SAVED: {**ckpt, "steps": SAVED_STEPS}, RESUMED: ckpt, ZERO_SAVED: {**zero, "steps": SAVED_STEPS},
               ZERO_RESUMED: zero}
    return ref, train_together(tmp, text, 4, cases, options)


@pytest.mark.parametrize("name", [*CASES, *ALIKE, *TIED_COPIES])
def test_pipelines_of_different_shapes_match_single_process(hetero_runs, name) -> None:
    ref, runs = hetero_runs
    plan = {**CASES, **ALIKE, **TIED_COPIES}[name]
    assert_same(_losses(runs, name), ref[(plan.model, plan.global_batch)])


def test_a_checkpoint_of_two_tied_copies_resumes_as_one_table(hetero_runs) -> None:
    ref, (proc, losses) = hetero_runs
    assert len(losses.get(SAVED, [])) == SAVED_STEPS and len(losses.get(RESUMED, [])) == STEPS - SAVED_STEPS, \
        proc.stderr[-3000:]
    assert_same(losses[SAVED] + losses[RESUMED], ref[("tiny-gpt", GBS)])


def test_zero_across_pipelines_checkpoints_and_resumes_under_another_plan(hetero_runs) -> None:
    """Saved and resumed with the moments split among the holders (the run that saves keeps half of them,
    the one that resumes a third), the losses are those of one process."""
    ref, (proc, losses) = hetero_runs
    assert len(losses.get(ZERO_SAVED, [])) == SAVED_STEPS and \
        len(losses.get(ZERO_RESUMED, [])) == STEPS - SAVED_STEPS, proc.stderr[-3000:]
    optim = lambda name: [t["optim"] for t in proc.first_records[name]["memory_terms"]]  # noqa: E731
    assert optim(ZERO_SAVED)[0] == _sliced_optimizer_bytes("tiny-llama", 2, 0)
    assert optim(ZERO_RESUMED)[0] == _sliced_optimizer_bytes("tiny-llama", 3, 0)
    assert optim(ZERO_RESUMED)[3] == _sliced_optimizer_bytes("tiny-llama", 3, 2)
    assert_same(losses[ZERO_SAVED] + losses[ZERO_RESUMED], ref[("tiny-llama", GBS)])


def test_simulate_prices_the_whole_gradient_reduction() -> None:
    """A shrunk tp1 unit beside a tp2 unit: every holder all-reduces the whole gradients (and the tp2 unit
    gathers them first), which the same two pipelines at one shape (tp1 beside tp1) reduce shard by shard."""
    from plait.simulate import simulate
    from plait.spec.cluster import local_ranks

    def sync_s(plan: Plan) -> float:
        report = simulate(plan, PRESETS["tiny-llama"], local_ranks(4), validate=False)
        return max(d.parts["dp_comm_exposed"] for d in report.devices)

    shrunk = CASES["shrunk tp1 unit beside a tp2 unit, micro-batches 3 and 1, rank 3 left out"]
    alike = _plan("tiny-llama", [([((0, 4), (0,), S())], 3, 1), ([((0, 4), (2,), S())], 1, 1)])
    assert sync_s(shrunk) > 1.5 * sync_s(alike)


def _sliced_optimizer_bytes(model: str, members: int, index: int, prefixes: tuple[str, ...] = ("",)) -> int:
    """AdamW state bytes of member `index` of `members` stepping its slice of every parameter whose name starts
    with one of `prefixes`: two fp32 moments per element of the slice and a 4-byte step counter per slice."""
    from plait.models import build_model
    from plait.runtime.replica_zero import _bounds

    total = 0
    for name, p in build_model(PRESETS[model]).named_parameters():
        start, end, _ = _bounds(p.numel(), members, index)
        if name.startswith(prefixes) and end > start:
            total += 2 * 4 * (end - start) + 4
    return total


def test_zero_across_pipelines_splits_the_optimizer_state(hetero_runs) -> None:
    """Each holder of a layer held alike by one rank of every pipeline keeps 1/|R| of its AdamW state: two
    pipelines, so half of the moments (plus a step counter per slice), on every rank that holds the layer."""
    _, (proc, _) = hetero_runs
    optim = lambda name: [t["optim"] for t in proc.first_records[name]["memory_terms"]]  # noqa: E731
    both = optim("ZeRO across pipelines: one-rank zero2 stages, micro-batches 3 and 1")
    whole = _sliced_optimizer_bytes("tiny-gpt", 1, 0)
    assert both[0] == _sliced_optimizer_bytes("tiny-gpt", 2, 0)
    assert both[3] == _sliced_optimizer_bytes("tiny-gpt", 2, 1)
    assert both[1] == both[2] == 0
    assert abs(both[0] - whole / 2) < 4 * 68  # 68 tensors: at most one step counter each beyond half
    pp = optim("ZeRO across pipelines: a one-rank zero1 stage beside a pp2 zero1 pipeline")
    assert pp[0] == _sliced_optimizer_bytes("tiny-llama", 2, 0)
    assert pp[1] == _sliced_optimizer_bytes("tiny-llama", 2, 1, ("tok_embeddings", "layers.0.", "layers.1."))
    assert pp[2] == _sliced_optimizer_bytes("tiny-llama", 2, 1, ("layers.2.", "layers.3.", "norm", "output"))


def test_simulate_prices_what_zero_across_pipelines_holds() -> None:
    """The cost model prices the runtime's states: a layer held alike by one rank of each of two pipelines
    under ZeRO-2 keeps half of the AdamW moments but its whole gradient (the pipelines reduce once per step);
    held differently (one rank beside a dp2 stage) the one rank keeps the whole optimizer state."""
    from plait.simulate import simulate
    from plait.spec.cluster import local_ranks

    def memory(plan: Plan) -> dict[tuple[int, ...], tuple[float, float]]:
        report = simulate(plan, PRESETS[plan.model], local_ranks(4), validate=False)
        return {d.ranks: (d.memory.optimizer, d.memory.gradients) for d in report.devices}

    gpt_moments = _sliced_optimizer_bytes("tiny-gpt", 1, 0) - 4 * 68  # without the 68 step counters
    alike = memory(ALIKE["ZeRO across pipelines: one-rank zero2 stages, micro-batches 3 and 1"])
    assert alike[(0,)] == alike[(3,)] == (gpt_moments / 2, gpt_moments / 2)  # fp32 grads: 4 of the 8 bytes
    llama_moments = _sliced_optimizer_bytes("tiny-llama", 1, 0) - 4 * 39
    mixed = memory(CASES["ZeRO across pipelines: a one-rank zero1 stage beside a dp2 zero1 stage"])
    assert mixed[(0,)][0] == llama_moments
    assert mixed[(1, 2)][0] == llama_moments / 2
