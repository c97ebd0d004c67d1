"""`plait train --tasks`: Spindle's waves run on gloo subgroups, against one process running the same tasks."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from helpers import assert_bad_input, expect_error, run_workers
from typer.testing import CliRunner

from plait.cli import app
from plait.planner.multitask.plan import plan_multitask
from plait.runtime.loop import lr_at
from plait.runtime.multitask import Handoff, MultitaskConfig, Unit, check_units, rows, units_of
from plait.runtime.multitask_model import reference_losses
from plait.spec.cluster import load_cluster
from plait.spec.tasks import load_tasks

TINY = Path(__file__).resolve().parents[1] / "src/plait/data/tiny-tasks.yaml"
STEPS = 3
LR = 1e-2  # large enough that the losses move from step to step


def _config(units: list[Unit], metrics: Path) -> MultitaskConfig:
    return MultitaskConfig(tasks=str(TINY), units=[{**asdict(u), "ranks": list(u.ranks)} for u in units],
                           steps=STEPS, lr=LR, metrics_out=str(metrics))


def _moved(units: list[Unit]) -> list[Unit]:
    """The planner's units with each trunk on other ranks than its encoder: activations and gradients cross
    between groups of different sizes (2 -> 2 elsewhere, 2 -> 3 overlapping)."""
    other = {(0, 1): (2, 3), (2, 3): (0, 1, 2)}
    return [replace(u, ranks=other[u.ranks]) if u.module == "trunk" else u for u in units]


def test_two_groups_run_at_once_and_train_like_one_process(tmp_path: Path) -> None:
    tasks = load_tasks(TINY)
    units = units_of(plan_multitask(tasks, load_cluster("1x4xA100-80GB"), "fp32"))
    stages = {u.stage for u in units}
    assert len(units) == 4 and len(stages) == 2
    for s in stages:  # every stage: both tasks at once, on groups of two ranks each
        assert sorted(u.ranks for u in units if u.stage == s) == [(0, 1), (2, 3)]
    paths = []
    for name, plan in (("planned", units), ("moved", _moved(units))):
        path = tmp_path / f"{name}.json"
        path.write_text(_config(plan, tmp_path / f"{name}.jsonl").to_json())
        paths.append(path)
    run_workers(paths, nproc=4)
    cfg = _config(units, tmp_path / "x")
    expected = reference_losses(tasks, STEPS, cfg.seed, lambda step: lr_at(step, cfg))
    assert abs(expected[-1][0] - expected[0][0]) > 1e-3  # the reference trains
    for name in ("planned", "moved"):
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert len(records) == STEPS
        for step, (record, want) in enumerate(zip(records, expected, strict=True)):
            got = [record["losses"][t.name] for t in tasks.tasks]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5, (name, step, got, want)
    for record in (json.loads(line) for line in (tmp_path / "planned.jsonl").read_text().splitlines()):
        for stage in stages:  # both groups' forward of the stage overlap in time
            spans = [(e["start_s"], e["end_s"]) for e in record["timeline"]
                     if e["stage"] == stage and e["phase"] == "forward"]
            assert len(spans) == 2 and max(a for a, _ in spans) < min(b for _, b in spans), (stage, spans)


def test_rows_and_handoff_pieces_cover_the_batch() -> None:
    assert [rows(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    h = Handoff(10, (2, 3), (0, 1, 2))
    assert h.pieces == [(2, 0, 0, 4), (2, 1, 4, 5), (3, 1, 5, 7), (3, 2, 7, 10)]


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
    wide = tmp_path / "w.yaml"
    wide.write_text(TINY.read_text().replace("hidden: 128", "hidden: 256", 1))
    assert_bad_input(runner.invoke(app, ["train", "--tasks", str(wide), "--nproc", "4"]), "same hidden")
    assert_bad_input(runner.invoke(app, ["train", "--tasks", str(TINY), "--model", "gpt2"]), "drop --model")
    assert_bad_input(runner.invoke(app, ["train", "--nproc", "2"]), "--tasks")


def test_train_tasks_cli_prints_losses_and_timeline(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "plait.cli", "train", "--tasks", str(TINY), "--nproc", "2", "--steps", "1",
           "--metrics-out", str(metrics)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss per task" in proc.stdout and "measured timeline" in proc.stdout
    (record,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert set(record["losses"]) == {"caption", "chat"}
    assert len(record["timeline"]) == 8  # four ops, forward and backward
