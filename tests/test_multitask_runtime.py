"""`plait train --tasks`: Spindle's waves run on gloo subgroups, against one process running the same tasks."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from helpers import assert_bad_input, expect_error, run_workers
from typer.testing import CliRunner

from plait.cli import app
from plait.planner.multitask.plan import plan_multitask
from plait.runtime.loop import lr_at
from plait.layout import Layout
from plait.runtime.multitask import Handoff, MultitaskConfig, Unit, check_units, units_of
from plait.runtime.multitask_model import reference_losses, reference_steps
from plait.spec.cluster import load_cluster
from plait.spec.tasks import load_tasks

TINY = Path(__file__).resolve().parents[1] / "src/plait/data/tiny-tasks.yaml"
WIDTHS = Path(__file__).resolve().parent / "data/widths-tasks.yaml"
"""A 32-wide encoder feeding a 64-wide trunk (through the trunk's projection) and a 64-wide one feeding it."""
BIND = Path(__file__).resolve().parents[1] / "src/plait/data/tiny-bind-tasks.yaml"
"""Two tasks that each end in two modules (a shared image tower beside a text or an audio tower)."""
SMALL_BIND = Path(__file__).resolve().parent / "data/imagebind-small-tasks.yaml"
"""imagebind-tasks.yaml's modules and tasks (five, each ending in two towers) at a size CPU ranks train."""
BIND_FORCED = {"image-text/text": {"ranks": (0, 1), "tp": 2}, "image-audio/audio": {"ranks": (2, 3), "cp": 2}}
"""The towers the planner puts on one rank each, spread over two (tp2; cp2) beside the image tower's layer."""
STEPS = 3
LR = 1e-2  # large enough that the losses move from step to step


CLIP = 0.3  # below every step's gradient norm (0.54 to 0.76): each step clips
FORCED = {"caption/image": {"tp": 2}, "caption/trunk": {"tp": 2, "sp": True}, "chat/text": {"cp": 2}}
"""Strategies inside the groups the planner does not pick for models this small (it picks dp=2 everywhere):
caption's encoder tp2 hands copies to its trunk's tp2 with sequence parallelism (copies -> token shards),
chat's encoder cp2 hands token chunks to its data-parallel trunk (tokens -> rows, across ranks)."""


def _config(units: list[Unit], metrics: Path, tasks: Path = TINY, **extra: object) -> MultitaskConfig:
    return MultitaskConfig(tasks=str(tasks), units=[{**asdict(u), "ranks": list(u.ranks)} for u in units],
                           steps=STEPS, lr=LR, metrics_out=str(metrics), **extra)  # type: ignore[arg-type]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_like_one_process(tmp_path: Path, names: tuple[str, ...], tasks, reference: list) -> None:
    """Each run's every task loss within 1e-5 of one process's at every step, and its gradient norm within 1e-5
    relative (`reference`: per step, the losses and the norm, None: not compared)."""
    for name in names:
        records = _records(tmp_path / f"{name}.jsonl")
        assert len(records) == STEPS
        for step, (record, (want, norm)) in enumerate(zip(records, reference, strict=True)):
            got = [record["losses"][t.name] for t in tasks.tasks]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5, (name, step, got, want)
            if norm is not None:
                assert abs(record["grad_norm"] - norm) <= 1e-5 * norm, (name, step, record["grad_norm"], norm)


def _moved(units: list[Unit]) -> list[Unit]:
    """The planner's units with each trunk on other ranks than its encoder: activations and gradients cross
    between groups of different sizes (2 -> 2 elsewhere, 2 -> 3 overlapping)."""
    other = {(0, 1): (2, 3), (2, 3): (0, 1, 2)}
    return [replace(u, ranks=other[u.ranks]) if u.module == "trunk" else u for u in units]


def test_two_groups_run_at_once_and_train_like_one_process(tmp_path: Path) -> None:
    tasks = load_tasks(TINY)
    units = units_of(plan_multitask(tasks, load_cluster("1x4xA100-80GB"), "fp32"))
    widths = load_tasks(WIDTHS)
    wide_units = units_of(plan_multitask(widths, load_cluster("1x4xA100-80GB"), "fp32"))
    swapped = [replace(u, ranks=(2, 3), tp=2) if u.op == "caption/trunk"  # 32 wide from (0, 1), tp copies
               else replace(u, ranks=(0, 1)) if u.op == "chat/trunk"  # 64 wide from (2, 3)
               else u for u in wide_units]
    assert [u.ranks for u in wide_units if u.module == "trunk"] == [(0, 1), (2, 3)]
    check_units(widths, swapped, 4)
    stages = {u.stage for u in units}
    assert len(units) == 4 and len(stages) == 2
    for s in stages:  # every stage: both tasks at once, on groups of two ranks each
        assert sorted(u.ranks for u in units if u.stage == s) == [(0, 1), (2, 3)]
    forced = [replace(u, **FORCED.get(u.op, {})) for u in units]
    check_units(tasks, forced, 4)
    saved = tmp_path / "ckpt"
    configs = {"planned": _config(units, tmp_path / "planned.jsonl"),
               "moved": _config(_moved(units), tmp_path / "moved.jsonl"),
               "forced": _config(forced, tmp_path / "forced.jsonl", clip=CLIP, checkpoint_dir=str(saved),
                                 checkpoint_every=2),
               "resumed": _config(forced, tmp_path / "resumed.jsonl", clip=CLIP,
                                  resume_from=str(saved / "step-2")),
               "widths": _config(wide_units, tmp_path / "widths.jsonl", WIDTHS),
               "swapped": _config(swapped, tmp_path / "swapped.jsonl", WIDTHS)}
    binds = load_tasks(BIND)
    bind_units = units_of(plan_multitask(binds, load_cluster("1x4xA100-80GB"), "fp32"))
    bind_forced = [replace(u, **BIND_FORCED.get(u.op, {})) for u in bind_units]
    check_units(binds, bind_forced, 4)
    bind_saved = tmp_path / "bind-ckpt"
    configs |= {"bind": _config(bind_units, tmp_path / "bind.jsonl", BIND),
                "bind_forced": _config(bind_forced, tmp_path / "bind_forced.jsonl", BIND, clip=CLIP,
                                       checkpoint_dir=str(bind_saved), checkpoint_every=2),
                "bind_resumed": _config(bind_forced, tmp_path / "bind_resumed.jsonl", BIND, clip=CLIP,
                                        resume_from=str(bind_saved / "step-2"))}
    paths = []
    for name, cfg in configs.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(cfg.to_json())
    run_workers(paths, nproc=4)
    cfg = configs["planned"]
    expected = reference_losses(tasks, STEPS, cfg.seed, lambda step: lr_at(step, cfg), cfg.clip)
    assert abs(expected[-1][0] - expected[0][0]) > 1e-3  # the reference trains
    clipped = reference_steps(tasks, STEPS, cfg.seed, lambda step: lr_at(step, cfg), CLIP)
    assert abs(clipped[-1][0][0] - expected[-1][0]) > 1e-4  # clipping changes the losses
    _assert_like_one_process(tmp_path, ("forced",), tasks, clipped)
    forced_records = _records(tmp_path / "forced.jsonl")
    (resumed,) = _records(tmp_path / "resumed.jsonl")
    assert resumed["step"] == 2 and sorted(p.name for p in saved.iterdir()) == ["step-2", "step-3"]
    for name in resumed["losses"]:  # resuming from step 2 equals the run that went on
        assert abs(resumed["losses"][name] - forced_records[2]["losses"][name]) <= 1e-6
    _assert_like_one_process(tmp_path, ("planned", "moved"), tasks, [(want, None) for want in expected])
    cfg = configs["widths"]
    wide = reference_steps(widths, STEPS, cfg.seed, lambda step: lr_at(step, cfg), cfg.clip)
    assert abs(wide[-1][0][0] - wide[0][0][0]) > 1e-3  # the reference trains, the projection with it
    _assert_like_one_process(tmp_path, ("widths", "swapped"), widths, wide)
    cfg = configs["bind"]
    bound = reference_steps(binds, STEPS, cfg.seed, lambda step: lr_at(step, cfg), cfg.clip)
    assert abs(bound[-1][0][0] - bound[0][0][0]) > 1e-3  # the reference trains
    _assert_like_one_process(tmp_path, ("bind",), binds, bound)  # each task: its heads' mean
    bound_clipped = reference_steps(binds, STEPS, cfg.seed, lambda step: lr_at(step, cfg), CLIP)
    assert abs(bound_clipped[-1][0][0] - bound[-1][0][0]) > 1e-5  # every step clips (norms 0.73 to 0.74)
    _assert_like_one_process(tmp_path, ("bind_forced",), binds, bound_clipped)
    (bind_resumed,) = _records(tmp_path / "bind_resumed.jsonl")  # the four heads saved and restored
    went_on = _records(tmp_path / "bind_forced.jsonl")[2]
    assert bind_resumed["step"] == 2 and bind_resumed["losses"] == went_on["losses"]  # bit-equal
    overlaps = []  # per step and stage: do both groups' forwards overlap in time?
    for record in _records(tmp_path / "planned.jsonl") + _records(tmp_path / "forced.jsonl"):
        for stage in stages:
            spans = [(e["start_s"], e["end_s"]) for e in record["timeline"]
                     if e["stage"] == stage and e["phase"] == "forward"]
            assert len(spans) == 2, (stage, spans)
            overlaps.append(max(a for a, _ in spans) < min(b for _, b in spans))
    # Four ranks on two cores may run one group after the other in a given step; groups that waited on each
    # other would never overlap.
    assert any(overlaps), overlaps


def test_handoff_pieces_cover_the_batch_in_the_consumers_layout() -> None:
    assert [Layout(dp=3).piece(i, 10, 8)[0] for i in range(3)] == [(0, 4), (4, 7), (7, 10)]

    def unit(ranks: tuple[int, ...], **degrees: object) -> Unit:
        return Unit("op", 0, "trunk", 0, 1, ranks, 0, **degrees)  # type: ignore[arg-type]

    def moves(h: Handoff, forward: bool = True) -> list[tuple]:
        return [(s, r, b.batch, b.tokens) for s, r, b in h.pieces(forward)]

    assert moves(Handoff(10, 8, unit((2, 3)), unit((0, 1, 2)))) == [
        (2, 0, (0, 4), (0, 8)), (2, 1, (4, 5), (0, 8)), (3, 1, (5, 7), (0, 8)), (3, 2, (7, 10), (0, 8))]
    copies_to_shards = Handoff(4, 8, unit((0, 1), tp=2), unit((0, 1), tp=2, sp=True))
    assert moves(copies_to_shards) == [(0, 0, (0, 4), (0, 4)), (1, 1, (0, 4), (4, 8))]  # nothing crosses
    assert moves(copies_to_shards, False) == [(0, 0, (0, 4), (0, 4)), (1, 0, (0, 4), (4, 8)),
                                              (0, 1, (0, 4), (0, 4)), (1, 1, (0, 4), (4, 8))]  # each copy whole
    chunks_to_rows = Handoff(4, 8, unit((2, 3), cp=2), unit((2, 3)))
    assert moves(chunks_to_rows) == [(2, 2, (0, 2), (0, 4)), (3, 2, (0, 2), (4, 8)),
                                     (2, 3, (2, 4), (0, 4)), (3, 3, (2, 4), (4, 8))]


def test_planner_strategies_reach_the_units() -> None:
    tasks = load_tasks(TINY)
    plan = plan_multitask(tasks, load_cluster("1x4xA100-80GB"), "fp32")
    for u in units_of(plan):
        s = plan.curves[next(i for i, op in enumerate(plan.graph.ops) if op.name == u.op)].strategy(len(u.ranks))
        assert s is not None and (u.tp, u.cp, u.sp) == (s.tp, s.cp, s.sp and s.tp > 1)
    units = units_of(plan)
    bad = [replace(u, tp=2, cp=2) if u.op == "chat/text" else u for u in units]
    expect_error(lambda: check_units(tasks, bad, 4), "chat/text", "tp=2 x cp=2 on 2 ranks")
    ring = [replace(u, cp=2, cp_mode="ring") if u.op == "chat/text" else u for u in units]
    expect_error(lambda: check_units(tasks, ring, 4), "ring attention is causal")


def test_units_that_do_not_fit_the_ranks_say_so() -> None:
    tasks = load_tasks(TINY)
    units = units_of(plan_multitask(tasks, load_cluster("1x4xA100-80GB"), "fp32"))
    expect_error(lambda: check_units(tasks, units, 2), "more than the 2 ranks", "--nproc")
    expect_error(lambda: check_units(tasks, units[2:], 4), "no earlier op ran")


def test_train_tasks_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text(TINY.read_text().replace("dropout: false}", "dropout: false, colour: red}", 1))
    runner = CliRunner()
    assert_bad_input(runner.invoke(app, ["train", "--tasks", str(bad), "--nproc", "4"]), "colour")
    assert_bad_input(runner.invoke(app, ["train", "--tasks", str(TINY), "--model", "gpt2"]), "drop --model")
    assert_bad_input(runner.invoke(app, ["train", "--nproc", "2"]), "--tasks")
    assert_bad_input(runner.invoke(app, ["train", "--tasks", str(TINY), "--nproc", "4", "--checkpoint-every", "2"]),
                     "give --checkpoint-dir")
    assert_bad_input(runner.invoke(app, ["train", "--tasks", str(TINY), "--nproc", "4", "--resume-from",
                                         str(tmp_path / "none")]), "not a directory")


def test_train_tasks_cli_prints_losses_and_timeline(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "plait.cli", "train", "--tasks", str(TINY), "--nproc", "2", "--steps", "1",
           "--metrics-out", str(metrics), "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss per task" in proc.stdout and "measured timeline" in proc.stdout
    (record,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert set(record["losses"]) == {"caption", "chat"}
    assert len(record["timeline"]) == 8  # four ops, forward and backward
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-1"]  # saved after the last step


def test_a_task_ending_in_two_modules_has_a_head_after_each_and_the_mean_of_their_losses() -> None:
    import torch.nn.functional as F

    from plait.runtime.multitask_model import VOCAB, TaskModel, batch, task_loss

    tasks = load_tasks(BIND)
    model = TaskModel(tasks, seed=0)
    assert list(model.head) == ["0:image", "0:text", "1:image", "1:audio"]
    assert [model.head[k][1].in_features for k in model.head] == [32, 64, 32, 32]  # each its tower's width
    tokens = batch(tasks, 0, step=0, seed=0)
    heads = []
    for module, key in (("image", "0:image"), ("text", "0:text")):
        x = model.enter(0, module, [model.embed_tokens(0, tokens)])  # text projects the 32-wide embedding
        x = model.layers(0, module, 0, len(tasks.module(module).stack), x)
        logits = model.head[key](x)
        heads.append(F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item())
    assert heads[0] != heads[1]
    assert task_loss(model, 0, tokens).item() == pytest.approx((heads[0] + heads[1]) / 2, rel=1e-6)


def test_imagebind_plans_pass_the_runtime_load_checks() -> None:
    """The shipped ImageBind task file (every task ends in two towers) at full size: the planner's plans for
    4 ranks pass `plait train --tasks`'s load-time checks (tiny-bind-tasks.yaml trains the same shape above)."""
    from plait.runtime.multitask_model import sinks

    tasks = load_tasks(Path(__file__).resolve().parents[1] / "src/plait/data/imagebind-tasks.yaml")
    assert [sinks(t) for t in tasks.tasks][0] == ["vision", "text"]
    for gpu in ("A100-80GB", "H100-80GB"):
        graph = check_units(tasks, units_of(plan_multitask(tasks, load_cluster(f"1x4x{gpu}"), "fp32")), 4)
        assert sum(graph.last) == 2 * len(tasks.tasks)  # one unit before each of the ten heads
    small = load_tasks(SMALL_BIND)  # what docs/multitask.md trains from the command line
    def shape(ts):
        return [(t.name, t.modules, t.inputs) for t in ts.tasks]

    assert shape(small) == shape(tasks)
    assert [m.name for m in small.modules] == [m.name for m in tasks.modules]
    graph = check_units(small, units_of(plan_multitask(small, load_cluster("1x4xA100-80GB"), "fp32")), 4)
    assert sum(graph.last) == 10
