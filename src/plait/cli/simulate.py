"""`plait simulate`: predict the time, throughput and memory of one plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from plait.cli.common import (ClusterOpt, GalvatronProfileOpt, GalvatronSpOpt, JsonOpt, MemoryOpt, ModelOpt, PlanOpt,
                              ProfileOpt, ReportOpt, SeqLenOpt, SlowOpt, StrategyOpt, app, draw_picture, load_inputs,
                              one_line_errors, optional_output, out, plan_of, print_json)
from plait.cli.tables import fmt_s, print_report
from plait.plan import Plan
from plait.simulate import Report, simulate
from plait.spec.cluster import Cluster
from plait.spec.model import ModelSpec

TimelineOpt = Annotated[str | None, typer.Option("--timeline", help="write a timeline + memory picture")]


@app.command(name="simulate")
def simulate_cmd(
    model: ModelOpt,
    cluster: ClusterOpt,
    seq_len: SeqLenOpt = None,
    plan: PlanOpt = None,
    strategy: StrategyOpt = None,
    as_json: JsonOpt = False,
    timeline: TimelineOpt = None,
    slow: SlowOpt = None,
    memory_gib: MemoryOpt = None,
    galvatron_profile: GalvatronProfileOpt = None,
    galvatron_sp: GalvatronSpOpt = False,
    profile: ProfileOpt = None,
    report_out: ReportOpt = None,
) -> None:
    """Predict iteration time, throughput, MFU and memory of one plan (a plait plan, a Galvatron
    galvatron_config_*.json, or --strategy)."""
    with one_line_errors():
        timeline_path = optional_output(timeline, "timeline.png", "--timeline")
        page_path = optional_output(report_out, "report.html", "--report")
        m, c, cal = load_inputs(model, cluster, memory_gib, slow, profile, galvatron_profile, seq_len)
        p = plan_of(plan, strategy, m, c, seq_len, galvatron_sp)
        report, healthy, result = simulate_result(p, m, c, cal, timeline is not None or page_path is not None,
                                                  bool(slow))
        if page_path is not None:
            from plait.report import Alternative, write_page

            write_page(page_path, "simulate", result, [Alternative("this plan", p, report)], m, c)
        if timeline_path is not None:
            _draw_timeline(report, m, c, timeline_path, timeline)
    if as_json:
        print_json(result)
        return
    print_report(report, p, m, c)
    if healthy:
        out.print(f"with the slow devices: {fmt_s(report.iteration_time_s)} per iteration, "
                  f"{report.iteration_time_s / healthy.iteration_time_s:.2f}x the healthy cluster's "
                  f"{fmt_s(healthy.iteration_time_s)}; `plait plan --slow` re-plans around them")
    if timeline_path is not None:
        out.print(f"timeline and memory chart: {timeline_path}")
    if page_path is not None:
        out.print(f"report page: {page_path}")


def simulate_result(p: Plan, m: ModelSpec, c: Cluster, cal, record: bool, slow: bool
                    ) -> tuple[Report, Report | None, dict]:
    """(report, the report on the healthy cluster when `--slow` is given, the `--json` object)."""
    report = simulate(p, m, c, cal=cal, record=record)
    healthy = simulate(p, m, replace(c, speed=()), cal=cal) if slow else None
    extra = {"healthy_iteration_time_s": healthy.iteration_time_s} if healthy else {}
    return report, healthy, report.to_dict() | extra


def _draw_timeline(report: Report, m: ModelSpec, c: Cluster, path: Path, given: str) -> None:
    """`--timeline`: the first pipeline's timeline beside every device's memory by term."""
    from plait.viz import combined

    memory = [(f"p{d.pipeline}s{d.index}", {k: v for k, v in d.memory.as_dict().items()}) for d in report.devices]
    draw_picture(lambda: combined(
        report.pipelines[0], memory, c.gpu.memory_bytes, str(path),
        f"{m.name} on {c.name}: {report.iteration_time_s:.3f} s/iteration, MFU {report.mfu:.1%}"), given)
