"""Models of several layer kinds in the runtime: a T5-style encoder-decoder and a LLaVA-style vision + text
model train to the single-process losses under every parallel dimension, per-layer mixes and differently
laid-out pipeline stages (gloo, real torchrun launches, fp32, same seed and data; see tests/test_runtime.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_runtime import SEQ, STEPS, _gbs, _losses, assert_same, reference_losses, text, train_together  # noqa: F401 (fixture)

from plait.errors import PlaitError
from plait.executable import unbuildable, unsupported
from plait.plan import Pipeline, Plan, Stage, Strategy, strategy_problem, uniform_plan
from plait.spec.cluster import local_ranks
from plait.spec.model import PRESETS, parse_inline

S = Strategy
KIND_MODELS = ("tiny-t5", "tiny-llava")
REFERENCE = [(m, g) for m in KIND_MODELS for g in (4, 8)]


def _plan(model: str, stages: list[tuple[tuple[int, int], tuple[int, ...], tuple[Strategy, ...]]],
          micro_batches: int, micro_batch_sequences: int, schedule: str = "1f1b", chunks: int = 1) -> Plan:
    return Plan(model=model, seq_len=SEQ, global_batch=micro_batches * micro_batch_sequences, schedule=schedule,
                chunks=chunks, precision="fp32",
                pipelines=(Pipeline(stages=tuple(Stage(layers=lay, ranks=r, strategies=s) for lay, r, s in stages),
                                    micro_batches=micro_batches, micro_batch_sequences=micro_batch_sequences),))


TWO_RANKS = [
    ("dp=2,gbs=4", "tiny-t5"),
    ("dp=2,zero=3,recompute=full,gbs=4", "tiny-t5"),
    ("tp=2,gbs=4", "tiny-t5"),
    ("tp=2,sp=1,recompute=selective,gbs=4", "tiny-t5"),
    ("cp=2,gbs=4", "tiny-t5"),
    ("pp=2,mbs=1,gbs=4", "tiny-t5"),
    ("dp=2,gbs=4", "tiny-llava"),
    ("dp=2,zero=3,recompute=full,gbs=4", "tiny-llava"),
    ("tp=2,gbs=4", "tiny-llava"),
    ("pp=2,mbs=1,gbs=4", "tiny-llava"),  # the stages meet where the tower's tokens and the text are carried
    ("pp=2,vpp=2,mbs=1,gbs=4", "tiny-llava"),  # chunks cut after the patch embedding, a vision layer, the projector
]

FOUR_RANKS = [
    ("dp=2,tp=2,sp=1,gbs=4", "tiny-t5"),
    ("tp=2,cp=2,gbs=4", "tiny-t5"),
    ("pp=2,tp=2,sp=1,mbs=2,gbs=8", "tiny-t5"),  # encoder | decoder stages, tied embedding across them
    ("dp=2,tp=2,zero=1,gbs=4", "tiny-llava"),
    ("pp=2,dp=2,mbs=2,gbs=8,schedule=gpipe", "tiny-llava"),
]

MIXED = {  # per-layer strategies inside a stage, and stages laid out differently
    "t5 layers tp2|tp2-sp|cp2-zero3|tp2": (_plan("tiny-t5", [((0, 4), (0, 1), (
        S(tp=2), S(tp=2, sp=True), S(cp=2, zero=3), S(tp=2)))], 1, 4), 2),
    "t5 layers dp2|cp2-full|tp2-sp-selective|dp2": (_plan("tiny-t5", [((0, 4), (0, 1), (
        S(dp=2), S(cp=2, recompute="full"), S(tp=2, sp=True, recompute="selective"), S(dp=2)))], 1, 4), 2),
    "llava layers dp2|tp2|dp2-zero3|tp2|tp2-sp|cp2": (_plan("tiny-llava", [((0, 6), (0, 1), (
        S(dp=2), S(tp=2), S(dp=2, zero=3), S(tp=2), S(tp=2, sp=True), S(cp=2)))], 1, 4), 2),
    "t5 pp2 tp2-sp|dp2-zero3 then cp2|tp2-sp": (_plan("tiny-t5", [
        ((0, 2), (0, 1), (S(tp=2, sp=True), S(dp=2, zero=3))),
        ((2, 4), (2, 3), (S(cp=2), S(tp=2, sp=True)))], 4, 2), 4),
    "llava pp2 dp2|tp2 then dp2|tp2-sp|cp2-zero1": (_plan("tiny-llava", [
        ((0, 3), (0, 1), (S(dp=2), S(tp=2), S(tp=2))),
        ((3, 6), (2, 3), (S(dp=2), S(tp=2, sp=True), S(cp=2, zero=1)))], 4, 2), 4),
    "llava 4 ranks dp2tp2|dp4-zero2|tp2dp2|dp2tp2-sp|dp2cp2-zero3": (_plan("tiny-llava", [((0, 6), (0, 1, 2, 3), (
        S(dp=2, tp=2), S(dp=4, zero=2), S(dp=2, tp=2), S(dp=2, tp=2), S(dp=2, tp=2, sp=True),
        S(dp=2, cp=2, zero=3)))], 2, 4), 4),
}

CASES = {  # every numerics case by name: (ranks, model, plan or --strategy text)
    **{f"{m} {st}": (2, m, st) for st, m in TWO_RANKS},
    **{f"{m} {st}": (4, m, st) for st, m in FOUR_RANKS},
    **{name: (nproc, plan.model, plan) for name, (plan, nproc) in MIXED.items()},
}
SEARCH_MEMORY_GIB = (80.0, 0.76)  # everything fits (dp4) / memory is tight (t5: tp4+sp; llava: interleaved tp2)


def searched(model: str, memory_gib: float) -> tuple[Plan, list[Plan]]:
    """The plan the search picks for a tiny model on 4 ranks, and every plan it priced on the way."""
    from plait.planner.engine import search

    priced: list[Plan] = []
    result = search(PRESETS[model], local_ranks(4).with_memory(memory_gib), SEQ, 8, precision="fp32",
                    record=priced.append)
    assert result.plan is not None and priced
    return result.plan, priced


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text) -> dict[tuple[str, int], list[float]]:  # noqa: F811
    """Single-process loss curves by (model, global batch)."""
    return reference_losses(tmp_path_factory.mktemp("reference"), text, REFERENCE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> dict[int, tuple[subprocess.CompletedProcess, dict[str, list[float]]]]:  # noqa: F811
    """All numerics cases, one torchrun job per rank count."""
    out = {}
    for nproc in (2, 4):
        cases = {name: (model, plan) for name, (n, model, plan) in CASES.items() if n == nproc}
        if nproc == 4:
            cases |= {f"{m} searched at {gib} GiB": (m, searched(m, gib)[0]) for m in KIND_MODELS
                      for gib in SEARCH_MEMORY_GIB}
        out[nproc] = train_together(tmp_path_factory.mktemp(f"ranks{nproc}"), text, nproc, cases)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_plan_matches_single_process(runs, reference, name) -> None:
    """dp, ZeRO, tp, sp, Ulysses cp, pp (several schedules and cuts) and per-layer mixes on an encoder-decoder
    and a vision + text model train to the single-process losses."""
    nproc, model, plan = CASES[name]
    if isinstance(plan, Plan):
        assert unsupported(plan, PRESETS[model]) is None and plan.ranks[-1] == nproc - 1
    gbs = plan.global_batch if isinstance(plan, Plan) else _gbs(plan)
    assert_same(_losses(runs[nproc], name), reference[(model, gbs)])


@pytest.mark.parametrize("model", KIND_MODELS)
@pytest.mark.parametrize("memory_gib", SEARCH_MEMORY_GIB)
def test_searched_plans_are_executable_and_match(runs, reference, model, memory_gib) -> None:
    """Every plan the search prices for these models on 4 ranks is one the runtime executes, and the plan
    it picks reproduces the single-process losses."""
    plan, priced = searched(model, memory_gib)
    assert [unsupported(p, PRESETS[model]) for p in priced + [plan]] == [None] * (len(priced) + 1)
    assert_same(_losses(runs[4], f"{model} searched at {memory_gib} GiB"), reference[(model, 8)])


@pytest.mark.parametrize("model", KIND_MODELS)
def test_carried_elements_are_what_the_runtime_carries(model) -> None:
    """The cost model's elements per sample arriving at each layer (and at the head) are the runtime's."""
    from plait.models import build_model

    spec = PRESETS[model]
    net = build_model(spec)
    seen: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda _, args: seen.append(args[0][0].numel()))
             for layer in net.layers.values()]
    net.readout = lambda h, f=net.readout: (seen.append(h[0].numel()), f(h))[1]  # type: ignore[method-assign]
    with torch.no_grad():
        net(torch.randint(0, spec.vocab, (2, SEQ)))
    for hook in hooks:
        hook.remove()
    assert seen == [spec.carried_elements(i, SEQ) for i in range(spec.layers + 1)]


def test_what_the_runtime_refuses_names_the_cause() -> None:
    """sliding windows and MoE layers are built (tests/test_runtime_windows.py, tests/test_runtime_moe.py);
    the tower and projector split no tokens; ring attention is causal only; an image must leave text in the
    sequence."""
    assert unbuildable(PRESETS["tiny-t5"]) is None and unbuildable(PRESETS["tiny-llava"]) is None
    assert unbuildable(parse_inline("t5:encoder_layers=1,decoder_layers=1,hidden=64,heads=4,vocab=512")) is None
    assert unbuildable(parse_inline("gpt:layers=2,hidden=64,heads=4,vocab=512,vision=tiny-vit")) is None
    assert unbuildable(PRESETS["mistral-7b"]) is None and unbuildable(PRESETS["gemma2-9b"]) is None
    local_gpt = parse_inline("gpt:layers=4,hidden=64,heads=4,vocab=512,window=8,global_every=2")
    assert unbuildable(local_gpt) is None
    llava, t5 = PRESETS["tiny-llava"], PRESETS["tiny-t5"]
    assert "splits no tokens" in strategy_problem(S(tp=2, sp=True), llava.stack[3], 2, 2, SEQ)
    assert "splits no tokens" in strategy_problem(S(cp=2), llava.stack[3], 2, 2, SEQ)
    assert strategy_problem(S(tp=2, sp=True), llava.stack[4], 2, 2, SEQ) is None
    assert "cp_mode=ulysses" in strategy_problem(S(cp=2, cp_mode="ring"), t5.stack[0], 2, 2, SEQ)
    whole = _plan("tiny-llava", [((0, 6), (0, 1), (S(tp=2, sp=True),))], 1, 2)
    assert "layer 0 (patch_embed)" in unsupported(whole, llava)
    short = whole.model_copy(update={"seq_len": 16, "pipelines": (whole.pipelines[0].model_copy(update={
        "stages": (Stage(layers=(0, 6), ranks=(0, 1), strategies=(S(dp=2),)),)}),)})
    assert "leaves no text" in unsupported(short, llava)
    with pytest.raises(PlaitError, match=r"layer 0 \(patch_embed\)"):
        uniform_plan("tp=2,sp=1,gbs=4", llava, local_ranks(2), SEQ)


def test_train_and_plan_from_the_command_line(tmp_path, text) -> None:  # noqa: F811
    """`plait plan` writes a plan for tiny-t5 that `plait train` runs on 4 ranks."""
    plan = tmp_path / "plan.json"
    base = [sys.executable, "-m", "plait.cli"]
    proc = subprocess.run(base + ["plan", "--model", "tiny-t5", "--cluster", "1x4xA100-80GB",
                                  "--seq-len", str(SEQ), "-b", "8", "--precision", "fp32", "--out", str(plan)],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(base + ["train", "--model", "tiny-t5", "--plan", str(plan), "--nproc", "4", "--steps", "2",
                                  "--seq-len", str(SEQ), "--data", str(text), "--metrics-out", str(metrics)],
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1]
