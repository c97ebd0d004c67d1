"""`plait multitask`: plan several tasks that share modules in waves of device groups (Spindle)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from plait.cli.common import (JsonOpt, PrecisionOpt, app, check_precision, draw_picture, one_line_errors,
                              optional_output, out, print_json, search_progress)
from plait.cli.tables import fmt_s, ranks_text
from plait.spec.cluster import Cluster, load_cluster


@app.command(name="multitask")
def multitask_cmd(
    tasks: Annotated[Path, typer.Option("--tasks", help="task file (YAML): modules, tasks, dependencies")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="NODESxGPUSxTYPE (e.g. 4x8xA100-80GB) or YAML")],
    precision: PrecisionOpt = "bf16",
    timeline: Annotated[str | None, typer.Option("--timeline", help="write a picture of the waves")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Plan several tasks that share modules in waves of device groups (Spindle), beside running the tasks
    one after another on all devices and all at once on FLOPs-proportional shares."""
    from plait.planner.multitask.plan import plan_multitask
    from plait.spec.tasks import load_tasks

    with one_line_errors():
        c = load_cluster(cluster)
        check_precision(precision)
        timeline_path = optional_output(timeline, "waves.png", "--timeline")
        ts = load_tasks(tasks)
        bar, update = search_progress("{}")
        with bar:
            result = plan_multitask(ts, c, precision, update)
        if timeline_path is not None:
            _draw_waves(result, c, f"{ts.name} on {c.name}", timeline_path, timeline)
    s, ops = result.schedule, result.graph.ops
    waves = _waves(result)
    if as_json:
        print_json({"step_time_s": s.makespan_s, "bound_s": s.bound_s, "waves": waves,
                    "baselines": result.baselines, "relocations": s.relocations,
                    "proportional_devices": list(result.proportional.devices),
                    "task_level_devices": list(result.task_level.devices)})
        return
    _print_waves(waves, f"{ts.name} on {c.name}: {len(ops)} MetaOps in {len(s.waves)} wave(s)")
    _print_summary(result)
    if timeline_path is not None:
        out.print(f"waves picture: {timeline_path}")


def _draw_waves(result, c: Cluster, title: str, path: Path, given: str) -> None:
    """`--timeline`: every wave's device groups over time."""
    from plait.viz import plot_waves

    s, ops = result.schedule, result.graph.ops
    boxes = [(ops[p.op].name, p.first, p.devices, st.start_s, p.seconds) for st in s.stages for p in st.placements]
    ends = [w.stages[-1].start_s + w.stages[-1].seconds for w in s.waves]
    draw_picture(lambda: plot_waves(boxes, c.world_size, ends, str(path), f"{title}: "
                                    f"{s.makespan_s:.3f} s/step in {len(s.waves)} wave(s)"), given)


def _waves(result) -> list[dict]:
    """The waves as plain data: their ops, stages and the device groups of each stage."""
    ops = result.graph.ops
    return [{"ops": [ops[i].name for i in w.ops], "bound_s": w.bound_s, "time_s": w.seconds,
             "stages": [{"start_s": st.start_s, "time_s": st.seconds,
                         "groups": [{"op": ops[p.op].name, "ranks": [p.first, p.first + p.devices - 1],
                                     "layers": p.layers, "time_s": p.seconds} for p in st.placements]}
                        for st in w.stages]} for w in result.schedule.waves]


def _print_waves(waves: list[dict], title: str) -> None:
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("wave", "stage", "start", "time", "groups (op: devices x layers)"):
        table.add_column(col, justify="left" if col.startswith("groups") else "right")
    for i, w in enumerate(waves):
        for j, st in enumerate(w["stages"]):
            groups = ", ".join(f"{g['op']}: {ranks_text(tuple(range(g['ranks'][0], g['ranks'][1] + 1)))} x "
                               f"{g['layers']}" for g in st["groups"])
            table.add_row(str(i) if not j else "", str(j), fmt_s(st["start_s"]), fmt_s(st["time_s"]),
                          escape(groups))
    out.print(table)


def _print_summary(result) -> None:
    """The waves' step time beside the continuous optimum and the other ways to run the tasks."""
    s = result.schedule
    summary = Table(box=box.SIMPLE_HEAD)
    for col in ("plan", "step time", "vs waves"):
        summary.add_column(col, justify="left" if col == "plan" else "right")
    rows = {"waves (Spindle)": s.makespan_s, "continuous optimum (sum over waves)": s.bound_s,
            "tasks one after another, all devices": result.sequential_s,
            f"tasks at once, FLOPs-proportional {result.proportional.devices}": result.proportional.makespan_s,
            f"tasks at once, task-level allocator {result.task_level.devices}": result.task_level.makespan_s}
    for name, seconds in rows.items():
        summary.add_row(escape(name), fmt_s(seconds), f"{seconds / s.makespan_s:.2f}x")
    out.print(summary)
