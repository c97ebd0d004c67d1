"""`plait plan`: search the fastest plan that fits (or run a baseline planner), and compare."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from plait.cli.common import (MAX_GLOBAL_BATCH, ClusterOpt, GalvatronProfileOpt, GalvatronSpOpt, JsonOpt, MemoryOpt,
                              ModelOpt, PrecisionOpt, ProfileOpt, SeqLenOpt, SlowOpt, app, check_precision,
                              load_inputs, one_line_errors, optional_output, out, print_json, search_progress,
                              warnings_as_notes)
from plait.cli.tables import fmt_s, print_plan, print_report
from plait.errors import PlaitError
from plait.io import write_files
from plait.plan import Plan
from plait.simulate import Report, simulate
from plait.spec.cluster import GIB, Cluster
from plait.spec.model import ModelSpec

if TYPE_CHECKING:
    from plait.planner.baselines import Candidate
    from plait.report import Alternatives

GalvatronOutOpt = Annotated[str | None, typer.Option(
    "--galvatron-out", help="also write the plan as a Galvatron galvatron_config JSON")]
GalvatronExpressibleOpt = Annotated[bool, typer.Option(
    "--galvatron-expressible", help="only plans a Galvatron 2.4.0 strategy file can say (see --galvatron-out)")]
PlanReportOpt = Annotated[str | None, typer.Option(
    "--report", help="also write an HTML report page (with the search's Pareto alternatives)")]
ExpertLoadOpt = Annotated[float, typer.Option(
    "--expert-load", help="MoE layers: routed tokens of the busiest expert rank over the mean (1: balanced)")]
LshOpt = Annotated[bool, typer.Option(
    "--lsh", help="MoE layers with expert parallelism may send LSH-MoE centroids instead of every token "
                  "(changes the model's numerics)")]
RecomputeModulesOpt = Annotated[bool, typer.Option(
    "--recompute-modules", help="layers that recompute nothing may also drop Megatron-LM's recompute "
                                "modules' (norms, experts' activation, latent up-projections, dense MLP) and "
                                "run them again in backward (searches ~30% longer)")]
HostMemoryOpt = Annotated[bool, typer.Option(
    "--host-memory", help="also search swapping activations to host (swap 0.5, 1), offloading the "
                          "optimizer to the host CPU and paging parameters in from it (offload=optim, "
                          "params), within the nodes' host memory, and from their NVMe where the host "
                          "cannot hold the states (offload=nvme)")]


@dataclass(frozen=True)
class _Problem:
    """What is planned: the model on the cluster (with its calibration), sequences, batch and precision."""
    m: ModelSpec
    c: Cluster
    cal: object
    seq: int
    global_batch: int
    precision: str
    expert_load: float = 1.0
    lsh: bool = False
    recompute_modules: bool = False  # the search may choose recompute modules per layer
    galvatron: bool = False  # only plans Galvatron can run
    galvatron_sp: bool = False  # ... launched with --sequence-parallel


@dataclass
class _Found:
    """The plan chosen (None when nothing fits), the closest one, the planning time, the re-planning around
    slow devices and the baselines run to compare."""
    chosen: Candidate | None
    closest: Candidate | None
    elapsed: float
    straggler: dict | None = None
    baselines: dict[str, Candidate | None] = field(default_factory=dict)


@app.command(name="plan")
def plan_cmd(
    model: ModelOpt,
    cluster: ClusterOpt,
    global_batch: Annotated[int, typer.Option("--global-batch", "-b", help="sequences per optimizer step")],
    seq_len: SeqLenOpt = None,
    out_path: Annotated[str | None, typer.Option("--out", help="write the plan (JSON, or YAML by suffix)")] = None,
    as_json: JsonOpt = False,
    baseline: Annotated[str | None, typer.Option("--baseline", help="dp | zero3 | megatron-grid")] = None,
    compare: Annotated[bool, typer.Option("--compare", help="also run the baselines, side by side")] = False,
    memory_gib: MemoryOpt = None,
    slow: SlowOpt = None,
    precision: PrecisionOpt = "bf16",
    galvatron_profile: GalvatronProfileOpt = None,
    galvatron_out: GalvatronOutOpt = None,
    galvatron_expressible: GalvatronExpressibleOpt = False,
    galvatron_sp: GalvatronSpOpt = False,
    profile: ProfileOpt = None,
    report_out: PlanReportOpt = None,
    host_memory: HostMemoryOpt = False,
    expert_load: ExpertLoadOpt = 1.0,
    lsh: LshOpt = False,
    recompute_modules: RecomputeModulesOpt = False,
) -> None:
    """Search the fastest plan that fits (or run a baseline planner)."""
    from plait.report import Alternatives

    with one_line_errors():
        plan_file = optional_output(out_path, "plan.json", "--out")
        page_path = optional_output(report_out, "report.html", "--report")
        collected = Alternatives() if page_path is not None else None
        galvatron_file = optional_output(galvatron_out, "galvatron_config.json", "--galvatron-out")
        m, c, cal = load_inputs(model, cluster, memory_gib, slow, profile, galvatron_profile, seq_len)
        seq = seq_len if seq_len is not None else m.max_seq_len
        _check_options(seq, global_batch, baseline, precision, expert_load)
        _check_galvatron(galvatron_expressible, galvatron_file is not None, galvatron_sp, baseline, bool(slow),
                         lsh or recompute_modules or host_memory, precision)
        problem = _Problem(m, c, cal, seq, global_batch, precision, expert_load, lsh, recompute_modules,
                           galvatron_expressible, galvatron_sp)
        found = _find(problem, baseline, compare, bool(slow), host_memory, collected)
        if found.chosen is None:
            raise _nothing_fits(problem, found.closest, host_memory)
        chosen = replace(found.chosen, plan=found.chosen.plan.stamped(m))
        obj = _plan_json(chosen, found, compare)
        _write_outputs(problem, chosen, obj, found, plan_file, galvatron_file, page_path, collected)
    if as_json:
        print_json(obj)
        return
    _print_result(problem, chosen, found, baseline, compare, plan_file, page_path, galvatron_file)


def _check_galvatron(expressible: bool, exported: bool, sequence_parallel: bool, baseline: str | None, slow: bool,
                     beyond: bool, precision: str) -> None:
    """--galvatron-expressible restricts the search; options that plan otherwise are refused with it, and so
    is a precision Galvatron does not train in (with it or --galvatron-out)."""
    from plait.galvatron import GALVATRON_PRECISIONS

    if (expressible or exported) and precision not in GALVATRON_PRECISIONS:
        raise PlaitError(f"Galvatron trains in {', '.join(GALVATRON_PRECISIONS)}, not {precision}; drop "
                         "--precision or the Galvatron options")
    if sequence_parallel and not expressible:
        raise PlaitError("--galvatron-sequence-parallel says how Galvatron will run the searched plan; give it "
                         "with --galvatron-expressible")
    if expressible:
        for given, option in ((baseline is not None, "--baseline"), (slow, "--slow"),
                              (beyond, "--lsh, --recompute-modules or --host-memory")):
            if given:
                raise PlaitError(f"--galvatron-expressible restricts the search, which {option} goes beyond; "
                                 f"drop one of them")


def _check_options(seq: int, global_batch: int, baseline: str | None, precision: str, expert_load: float) -> None:
    import math

    from plait.planner.baselines import BASELINES

    if not 1.0 <= expert_load < math.inf:
        raise PlaitError(f"--expert-load must be a number >= 1 (the busiest expert rank's routed tokens over the "
                         f"mean), got {expert_load}")

    if seq <= 0 or global_batch <= 0:
        raise PlaitError(f"--seq-len and --global-batch must be positive, got {seq} and {global_batch}")
    if global_batch > MAX_GLOBAL_BATCH:
        raise PlaitError(f"--global-batch {global_batch} is more sequences than plait searches "
                         f"({MAX_GLOBAL_BATCH}); plan a smaller batch (fewer, longer sequences)")
    if baseline is not None and baseline not in BASELINES:
        raise PlaitError(f"--baseline {baseline!r} is unknown; choose one of {', '.join(BASELINES)}")
    check_precision(precision)


def _find(q: _Problem, baseline: str | None, compare: bool, slow: bool, host_memory: bool,
          collected: Alternatives | None) -> _Found:
    """Plan under a progress bar: the search (re-planned around slow devices) or the baseline planner, and
    with `compare` every baseline planner too."""
    from plait.planner.baselines import BASELINES, run_baseline

    bar, update = search_progress()
    with bar:
        if baseline is not None:
            found = _run_baseline(q, baseline, update)
        else:
            found = _search(q, slow, host_memory, collected, update)
        if compare:
            for kind in BASELINES:
                b, _ = run_baseline(kind, q.m, q.c, q.seq, q.global_batch,
                                    progress=lambda d, t, k=kind: update(k, d, t), cal=q.cal,
                                    expert_load=q.expert_load)
                found.baselines[kind] = b
    return found


def _run_baseline(q: _Problem, baseline: str, update) -> _Found:
    import time

    from plait.planner.baselines import run_baseline

    t0 = time.perf_counter()
    best, _ = run_baseline(baseline, q.m, q.c, q.seq, q.global_batch, progress=lambda d, t: update(baseline, d, t),
                           cal=q.cal, expert_load=q.expert_load)
    chosen = best if best is not None and best.report.fits else None
    return _Found(chosen, best, time.perf_counter() - t0)


def _search(q: _Problem, slow: bool, host_memory: bool, collected: Alternatives | None, update) -> _Found:
    """The search on the healthy cluster; with slow devices, the plan re-shaped around them."""
    import math

    from plait.planner.engine import DEFAULT_LIMITS, search
    from plait.planner.space import HIERARCHY, SpaceLimits

    healthy = replace(q.c, speed=()) if slow else q.c
    limits = replace(DEFAULT_LIMITS, **HIERARCHY) if host_memory else DEFAULT_LIMITS
    if q.lsh:
        limits = replace(limits, moe_comm=("alltoall", "lsh"))
    if q.recompute_modules:
        limits = replace(limits, recompute_modules=True)
    spaces: list[tuple[SpaceLimits, Callable[[Plan], bool] | None]] = [(limits, None)]
    if q.galvatron:  # once per Galvatron default_dp_type (one for the whole model); the faster plan wins
        from plait.galvatron import DEFAULT_DP_TYPES, expressible, galvatron_limits

        spaces = [(galvatron_limits(limits, q.galvatron_sp, t), expressible(q.m, q.galvatron_sp))
                  for t in DEFAULT_DP_TYPES]
    results = [search(q.m, healthy, q.seq, q.global_batch, precision=q.precision, progress=update, cal=q.cal,
                      record=collected.record if collected else None, limits=space,
                      expert_load=q.expert_load, restrict=restrict) for space, restrict in spaces]
    result = min(results, key=lambda r: r.report.iteration_time_s if r.report and r.report.fits else math.inf)
    result = replace(result, search_time_s=sum(r.search_time_s for r in results))
    chosen = None
    if result.plan is not None:
        chosen = min((x for x in (result.best_layerwise, result.best_uniform) if x is not None and x.report.fits),
                     key=lambda x: x.key)
    found = _Found(chosen, result.closest, result.search_time_s)
    if slow and chosen is not None:
        found.chosen, found.straggler = _replan_around_stragglers(q, chosen, update)
        found.elapsed += found.straggler["solve_time_s"]
    return found


def _replan_around_stragglers(q: _Problem, healthy: Candidate, update) -> tuple[Candidate, dict]:
    """The plan shaped around `c`'s slow devices (Malleus), and what it is worth: the healthy cluster's
    plan on the healthy and on the slow cluster (static), and the re-planned one."""
    from plait.planner.baselines import Candidate
    from plait.planner.straggler import plan_around_stragglers

    static = simulate(healthy.plan, q.m, q.c, cal=q.cal)
    result = plan_around_stragglers(q.m, q.c, q.seq, q.global_batch, precision=q.precision, cal=q.cal,
                                    current=healthy.plan, progress=update)
    chosen = Candidate(result.plan, result.report, result.label) if result.plan is not None else \
        Candidate(healthy.plan, static, "current plan")
    summary = {"no_straggler_time_s": healthy.report.iteration_time_s, "static_time_s": static.iteration_time_s,
               "replanned_time_s": chosen.report.iteration_time_s, "replanned": chosen.label,
               "moved_layers": result.moved_layers, "migration_s": result.migration_s,
               "solve_time_s": result.solve_time_s}
    return chosen, summary


def _nothing_fits(q: _Problem, closest: Candidate | None, host_memory: bool) -> PlaitError:
    """The error when no plan fits: what the closest one needs, how many GPUs would do, and (when the search
    kept to device memory) the memory below the device."""
    from plait.planner.engine import fewest_gpus

    c = q.c
    need = f"the closest plan needs {closest.report.peak_memory_gib:.1f} GiB per device" if closest else \
        "no layout is possible"
    more = fewest_gpus(q.m, c, q.seq, q.global_batch)
    gpus = f"; {more} GPUs would fit (e.g. --cluster {more // c.gpus_per_node}x{c.gpus_per_node}x" \
        f"{c.gpu.name})" if more else ""
    below = "" if host_memory else "; or add --host-memory to use host memory and NVMe"
    return PlaitError(f"nothing fits in {c.gpu.memory_bytes / GIB:.1f} GiB per device: {need}{gpus}{below}; "
                      "or lower --global-batch / --seq-len")


def _plan_json(chosen: Candidate, found: _Found, compare: bool) -> dict:
    """The `--json` object: the plan, its report, the planning time (and the baselines, the stragglers)."""
    obj = {"plan": json.loads(chosen.plan.model_dump_json()), "report": chosen.report.to_dict(),
           "search_time_s": found.elapsed}
    if compare:
        obj["baselines"] = {k: (b.report.to_dict() | {"strategy": b.label.split(": ", 1)[1]}) if b else None
                            for k, b in found.baselines.items()}
    if found.straggler:
        obj["straggler"] = found.straggler
    return obj


def _write_outputs(q: _Problem, chosen: Candidate, obj: dict, found: _Found, plan_file: Path | None,
                   galvatron_file: Path | None, page_path: Path | None, collected: Alternatives | None) -> None:
    """Write the files asked for (the Galvatron config, the plan, the report page) all or none."""
    files: list[tuple[Path, str]] = []
    if galvatron_file is not None:
        from plait.galvatron import galvatron_config

        try:
            with warnings_as_notes():
                config = galvatron_config(chosen.plan, q.m)
        except PlaitError as exc:
            raise PlaitError(f"--galvatron-out: the plan found cannot be written for Galvatron: {exc}; search "
                             "with --galvatron-expressible for plans it can run") from None
        files.append((galvatron_file, json.dumps(config, indent=4)))
    if plan_file is not None:
        files.append((plan_file, chosen.plan.file_text(plan_file)))
    if page_path is not None:
        from plait.report import plan_page

        files.append((page_path, plan_page(obj, chosen, found.baselines, collected, q.m, q.c, q.cal)))
    write_files(files)


def _print_result(q: _Problem, chosen: Candidate, found: _Found, baseline: str | None, compare: bool,
                  plan_file: Path | None, page_path: Path | None, galvatron_file: Path | None = None) -> None:
    from plait.executable import unsupported

    print_plan(chosen.plan, q.c.world_size)
    print_report(chosen.report, chosen.plan, q.m, q.c)
    if found.straggler:
        _print_straggler(found.straggler)
    if (reason := unsupported(chosen.plan, q.m)) is not None:
        out.print(f"[yellow]note:[/] `plait train` cannot run this plan ({reason})")
    if galvatron_file is not None:
        from plait.galvatron import launch_flags

        out.print(f"Galvatron config written to {galvatron_file}; launch Galvatron with "
                  f"{' '.join(launch_flags(chosen.plan))}")
    out.print(f"searched in {found.elapsed:.2f} s" + (f"; plan written to {plan_file}" if plan_file else "")
              + (f"; report page: {page_path}" if page_path else ""))
    if compare:
        _print_comparison(chosen, found.baselines, baseline)


def _print_comparison(chosen: Candidate, baselines: dict[str, Candidate | None], baseline: str | None) -> None:
    table = Table(title="search vs baselines (speed-up = baseline time / this time)", box=box.SIMPLE_HEAD)
    for col in ("planner", "layout", "iteration", "tokens/s", "MFU", "peak GiB", "fits", "speed-up"):
        table.add_column(col, justify="left" if col in ("planner", "layout") else "right", no_wrap=True)
    ref = chosen.report.iteration_time_s
    table.add_row(*_summary_row("plait search" if baseline is None else baseline, chosen.report, chosen.plan, ref))
    for kind, b in baselines.items():
        if b is None:
            table.add_row(kind, "no valid layout", "-", "-", "-", "-", "-", "-")
        else:
            row = _summary_row(kind, b.report, b.plan, None)
            row[-1] = f"{b.report.iteration_time_s / ref:.2f}x" if b.report.fits else "-"
            table.add_row(*row)
    out.print(table)


def _summary_row(name: str, report: Report, plan: Plan, reference: float | None) -> list[str]:
    from plait.report import layout_text

    layout = layout_text(plan)
    speed = f"{reference / report.iteration_time_s:.2f}x" if reference and report.fits else "-"
    fits = "[green]yes[/]" if report.fits else f"[red]no (+{report.over_memory_gib:.1f} GiB)[/]"
    return [name, layout, fmt_s(report.iteration_time_s), f"{report.tokens_per_s:,.0f}", f"{report.mfu:.1%}",
            f"{report.peak_memory_gib:.1f}", fits, speed]


def _print_straggler(s: dict) -> None:
    table = Table(title="around the slow devices (seconds per iteration)", box=box.SIMPLE_HEAD)
    for col in ("plan", "iteration", "vs static"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    static = s["static_time_s"]
    for name, key in (("healthy cluster, its best plan", "no_straggler_time_s"),
                      ("that plan with the slow devices (static)", "static_time_s"),
                      (f"re-planned: {s['replanned']}", "replanned_time_s")):
        table.add_row(name, fmt_s(s[key]), f"{static / s[key]:.2f}x")
    out.print(table)
    out.print(f"switching moves {s['moved_layers']} (rank, layer) states (about {fmt_s(s['migration_s'])}); "
              f"re-planned in {s['solve_time_s']:.2f} s")
