"""Expert tensor parallelism (etp > 1) in the runtime: each expert's width split over an etp group, the
routed tokens all-gathered over it and the outputs reduce-scattered back (`plait.runtime.experts`). Plans
with etp train to the single-process losses (gloo, 4 ranks, one torchrun launch, fp32), LSH-MoE composes
with etp, and a checkpoint saved at ep2 etp2 resumes at ep4 etp1 (see tests/test_runtime_moe.py)."""

from __future__ import annotations

import pytest
import torch
from test_runtime import _losses, assert_same, reference_losses, text, train_together  # noqa: F401
from test_runtime_moe import GBS, MODEL

from plait.executable import unsupported
from plait.plan import Pipeline, Plan, Stage, uniform_plan
from plait.planner.space import block_strategies
from plait.runtime.experts import EXPERT_SHARDS, by_expert
from plait.spec.cluster import dgx, local_ranks
from plait.spec.degrees import Degrees
from plait.spec.model import PRESETS

RESUME_AT = 3  # the saved run stops after step 3; the resumed one trains steps 4 and 5 at ep4 etp1
EP2_ETP2 = "dp=2,tp=2,sp=1,ep=2,gbs=4"  # etp defaults to tp: 4 ranks = edp1 x ep2 x etp2
CASES = {
    "ep2 etp2 (tp2)": EP2_ETP2,
    "ep1 etp2 (edp2)": "dp=4,ep=1,etp=2,gbs=4",
    "ep2 etp2 zero3": "dp=2,tp=2,sp=1,ep=2,zero=3,gbs=4",
    "ep1 etp2 zero1 (edp2)": "dp=4,ep=1,etp=2,zero=1,gbs=4",
    "pp2 x ep1 etp2 (tp2)": "pp=2,tp=2,sp=1,mbs=1,gbs=4",
    "ep2 etp2 on ring cp2 x tp2 full recompute": "cp=2,cp_mode=ring,tp=2,sp=1,ep=2,recompute=full,gbs=4",
    "ep2 etp2 lsh": "dp=2,tp=2,sp=1,ep=2,moe_comm=lsh,gbs=4",
    "ep2 etp1 lsh": "dp=2,tp=2,sp=1,ep=2,etp=1,moe_comm=lsh,gbs=4",
}
SINGLE_PROCESS = ["ep2 etp2 (tp2)", "ep1 etp2 (edp2)", "ep2 etp2 zero3", "ep1 etp2 zero1 (edp2)",
                  "pp2 x ep1 etp2 (tp2)", "ep2 etp2 on ring cp2 x tp2 full recompute"]
SAVE, RESUME = "ep2 etp2 saved", "ep4 etp1 resumed"


def test_etp_plans_are_executable_and_laid_out_etp_fastest() -> None:
    """etp > 1 is not refused; the expert mesh puts etp
    fastest, and the edp group (the experts' gradient replicas) shares ep and etp."""
    spec, ranks = PRESETS[MODEL], local_ranks(4)
    for strategy in [*CASES.values(), "dp=4,ep=4,gbs=4"]:
        assert unsupported(uniform_plan(strategy, spec, ranks, 64), spec) is None, strategy
    d = Degrees(dp=4, ep=2, etp=2)  # 4 ranks: edp1 x ep2 x etp2
    assert d.expert_group(range(4), "etp", 2) == (2, 3) and d.expert_group(range(4), "ep", 1) == (1, 3)
    d = Degrees(dp=4, ep=1, etp=2)  # edp2 x ep1 x etp2
    assert d.expert_group(range(4), "edp", 1) == (1, 3) and d.expert_group(range(4), "etp", 1) == (0, 1)
    assert dict(EXPERT_SHARDS) == {"w1": 1, "w3": 1, "w2": 2, "w1_bias": 1, "w3_bias": 1, "w2_bias": None}  # the
    # width F of w1/w3 [E, F, H], w2 [E, H, F], the biases of w1/w3 [E, F]; the down bias [E, H] whole


