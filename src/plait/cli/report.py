"""`plait report`: a self-contained HTML page of one plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from plait.cli.common import (ClusterOpt, MemoryOpt, ModelOpt, PlanOpt, ProfileOpt, SeqLenOpt, SlowOpt, StrategyOpt,
                              app, load_inputs, one_line_errors, out, plan_of)
from plait.cli.simulate import simulate_result
from plait.errors import PlaitError
from plait.io import output_path
from plait.plan import Plan, validate_plan
from plait.spec.cluster import Cluster
from plait.spec.model import ModelSpec


@app.command(name="report")
def report_cmd(
    model: ModelOpt,
    cluster: ClusterOpt,
    plan: PlanOpt = None,
    strategy: StrategyOpt = None,
    saved: Annotated[Path | None, typer.Option(
        "--from", help="a saved `plait simulate/plan --json` report whose numbers the page shows")] = None,
    seq_len: SeqLenOpt = None,
    out_file: Annotated[str, typer.Option("--out", help="the HTML page to write")] = "report.html",
    slow: SlowOpt = None,
    memory_gib: MemoryOpt = None,
    profile: ProfileOpt = None,
) -> None:
    """Write a self-contained HTML page of one plan: its stages, pipeline timeline, memory per device and time
    by cause (from a plan file, --strategy, or the plan a saved `plait plan --json` report holds)."""
    from plait.report import Alternative, read_saved, write_page

    with one_line_errors():
        page_path = output_path(out_file, "report.html", "--out")
        m, c, cal = load_inputs(model, cluster, memory_gib, slow, profile)
        result = read_saved(saved) if saved is not None else None
        p = _page_plan(result, saved, plan, strategy, m, c, seq_len)
        report, _, simulated = simulate_result(p, m, c, cal, True, bool(slow))
        shown = result.get("report", result) if result is not None else None
        write_page(page_path, "report", result or simulated, [Alternative("this plan", p, report, shown)], m, c)
    out.print(f"report page: {page_path}")


def _page_plan(result: dict | None, saved: Path | None, plan: Path | None, strategy: str | None, m: ModelSpec,
               c: Cluster, seq_len: int | None) -> Plan:
    """The plan the page shows: the one the saved report holds unless --plan or --strategy names one."""
    if result is not None and "plan" in result and plan is None and strategy is None:
        p = Plan.model_validate(result["plan"])
        validate_plan(p, m, c)
        return p
    if result is not None and plan is None and strategy is None:
        raise PlaitError(f"--from {str(saved)!r} holds no plan (a `plait simulate --json` report); give the "
                         "plan it simulated with --plan FILE or --strategy too")
    return plan_of(plan, strategy, m, c, seq_len)
