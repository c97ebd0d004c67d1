"""`plait train --tasks FILE`: plan a task file's waves for this machine's ranks and run them
(`plait.runtime.multitask`), then print each task's loss per step and the measured timeline of the last step."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rich import box
from rich.markup import escape
from rich.table import Table

from plait.cli.common import out
from plait.cli.tables import ranks_text
from plait.errors import PlaitError

PLAN_GPU = "A100-80GB"
"""The device the waves are planned for: the runtime runs them on CPU ranks, where only the groups matter."""


def tasks_config(tasks: Path, nproc: int | None, steps: int, seed: int, lr: float, metrics_out: Path | None,
                 timeout_s: float, others: dict[str, object], checkpoint_dir: Path | None = None,
                 checkpoint_every: int = 0, resume_from: Path | None = None):
    """The MultitaskConfig of a `train --tasks` run on `nproc` ranks and its plan (PlaitError on bad input:
    a bad task file, options that do not apply, more groups than ranks, checkpoints it cannot write or
    read)."""
    from plait.planner.multitask.plan import plan_multitask
    from plait.runtime.multitask import MultitaskConfig, check_units, units_of
    from plait.spec.cluster import load_cluster
    from plait.spec.tasks import load_tasks

    given = [name for name, value in others.items() if value]
    if given:
        raise PlaitError(f"--tasks trains the task file's modules with its own plan; drop {', '.join(given)}")
    if steps <= 0 or (nproc is not None and nproc <= 0):
        raise PlaitError("--steps and --nproc must be positive")
    world = nproc or 1
    ts = load_tasks(tasks)
    plan = plan_multitask(ts, load_cluster(f"1x{world}x{PLAN_GPU}"), "fp32")
    units = units_of(plan)
    check_units(ts, units, world)
    _check_checkpoints(ts, checkpoint_dir, checkpoint_every, resume_from)
    cfg = MultitaskConfig(tasks=str(Path(tasks).resolve()), units=[_unit_dict(u) for u in units], steps=steps,
                          seed=seed, lr=lr, metrics_out=str(metrics_out) if metrics_out else None,
                          timeout_s=timeout_s, checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                          checkpoint_every=checkpoint_every, resume_from=str(resume_from) if resume_from else None)
    return cfg, world


def _check_checkpoints(tasks, directory: Path | None, every: int, resume_from: Path | None) -> None:
    """Before launching: --checkpoint-every has a directory to save into, which can be written, and the
    checkpoint to resume from is readable and holds this task file's model."""
    from plait.io import check_writable_dir
    from plait.runtime import checkpoint
    from plait.runtime.multitask import TasksIdentity

    if every < 0:
        raise PlaitError("--checkpoint-every must be >= 0")
    if every and directory is None:
        raise PlaitError("--checkpoint-every saves into --checkpoint-dir; give --checkpoint-dir DIR or drop "
                         "--checkpoint-every")
    identity = TasksIdentity.of(tasks)
    if resume_from is not None:
        checkpoint.check_resume_from(resume_from, identity)  # type: ignore[arg-type]
    if directory is not None:
        if directory.exists() and not directory.is_dir():
            raise PlaitError(f"--checkpoint-dir {str(directory)!r} is a file; give a directory")
        check_writable_dir(directory, "--checkpoint-dir")
        if resume_from is None:
            checkpoint.resumable(directory, identity, lambda line: None)  # type: ignore[arg-type]


def _unit_dict(unit) -> dict:
    from dataclasses import asdict

    return {**asdict(unit), "ranks": list(unit.ranks)}


def run_tasks(cfg, world: int, inside: bool) -> int:
    """Run `cfg` on `world` ranks and print its losses and timeline (rank 0); the job's exit code."""
    from dataclasses import replace

    from plait.cli.train import run_job
    from plait.runtime.nodes import Nodes

    with tempfile.TemporaryDirectory(prefix="plait-tasks.") as tmp:
        metrics = Path(cfg.metrics_out or os.path.join(tmp, "metrics.jsonl"))
        code = run_job(replace(cfg, metrics_out=str(metrics)), world, inside, 0, Nodes())
        if code == 0 and int(os.environ.get("RANK", "0")) == 0:
            print_run([json.loads(line) for line in metrics.read_text().splitlines() if line])
    return code


def print_run(records: list[dict]) -> None:
    """Each task's loss per step, then which group ran what when in the last step."""
    names = list(records[0]["losses"])
    losses = Table(title="loss per task", box=box.SIMPLE_HEAD)
    for col in ("step", *names, "step time"):
        losses.add_column(escape(col), justify="right")
    for r in records:
        losses.add_row(str(r["step"]), *(f"{r['losses'][n]:.6f}" for n in names), f"{r['step_time_s'] * 1e3:.1f} ms")
    out.print(losses)
    last = records[-1]
    spans = Table(title=f"measured timeline of step {last['step']} (each op on its group)", box=box.SIMPLE_HEAD)
    for col in ("stage", "op", "phase", "ranks", "layers", "start", "end"):
        spans.add_column(col, justify="left" if col in ("op", "phase") else "right")
    for e in last["timeline"]:
        spans.add_row(str(e["stage"]), escape(e["op"]), e["phase"], ranks_text(tuple(e["ranks"])),
                      f"{e['layers'][0]}-{e['layers'][1] - 1}", f"{e['start_s'] * 1e3:.1f} ms",
                      f"{e['end_s'] * 1e3:.1f} ms")
    out.print(spans)