def test_by_expert_sorts_source_blocks_by_expert_then_source() -> None:
    """Rows arrive by source rank then expert; `by_expert` orders them by expert then source (stable)."""
    counts = torch.tensor([[2, 1], [0, 3]])  # source 0: 2 rows of expert 0, 1 of 1; source 1: 3 rows of 1
    assert by_expert(counts).tolist() == [0, 1, 2, 3, 4, 5]
    counts = torch.tensor([[1, 2], [2, 0]])  # rows: s0e0, s0e1, s0e1, s1e0, s1e0
    assert by_expert(counts).tolist() == [0, 3, 4, 1, 2]


def test_the_search_space_etp_strategies_run() -> None:
    """The runtime refuses none of the search space's etp strategies: of its 176 strategies of a
    tiny-moe MoE layer on 4 ranks, the 32 with etp > 1 (etp = tp = 2, ep 1 or 2) now all run."""
    spec = PRESETS[MODEL]
    space = block_strategies(spec.stack[1], dgx(1, 4, "A100-80GB"), 4, GBS, 64)
    etp = [s for s in space if s.expert_tp > 1]
    assert len(space) == 176 and len(etp) == 32 and {(s.tp, s.sp, s.ep, s.expert_tp) for s in etp} == {
        (2, True, 1, 2), (2, True, 2, 2)}
    for s in etp:
        stage = Stage(layers=(0, spec.layers), ranks=(0, 1, 2, 3), strategies=(s,) * spec.layers)
        plan = Plan(model=MODEL, seq_len=64, global_batch=GBS, precision="fp32",
                    pipelines=(Pipeline(stages=(stage,), micro_batches=1, micro_batch_sequences=GBS),))
        assert unsupported(plan, spec) is None, s.short()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text) -> list[float]:  # noqa: F811
    return reference_losses(tmp_path_factory.mktemp("reference"), text, [(MODEL, GBS)])[(MODEL, GBS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> tuple:  # noqa: F811
    """Every case in one 4-rank torchrun job: the saved run stops after step 3 with its checkpoint, which
    the last case resumes with ep4 etp1 (experts resharded by DCP along both the experts and their width)."""
    ckpt = tmp_path_factory.mktemp("checkpoint")
    cases = {name: (MODEL, plan) for name, plan in CASES.items()}
    cases |= {SAVE: (MODEL, EP2_ETP2), RESUME: (MODEL, "dp=4,ep=4,gbs=4")}
    options = {SAVE: {"steps": RESUME_AT, "checkpoint_dir": str(ckpt)}, RESUME: {"checkpoint_dir": str(ckpt)}}
    return train_together(tmp_path_factory.mktemp("ranks4"), text, 4, cases, options)


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_etp_plans_match_single_process(runs, reference, name) -> None:
    """ep2 etp2 on tp2+sp attention, ep1 etp2 with two expert-data-parallel replicas, both with ZeRO, etp2
    in each of two pipeline stages, and ep2 etp2 on ring cp2 x tp2+sp attention with full recompute train to
    the single-process losses."""
    assert_same(_losses(runs, name), reference)


def test_lsh_composes_with_etp(runs) -> None:
    """LSH-MoE compresses before the dispatch, so its centroids do not depend on etp: etp2 trains to the
    etp1 losses of the same plan."""
    assert_same(_losses(runs, "ep2 etp2 lsh"), _losses(runs, "ep2 etp1 lsh"))


def test_resume_from_ep2_etp2_into_ep4_etp1(runs) -> None:
    """A checkpoint written at ep2 etp2 loads at ep4 etp1: the next losses are those of the uninterrupted
    ep2 etp2 run."""
    proc, losses = runs
    saved, resumed = losses.get(SAVE), losses.get(RESUME)
    assert saved is not None and len(saved) == RESUME_AT, proc.stderr[-3000:]
    whole = _losses(runs, "ep2 etp2 (tp2)")
    assert resumed is not None and len(resumed) == len(whole) - RESUME_AT, proc.stderr[-3000:]
    assert_same(saved, whole[:RESUME_AT])
    assert_same(resumed, whole[RESUME_AT:])
