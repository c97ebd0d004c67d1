"""The `plait` command: list presets and simulate plans (DESIGN.md's public interface).

Bad input ends with one line on stderr (what is wrong and what fixes it) and exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plait.errors import PlaitError
from plait.io import json_line, output_path, write_files
from plait.plan import Plan, load_plan, uniform_plan, validate_plan
from plait.simulate import Report, simulate
from plait.spec.cluster import GIB, GPUS, Cluster, load_cluster
from plait.spec.model import PRESETS, ModelSpec, load_model

if TYPE_CHECKING:
    from plait.planner.baselines import Candidate

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find, predict and run the fastest hybrid-parallel layout for training a transformer.")
out = Console(width=None if sys.stdout.isatty() else 120)  # files and pipes get full-width tables
err = Console(stderr=True, width=10_000)  # one-line errors are never wrapped


def fail(message: str) -> None:
    """Print a one-line error and exit with 2."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def draw_picture(draw: Callable[[], None], path: str) -> None:
    """Run `draw`, which writes the picture at `path`; an OS error becomes a one-line PlaitError."""
    try:
        draw()
    except OSError as exc:
        raise PlaitError(f"cannot write timeline {path!r}: {exc.strerror or exc}; choose a writable path") from None


MAX_MEMORY_GIB = 2.0**20
"""Largest --memory-gib (1 PiB per device)."""
MAX_GLOBAL_BATCH = 65536
"""Largest `plan --global-batch`, sequences (the search's time and memory grow with it)."""


def parse_slow(text: str | None) -> dict[int, float]:
    """`RANK:FACTOR[,RANK:FACTOR...]` -> {rank: factor}."""
    slow: dict[int, float] = {}
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        rank, colon, factor = item.partition(":")
        try:
            r, f = int(rank), float(factor)
        except ValueError:
            r = f = None
        if not colon or r is None or f is None:
            raise PlaitError(f"cannot read {item!r}; use RANK:FACTOR such as 3:2.5")
        if r in slow:
            raise PlaitError(f"rank {r} is given twice; give each rank once")
        slow[r] = f
    return slow


def load_inputs(model: str, cluster: str, memory_gib: float | None, slow: str | None,
                profile: Path | None = None, galvatron_profile: str | None = None):
    """(model, cluster, calibration or None) from the command line; a `plait profile` file calibrates the
    cluster's device type (and names it: `1x4xCPU`)."""
    m = load_model(model)
    cal = None
    if profile is not None:
        from plait.cost.measured import calibrate, profiled_cluster
        from plait.cost.profile_file import load_profile

        if galvatron_profile:
            raise PlaitError("give one of --profile or --galvatron-profile")
        measured = load_profile(profile)
        c, cal = calibrate(measured, profiled_cluster(measured, cluster) or load_cluster(cluster))
    else:
        c = load_cluster(cluster)
        cal = load_calibration(galvatron_profile, m, c)
    if memory_gib is not None:
        if not (math.isfinite(memory_gib) and 0 < memory_gib <= MAX_MEMORY_GIB):
            raise PlaitError(f"--memory-gib must be a positive number of GiB up to {MAX_MEMORY_GIB:.0f}, got "
                             f"{memory_gib}")
        c = c.with_memory(memory_gib)
    if slow:
        try:
            c = c.with_slow(parse_slow(slow))
        except PlaitError as exc:
            raise PlaitError(f"--slow: {exc}") from None
    return m, c, cal


def load_calibration(spec: str | None, model: ModelSpec, cluster: Cluster):
    """`--galvatron-profile GPU:MODEL_DIR[:HARDWARE_DIR]` -> a Calibration (None without the option)."""
    if not spec:
        return None
    from plait.cost.calibration import calibration_for
    from plait.galvatron import load_galvatron_profiles, to_calibration

    gpu, _, rest = spec.partition(":")
    model_dir, _, hardware_dir = rest.partition(":")
    if not gpu or not model_dir:
        raise PlaitError(f"--galvatron-profile {spec!r}: give GPU:MODEL_DIR[:HARDWARE_DIR], e.g. "
                         "A100-80GB:galvatron/models/llama_hf/configs:galvatron/profile_hardware/hardware_configs")
    profiles = load_galvatron_profiles(model_dir, hardware_dir or None, gpu)
    return to_calibration(profiles, model, cluster, calibration_for(cluster.gpu.name))


def read_plan(path: Path, model: ModelSpec, cluster: Cluster, seq_len: int | None) -> Plan:
    """A plait plan file, or a Galvatron `galvatron_config_*.json` (recognised by its keys)."""
    if path.suffix == ".json" and path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raw = None
        if isinstance(raw, dict) and "pp_deg" in raw and "tp_sizes_enc" in raw:
            import warnings

            from plait.galvatron import load_galvatron_config

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plan = load_galvatron_config(path, model, cluster, seq_len or model.max_seq_len)
            for w in caught:
                err.print(f"[yellow]note:[/] {escape(str(w.message))}", highlight=False)
            return plan
    plan = load_plan(path)
    if seq_len is not None and seq_len != plan.seq_len:
        plan = Plan.model_validate({**plan.model_dump(), "seq_len": seq_len})
    return plan


@app.command()
def models() -> None:
    """List model presets."""
    table = Table(title="model presets (or a config.json path, or gpt:/llama: inline specs)")
    for col in ("name", "family", "params", "layers", "hidden", "heads", "kv", "ffn", "vocab", "seq"):
        table.add_column(col, justify="left" if col in ("name", "family") else "right")
    for name, m in PRESETS.items():
        table.add_row(name, m.family, f"{m.params / 1e9:.2f}B" if m.params > 1e8 else f"{m.params / 1e6:.2f}M",
                      str(m.layers), str(m.hidden), str(m.heads), str(m.kv_heads), str(m.ffn), str(m.vocab),
                      str(m.max_seq_len))
    out.print(table)


@app.command()
def clusters() -> None:
    """List GPU types (use NODESxGPUSxTYPE, e.g. 2x8xH100-80GB, or a YAML file)."""
    from plait.spec.cluster import DGX_GPUS_PER_NODE, DGX_LINKS, default_host

    table = Table(title="GPU types (clusters: NODESxGPUSxTYPE such as 192x8xA100-80GB, or a YAML file)")
    for col in ("type", "bf16 TFLOP/s", "memory GiB", "HBM GB/s", "NVLink GB/s", "network GB/s per GPU",
                "host GB per 8 GPUs", "host link GB/s per GPU", "NVMe TB / GB/s per 8 GPUs"):
        table.add_column(col, justify="left" if col == "type" else "right")
    for name, g in GPUS.items():
        intra, inter = DGX_LINKS[name]
        host = default_host(name, DGX_GPUS_PER_NODE)
        table.add_row(name, f"{g.peak_flops / 1e12:.0f}", f"{g.memory_bytes / GIB:.1f}",
                      f"{g.hbm_bandwidth / 1e9:.0f}", f"{intra.bandwidth / 1e9:.0f}", f"{inter.bandwidth / 1e9:.0f}",
                      f"{host.memory_bytes / 1e9:.0f}", f"{host.link.bandwidth / 1e9:.1f}",
                      f"{host.nvme_bytes / 1e12:.1f} / {host.nvme_bandwidth / 1e9:.0f}")
    out.print(table)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def print_report(report: Report, plan: Plan, model: ModelSpec, cluster: Cluster) -> None:
    """Rich tables: headline numbers, time breakdown, memory per device group."""
    pipes = plan.pipelines
    strategies = sorted({s.short() for p in pipes for st in p.stages for s in st.strategies})
    micro = ", ".join(f"{p.micro_batches} x {p.micro_batch_sequences}" for p in pipes[:8]) + (", ..." if len(pipes) > 8 else "")
    out.print(f"[bold]{model.name}[/] ({model.params / 1e9:.2f}B params) on [bold]{cluster.name}[/], "
              f"seq {plan.seq_len}, global batch {plan.global_batch}, {plan.precision}")
    out.print(f"plan: {len(pipes)} pipeline(s), pp={plan.pp}, chunks={plan.chunks}, "
              f"schedule={plan.schedule}, micro-batches {micro} seqs; layers: {'; '.join(strategies)}")
    head = Table(title="prediction", show_header=False)
    head.add_column("metric")
    head.add_column("value", justify="right")
    host_over = report.host_memory_gib - report.host_capacity_gib
    fits = "[green]yes[/]" if report.fits else f"[red]no: {report.over_memory_gib:.1f} GiB over[/]" \
        if report.over_memory_gib > 0 else f"[red]no: host memory {host_over:.1f} GiB over[/]"
    for name, value in (
        ("iteration time", _fmt_s(report.iteration_time_s)),
        ("throughput", f"{report.tokens_per_s:,.0f} tokens/s"),
        ("model TFLOP/s per GPU", f"{report.model_tflops_per_gpu:.1f} (MFU {report.mfu:.1%})"),
        ("hardware TFLOP/s per GPU", f"{report.hardware_tflops_per_gpu:.1f} (HFU {report.hfu:.1%})"),
        ("peak memory", f"{report.peak_memory_gib:.1f} of {report.memory_capacity_gib:.1f} GiB"),
        ("host memory per node", f"{report.host_memory_gib:.1f} of {report.host_capacity_gib:.0f} GiB"),
        ("fits", fits),
    ):
        head.add_row(name, value)
    out.print(head)
    bd = Table(title="time of the slowest device by cause", box=box.SIMPLE_HEAD)
    bd.add_column("cause")
    bd.add_column("time", justify="right")
    bd.add_column("share", justify="right")
    for key, value in report.breakdown.items():
        if value > 0:
            bd.add_row(key, _fmt_s(value), f"{value / report.iteration_time_s:.1%}")
    out.print(bd)
    if len(report.by_kind) > 3:  # more than one layer kind besides the embedding and head
        _print_kinds(report)
    from plait.cost.memory import unit

    name, size = unit(max(d.memory.total for d in report.devices))
    mem = Table(title=f"memory per device ({name})", box=box.SIMPLE_HEAD)
    multi = len(plan.pipelines) > 1
    for col in ("pipe",) * multi + ("stage", "ranks", "layers", "weights", "grads", "optim", "activ", "buf",
                                    "reserve", "total", "host"):
        mem.add_column(col, justify="right", no_wrap=True)
    for d in report.devices[:16]:
        t = d.memory
        total = f"{t.total / size:.1f}" if t.total <= cluster.gpu.memory_bytes else f"[red]{t.total / size:.1f}[/]"
        mem.add_row(*(str(d.pipeline),) * multi, str(d.index), ranks_text(d.ranks),
                    ",".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in d.layers),
                    *(f"{v / size:.1f}" for v in (t.weights, t.gradients, t.optimizer, t.activations, t.buffers,
                                                  t.reserve)), total, f"{d.host_bytes / size:.1f}")
    if len(report.devices) > 16:
        mem.caption = f"first 16 of {len(report.devices)} device groups"
    out.print(mem)


def _print_kinds(report: Report) -> None:
    """Time and memory of each layer kind (first pipeline)."""
    table = Table(title="by layer kind (first pipeline; seconds summed over its device groups)",
                  box=box.SIMPLE_HEAD)
    for col in ("kind", "layers", "params", "time", "share", "states GiB/dev", "activ GiB/mb/dev"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    total = sum(k.seconds for k in report.by_kind.values()) or 1.0
    for kind, k in report.by_kind.items():
        table.add_row(kind, str(k.layers), f"{k.params / 1e9:.2f}B" if k.params >= 1e8 else f"{k.params / 1e6:.1f}M",
                      _fmt_s(k.seconds), f"{k.seconds / total:.1%}", f"{k.states_gib:.2f}",
                      f"{k.activation_gib_per_micro_batch:.2f}")
    out.print(table)


@app.command(name="simulate")
def simulate_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="preset, config.json path, or gpt:/llama: spec")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="NODESxGPUSxTYPE (e.g. 2x8xH100-80GB) or YAML")],
    seq_len: Annotated[int | None, typer.Option("--seq-len", "-s", help="tokens per sequence")] = None,
    plan: Annotated[Path | None, typer.Option("--plan", help="plan JSON/YAML")] = None,
    strategy: Annotated[str | None, typer.Option("--strategy", help='e.g. "tp=8,pp=8,dp=16,mbs=1,gbs=1536"')] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object and nothing else")] = False,
    timeline: Annotated[str | None, typer.Option("--timeline", help="write a timeline + memory picture")] = None,
    slow: Annotated[str | None, typer.Option("--slow", help="straggling devices RANK:FACTOR[,...]")] = None,
    memory_gib: Annotated[float | None, typer.Option("--memory-gib", help="device memory override, GiB")] = None,
    galvatron_profile: Annotated[str | None, typer.Option(
        "--galvatron-profile", help="calibrate from Galvatron profiles: GPU:MODEL_DIR[:HARDWARE_DIR]")] = None,
    profile: Annotated[Path | None, typer.Option("--profile", help="calibrate from a `plait profile` file")] = None,
    report_out: Annotated[str | None, typer.Option("--report", help="also write an HTML report page")] = None,
) -> None:
    """Predict iteration time, throughput, MFU and memory of one plan (a plait plan, a Galvatron
    galvatron_config_*.json, or --strategy)."""
    try:
        timeline_path = output_path(timeline, "timeline.png", "--timeline") if timeline is not None else None
        page_path = output_path(report_out, "report.html", "--report") if report_out is not None else None
        m, c, cal = load_inputs(model, cluster, memory_gib, slow, profile, galvatron_profile)
        p = plan_of(plan, strategy, m, c, seq_len)
        report, healthy, result = simulate_result(p, m, c, cal, timeline is not None or page_path is not None,
                                                  bool(slow))
        if page_path is not None:
            from plait.report import Alternative, write_page

            write_page(page_path, "simulate", result, [Alternative("this plan", p, report)], m, c)
        if timeline is not None:
            from plait.viz import combined

            memory = [(f"p{d.pipeline}s{d.index}", {k: v for k, v in d.memory.as_dict().items()})
                      for d in report.devices]
            draw_picture(lambda: combined(
                report.pipelines[0], memory, c.gpu.memory_bytes, str(timeline_path),
                f"{m.name} on {c.name}: {report.iteration_time_s:.3f} s/iteration, MFU {report.mfu:.1%}"), timeline)
    except PlaitError as exc:
        fail(str(exc))
        return
    if as_json:
        sys.stdout.write(json_line(result))
        return
    print_report(report, p, m, c)
    if healthy:
        out.print(f"with the slow devices: {_fmt_s(report.iteration_time_s)} per iteration, "
                  f"{report.iteration_time_s / healthy.iteration_time_s:.2f}x the healthy cluster's "
                  f"{_fmt_s(healthy.iteration_time_s)}; `plait plan --slow` re-plans around them")
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


@app.command(name="report")
def report_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="preset, config.json path, or gpt:/llama: spec")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="NODESxGPUSxTYPE (e.g. 2x8xH100-80GB) or YAML")],
    plan: Annotated[Path | None, typer.Option("--plan", help="plan JSON/YAML")] = None,
    strategy: Annotated[str | None, typer.Option("--strategy", help='e.g. "tp=8,pp=8,dp=16,mbs=1,gbs=1536"')] = None,
    saved: Annotated[Path | None, typer.Option(
        "--from", help="a saved `plait simulate/plan --json` report whose numbers the page shows")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", "-s", help="tokens per sequence")] = None,
    out_file: Annotated[str, typer.Option("--out", help="the HTML page to write")] = "report.html",
    slow: Annotated[str | None, typer.Option("--slow", help="straggling devices RANK:FACTOR[,...]")] = None,
    memory_gib: Annotated[float | None, typer.Option("--memory-gib", help="device memory override, GiB")] = None,
    profile: Annotated[Path | None, typer.Option("--profile", help="calibrate from a `plait profile` file")] = None,
) -> None:
    """Write a self-contained HTML page of one plan: its stages, pipeline timeline, memory per device and time
    by cause (from a plan file, --strategy, or the plan a saved `plait plan --json` report holds)."""
    from plait.report import Alternative, read_saved, write_page

    try:
        page_path = output_path(out_file, "report.html", "--out")
        m, c, cal = load_inputs(model, cluster, memory_gib, slow, profile)
        result = read_saved(saved) if saved is not None else None
        if result is not None and "plan" in result and plan is None and strategy is None:
            p = Plan.model_validate(result["plan"])
            validate_plan(p, m, c)
        elif result is not None and plan is None and strategy is None:
            raise PlaitError(f"--from {str(saved)!r} holds no plan (a `plait simulate --json` report); give the "
                             "plan it simulated with --plan FILE or --strategy too")
        else:
            p = plan_of(plan, strategy, m, c, seq_len)
        report, _, simulated = simulate_result(p, m, c, cal, True, bool(slow))
        shown = result.get("report", result) if result is not None else None
        write_page(page_path, "report", result or simulated, [Alternative("this plan", p, report, shown)], m, c)
    except PlaitError as exc:
        fail(str(exc))
        return
    out.print(f"report page: {page_path}")


def plan_of(plan: Path | None, strategy: str | None, m: ModelSpec, c: Cluster, seq_len: int | None) -> Plan:
    """The validated plan that `--plan FILE` or `--strategy` gives (exactly one of them)."""
    if (plan is None) == (strategy is None):
        raise PlaitError("give exactly one of --plan FILE or --strategy \"tp=..,pp=..,dp=..\"")
    if seq_len is not None and seq_len <= 0:
        raise PlaitError(f"--seq-len must be a positive number of tokens, got {seq_len}")
    p = read_plan(plan, m, c, seq_len) if plan is not None else uniform_plan(strategy or "", m, c,
                                                                             seq_len or m.max_seq_len)
    validate_plan(p, m, c)
    return p


def print_plan(plan: Plan, world: int | None = None) -> None:
    """The plan as a table: every stage with its layers grouped into runs of one strategy (and the ranks of
    a `world` that it leaves out)."""
    table = Table(title="plan: layers grouped by strategy", box=box.SIMPLE_HEAD)
    multi = len(plan.pipelines) > 1
    for col in ("pipe", "micro-batches") * multi + ("stage", "ranks", "layers", "strategy"):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            layer = stage.layers[0]
            for ri, (strategy, count) in enumerate(stage.layer_strategies()):
                first = ri == 0
                lead = (str(pi), f"{pipe.micro_batches} x {pipe.micro_batch_sequences}") if first and si == 0 else ("", "")
                table.add_row(*lead * multi, str(si) if first else "", ranks_text(stage.ranks) if first else "",
                              f"{layer}-{layer + count - 1}" if count > 1 else str(layer), strategy.short())
                layer += count
    unused = sorted(set(range(world or plan.ranks[-1] + 1)) - set(plan.ranks))
    if unused:
        table.caption = f"ranks left out: {ranks_text(tuple(unused))}"
    out.print(table)


def ranks_text(ranks: tuple[int, ...]) -> str:
    """Ranks as short ranges, e.g. `0-3,6,8-9`."""
    parts: list[str] = []
    for r in sorted(ranks):
        if parts and r == int(parts[-1].rpartition("-")[2]) + 1:
            head = parts[-1].partition("-")[0]
            parts[-1] = f"{head}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)


def _search_progress(label: str = "searching ({} plans)"):
    """A transient rich progress bar on stderr, and the callback `update(phase, done, total)` that drives
    it (one bar per phase, described by `label` with the phase filled in)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=err, transient=True)
    tasks: dict[str, int] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(label.format(phase), total=total)
        bar.update(tasks[phase], completed=done, total=total)

    return bar, update


def _summary_row(name: str, report: Report, plan: Plan, reference: float | None) -> list[str]:
    from plait.report import layout_text

    layout = layout_text(plan)
    speed = f"{reference / report.iteration_time_s:.2f}x" if reference and report.fits else "-"
    fits = "[green]yes[/]" if report.fits else f"[red]no (+{report.over_memory_gib:.1f} GiB)[/]"
    return [name, layout, _fmt_s(report.iteration_time_s), f"{report.tokens_per_s:,.0f}", f"{report.mfu:.1%}",
            f"{report.peak_memory_gib:.1f}", fits, speed]


@app.command(name="plan")
def plan_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="preset, config.json path, or gpt:/llama: spec")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="NODESxGPUSxTYPE (e.g. 2x8xH100-80GB) or YAML")],
    global_batch: Annotated[int, typer.Option("--global-batch", "-b", help="sequences per optimizer step")],
    seq_len: Annotated[int | None, typer.Option("--seq-len", "-s", help="tokens per sequence")] = None,
    out_path: Annotated[str | None, typer.Option("--out", help="write the plan (JSON, or YAML by suffix)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object and nothing else")] = False,
    baseline: Annotated[str | None, typer.Option("--baseline", help="dp | zero3 | megatron-grid")] = None,
    compare: Annotated[bool, typer.Option("--compare", help="also run the baselines, side by side")] = False,
    memory_gib: Annotated[float | None, typer.Option("--memory-gib", help="device memory override, GiB")] = None,
    slow: Annotated[str | None, typer.Option("--slow", help="straggling devices RANK:FACTOR[,...]")] = None,
    precision: Annotated[str, typer.Option("--precision", help="bf16 | fp16 | fp32")] = "bf16",
    galvatron_profile: Annotated[str | None, typer.Option(
        "--galvatron-profile", help="calibrate from Galvatron profiles: GPU:MODEL_DIR[:HARDWARE_DIR]")] = None,
    galvatron_out: Annotated[str | None, typer.Option(
        "--galvatron-out", help="also write the plan as a Galvatron galvatron_config JSON")] = None,
    runnable: Annotated[bool, typer.Option(
        "--runnable", help="only plans `plait train` executes (see plait.executable)")] = False,
    profile: Annotated[Path | None, typer.Option("--profile", help="calibrate from a `plait profile` file")] = None,
    report_out: Annotated[str | None, typer.Option(
        "--report", help="also write an HTML report page (with the search's Pareto alternatives)")] = None,
    host_memory: Annotated[bool, typer.Option(
        "--host-memory", help="also search swapping activations to host (swap 0.5, 1) and offloading the "
                              "optimizer to the host CPU, within the nodes' host memory")] = False,
) -> None:
    """Search the fastest plan that fits (or run a baseline planner)."""
    from plait.planner.baselines import BASELINES, run_baseline
    from plait.planner.engine import DEFAULT_LIMITS, fewest_gpus, search
    from plait.planner.space import HIERARCHY
    from plait.report import Alternatives

    try:
        plan_file = output_path(out_path, "plan.json", "--out") if out_path is not None else None
        page_path = output_path(report_out, "report.html", "--report") if report_out is not None else None
        collected = Alternatives() if page_path is not None else None
        galvatron_file = output_path(galvatron_out, "galvatron_config.json", "--galvatron-out") \
            if galvatron_out is not None else None
        m, c, cal = load_inputs(model, cluster, memory_gib, slow, profile, galvatron_profile)
        seq = seq_len if seq_len is not None else m.max_seq_len
        if seq <= 0 or global_batch <= 0:
            raise PlaitError(f"--seq-len and --global-batch must be positive, got {seq} and {global_batch}")
        if global_batch > MAX_GLOBAL_BATCH:
            raise PlaitError(f"--global-batch {global_batch} is more sequences than plait searches "
                             f"({MAX_GLOBAL_BATCH}); plan a smaller batch (fewer, longer sequences)")
        if baseline is not None and baseline not in BASELINES:
            raise PlaitError(f"--baseline {baseline!r} is unknown; choose one of {', '.join(BASELINES)}")
        if precision not in ("bf16", "fp16", "fp32"):
            raise PlaitError(f"--precision must be bf16, fp16 or fp32, got {precision!r}")
        bar, update = _search_progress()
        straggler: dict | None = None
        with bar:
            if baseline is not None:
                import time

                t0 = time.perf_counter()
                best, _ = run_baseline(baseline, m, c, seq, global_batch, progress=lambda d, t: update(baseline, d, t),
                                       cal=cal)
                chosen = best if best is not None and best.report.fits else None
                elapsed = time.perf_counter() - t0
                closest = best
            else:
                healthy = replace(c, speed=()) if slow else c
                limits = replace(DEFAULT_LIMITS, **HIERARCHY) if host_memory else DEFAULT_LIMITS
                result = search(m, healthy, seq, global_batch, precision=precision, progress=update, cal=cal,
                                runnable=runnable, record=collected.record if collected else None,
                                limits=limits)
                chosen = None
                if result.plan is not None:
                    chosen = min((x for x in (result.best_layerwise, result.best_uniform)
                                  if x is not None and x.report.fits), key=lambda x: x.key)
                elapsed, closest = result.search_time_s, result.closest
                if slow and chosen is not None:
                    chosen, straggler = _replan_around_stragglers(chosen, m, c, seq, global_batch, precision, cal,
                                                                  runnable, update)
                    elapsed += straggler["solve_time_s"]
            baselines = {}
            if compare:
                for kind in BASELINES:
                    b, _ = run_baseline(kind, m, c, seq, global_batch, progress=lambda d, t, k=kind: update(k, d, t),
                                        cal=cal)
                    baselines[kind] = b
        if chosen is None:
            need = f"the closest plan needs {closest.report.peak_memory_gib:.1f} GiB per device" if closest else \
                "no layout is possible"
            more = fewest_gpus(m, c, seq, global_batch)
            gpus = f"; {more} GPUs would fit (e.g. --cluster {more // c.gpus_per_node}x{c.gpus_per_node}x" \
                f"{c.gpu.name})" if more else ""
            raise PlaitError(f"nothing fits in {c.gpu.memory_bytes / GIB:.1f} GiB per device: {need}{gpus}; "
                             "or lower --global-batch / --seq-len")
        chosen = replace(chosen, plan=chosen.plan.stamped(m))
        files: list[tuple[Path, str]] = []
        if galvatron_file is not None:
            from plait.galvatron import galvatron_config

            files.append((galvatron_file, json.dumps(galvatron_config(chosen.plan, m), indent=4)))
        if plan_file is not None:
            files.append((plan_file, chosen.plan.file_text(plan_file)))
        obj = {"plan": json.loads(chosen.plan.model_dump_json()), "report": chosen.report.to_dict(),
               "search_time_s": elapsed}
        if compare:
            obj["baselines"] = {k: (b.report.to_dict() | {"strategy": b.label.split(": ", 1)[1]}) if b else None
                                for k, b in baselines.items()}
        if straggler:
            obj["straggler"] = straggler
        if page_path is not None:
            from plait.report import plan_page

            files.append((page_path, plan_page(obj, chosen, baselines, collected, m, c, cal)))
        write_files(files)
    except PlaitError as exc:
        fail(str(exc))
        return
    if as_json:
        sys.stdout.write(json_line(obj))
        return
    print_plan(chosen.plan, c.world_size)
    print_report(chosen.report, chosen.plan, m, c)
    if straggler:
        _print_straggler(straggler)
    from plait.executable import unsupported

    if (reason := unsupported(chosen.plan, m)) is not None:
        out.print(f"[yellow]note:[/] `plait train` cannot run this plan yet ({reason}); --runnable restricts the "
                  "search to plans it runs")
    out.print(f"searched in {elapsed:.2f} s" + (f"; plan written to {plan_file}" if plan_file else "")
              + (f"; report page: {page_path}" if page_path else ""))
    if compare:
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


def _replan_around_stragglers(healthy: Candidate, m: ModelSpec, c: Cluster, seq: int, global_batch: int,
                              precision: str, cal, runnable: bool, update) -> tuple[Candidate, dict]:
    """The plan shaped around `c`'s slow devices (Malleus), and what it is worth: the healthy cluster's
    plan on the healthy and on the slow cluster (static), and the re-planned one."""
    from plait.planner.baselines import Candidate
    from plait.planner.straggler import plan_around_stragglers

    static = simulate(healthy.plan, m, c, cal=cal)
    result = plan_around_stragglers(m, c, seq, global_batch, precision=precision, cal=cal, current=healthy.plan,
                                    runnable=runnable, progress=update)
    chosen = Candidate(result.plan, result.report, result.label) if result.plan is not None else \
        Candidate(healthy.plan, static, "current plan")
    summary = {"no_straggler_time_s": healthy.report.iteration_time_s, "static_time_s": static.iteration_time_s,
               "replanned_time_s": chosen.report.iteration_time_s, "replanned": chosen.label,
               "moved_layers": result.moved_layers, "migration_s": result.migration_s,
               "solve_time_s": result.solve_time_s}
    return chosen, summary


def _print_straggler(s: dict) -> None:
    table = Table(title="around the slow devices (seconds per iteration)", box=box.SIMPLE_HEAD)
    for col in ("plan", "iteration", "vs static"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    static = s["static_time_s"]
    for name, key in (("healthy cluster, its best plan", "no_straggler_time_s"),
                      ("that plan with the slow devices (static)", "static_time_s"),
                      (f"re-planned: {s['replanned']}", "replanned_time_s")):
        table.add_row(name, _fmt_s(s[key]), f"{static / s[key]:.2f}x")
    out.print(table)
    out.print(f"switching moves {s['moved_layers']} (rank, layer) states (about {_fmt_s(s['migration_s'])}); "
              f"re-planned in {s['solve_time_s']:.2f} s")


@app.command(name="varlen")
def varlen_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="preset, config.json path, or gpt:/llama: spec")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="NODESxGPUSxTYPE (e.g. 8x8xA100-80GB) or YAML")],
    lengths: Annotated[Path, typer.Option("--lengths", help="sequence lengths, one token count per line")],
    global_batch: Annotated[int, typer.Option("--global-batch", "-b", help="sequences per global batch")],
    batches: Annotated[int, typer.Option("--batches", help="global batches to sample and plan")] = 4,
    seed: Annotated[int, typer.Option("--seed", help="seed of the sampling")] = 0,
    method: Annotated[str, typer.Option("--method", help="flexsp | bytescale | static")] = "flexsp",
    sp: Annotated[int | None, typer.Option("--sp", help="static: the sequence-parallel degree")] = None,
    cp_mode: Annotated[str, typer.Option("--cp-mode", help="static: ulysses | ring (a DP x CP mesh)")] = "ulysses",
    capacity: Annotated[int, typer.Option("--capacity", help="tokens a device holds at once")] = 32768,
    precision: Annotated[str, typer.Option("--precision", help="bf16 | fp16 | fp32")] = "bf16",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object and nothing else")] = False,
    report_out: Annotated[str | None, typer.Option("--report", help="also write an HTML report page")] = None,
) -> None:
    """Plan sampled global batches of variable-length sequences: per-step sequence-parallel groups (FlexSP),
    ByteScale-style balance scheduling, or static sequence parallelism."""
    from plait.planner.varlen import SequenceCost, load_lengths, plan_batch, sample_batches

    try:
        page_path = output_path(report_out, "report.html", "--report") if report_out is not None else None
        m, c, _ = load_inputs(model, cluster, None, None)
        if method not in ("flexsp", "bytescale", "static"):
            raise PlaitError(f"--method must be flexsp, bytescale or static, got {method!r}")
        if cp_mode not in ("ulysses", "ring"):
            raise PlaitError(f"--cp-mode must be ulysses or ring, got {cp_mode!r}")
        if sp is not None and (method != "static" or sp <= 0 or sp & (sp - 1) or sp > c.world_size):
            raise PlaitError(f"--sp goes with --method static and is a power of two up to {c.world_size}; got {sp}")
        if batches <= 0 or global_batch <= 0 or capacity <= 0:
            raise PlaitError("--batches, --global-batch and --capacity must be positive")
        if precision not in ("bf16", "fp16", "fp32"):
            raise PlaitError(f"--precision must be bf16, fp16 or fp32, got {precision!r}")
        mode = "ring" if method == "bytescale" else cp_mode
        cost = SequenceCost(m, c, precision=precision, cp_mode=mode)
        sampled = sample_batches(load_lengths(lengths), batches, global_batch, seed)
        bar, update = _search_progress("planning {} batches")
        rows = []
        with bar:
            for i, batch in enumerate(sampled):
                p = plan_batch(batch, c.world_size, cost, capacity, method, sp)
                rows.append({"sequences": len(batch), "tokens": int(sum(batch)), "longest": int(max(batch)),
                             "micro_batches": len(p.micro_batches), "time_s": p.seconds, "solve_time_s": p.solve_time_s,
                             "group_sizes": [sorted(Counter(g.degree for g in mb.groups).items())
                                             for mb in p.micro_batches]})
                update(method, i + 1, len(sampled))
        total = sum(r["time_s"] for r in rows)
        solve = sum(r["solve_time_s"] for r in rows)
        result = {"total_time_s": total, "solve_time_s": solve, "per_batch": rows}
        if page_path is not None:
            from plait.report import write_page

            write_page(page_path, "varlen", result, [], m, c, {"method": method, "global batch": global_batch,
                                                                 "capacity": capacity, "precision": precision})
    except PlaitError as exc:
        fail(str(exc))
        return
    if as_json:
        sys.stdout.write(json_line(result))
        return
    table = Table(title=f"{m.name} on {c.name}, {method}{f' sp={sp}' if sp else ''}, {capacity} tokens per device",
                  box=box.SIMPLE_HEAD)
    for col in ("batch", "tokens", "longest", "micro-batches", "group sizes (size x count)", "planned", "solver"):
        table.add_column(col, justify="left" if col.startswith("group") else "right")
    for i, r in enumerate(rows):
        sizes = " | ".join(" ".join(f"{d}x{n}" for d, n in mb) for mb in r["group_sizes"])
        table.add_row(str(i), f"{r['tokens']:,}", f"{r['longest']:,}", str(r["micro_batches"]), sizes,
                      _fmt_s(r["time_s"]), f"{r['solve_time_s']:.2f} s")
    out.print(table)
    out.print(f"total planned time {total:.3f} s over {len(rows)} batches; solver {solve:.2f} s "
              f"({solve / len(rows):.2f} s per batch)")


@app.command(name="multitask")
def multitask_cmd(
    tasks: Annotated[Path, typer.Option("--tasks", help="task file (YAML): modules, tasks, dependencies")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="NODESxGPUSxTYPE (e.g. 4x8xA100-80GB) or YAML")],
    precision: Annotated[str, typer.Option("--precision", help="bf16 | fp16 | fp32")] = "bf16",
    timeline: Annotated[str | None, typer.Option("--timeline", help="write a picture of the waves")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object and nothing else")] = False,
) -> None:
    """Plan several tasks that share modules in waves of device groups (Spindle), beside running the tasks
    one after another on all devices and all at once on FLOPs-proportional shares."""
    from plait.planner.multitask.plan import plan_multitask
    from plait.spec.tasks import load_tasks

    try:
        c = load_cluster(cluster)
        if precision not in ("bf16", "fp16", "fp32"):
            raise PlaitError(f"--precision must be bf16, fp16 or fp32, got {precision!r}")
        timeline_path = output_path(timeline, "waves.png", "--timeline") if timeline is not None else None
        ts = load_tasks(tasks)
        bar, update = _search_progress("{}")
        with bar:
            result = plan_multitask(ts, c, precision, update)
        s, ops = result.schedule, result.graph.ops
        if timeline_path is not None:
            from plait.viz import plot_waves

            boxes = [(ops[p.op].name, p.first, p.devices, st.start_s, p.seconds) for st in s.stages
                     for p in st.placements]
            ends = [w.stages[-1].start_s + w.stages[-1].seconds for w in s.waves]
            draw_picture(lambda: plot_waves(boxes, c.world_size, ends, str(timeline_path), f"{ts.name} on {c.name}: "
                                            f"{s.makespan_s:.3f} s/step in {len(s.waves)} wave(s)"), timeline)
    except PlaitError as exc:
        fail(str(exc))
        return
    waves = [{"ops": [ops[i].name for i in w.ops], "bound_s": w.bound_s, "time_s": w.seconds,
              "stages": [{"start_s": st.start_s, "time_s": st.seconds,
                          "groups": [{"op": ops[p.op].name, "ranks": [p.first, p.first + p.devices - 1],
                                      "layers": p.layers, "time_s": p.seconds} for p in st.placements]}
                         for st in w.stages]} for w in s.waves]
    if as_json:
        sys.stdout.write(json_line({"step_time_s": s.makespan_s, "bound_s": s.bound_s, "waves": waves,
                                    "baselines": result.baselines, "relocations": s.relocations,
                                    "proportional_devices": list(result.proportional.devices),
                                    "task_level_devices": list(result.task_level.devices)}))
        return
    table = Table(title=f"{ts.name} on {c.name}: {len(ops)} MetaOps in {len(s.waves)} wave(s)", box=box.SIMPLE_HEAD)
    for col in ("wave", "stage", "start", "time", "groups (op: devices x layers)"):
        table.add_column(col, justify="left" if col.startswith("groups") else "right")
    for i, w in enumerate(waves):
        for j, st in enumerate(w["stages"]):
            groups = ", ".join(f"{g['op']}: {ranks_text(tuple(range(g['ranks'][0], g['ranks'][1] + 1)))} x "
                               f"{g['layers']}" for g in st["groups"])
            table.add_row(str(i) if not j else "", str(j), _fmt_s(st["start_s"]), _fmt_s(st["time_s"]),
                          escape(groups))
    out.print(table)
    summary = Table(box=box.SIMPLE_HEAD)
    for col in ("plan", "step time", "vs waves"):
        summary.add_column(col, justify="left" if col == "plan" else "right")
    rows = {"waves (Spindle)": s.makespan_s, "continuous optimum (sum over waves)": s.bound_s,
            "tasks one after another, all devices": result.sequential_s,
            f"tasks at once, FLOPs-proportional {result.proportional.devices}": result.proportional.makespan_s,
            f"tasks at once, task-level allocator {result.task_level.devices}": result.task_level.makespan_s}
    for name, seconds in rows.items():
        summary.add_row(escape(name), _fmt_s(seconds), f"{seconds / s.makespan_s:.2f}x")
    out.print(summary)
    if timeline_path is not None:
        out.print(f"waves picture: {timeline_path}")


@app.command(name="kv-eval")
def kv_eval_cmd(
    method: Annotated[str, typer.Option("--method", help="pqcache | full | window | h2o | snapkv")] = "pqcache",
    budget: Annotated[float, typer.Option("--budget", help="tokens a decode step reads: a fraction of the "
                                          "context (< 1) or a count")] = 0.2,
    context: Annotated[int, typer.Option("--context", help="prompt tokens")] = 2048,
    depths: Annotated[int, typer.Option("--depths", help="pass-key positions, start to end")] = 5,
    continuation: Annotated[int, typer.Option("--continuation", help="tokens scored for perplexity")] = 64,
    text: Annotated[Path | None, typer.Option("--text", help="long text for perplexity (default: KJV Genesis)")] = None,
    model_dir: Annotated[Path | None, typer.Option(
        "--model-dir", help="a Hugging Face Llama-family model directory (default: SmolLM2-135M-Instruct)")] = None,
    gguf: Annotated[str | None, typer.Option("--gguf", help="a GGUF file in --model-dir")] = None,
    subspaces: Annotated[int, typer.Option("--subspaces", help="pqcache: sub-spaces per key")] = 8,
    bits: Annotated[int, typer.Option("--bits", help="pqcache: 2^bits centroids per sub-space")] = 6,
    seed: Annotated[int, typer.Option("--seed", help="seed of the pass keys")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object and nothing else")] = False,
) -> None:
    """Measure a selective KV cache on a real model: pass-key retrieval over positions, continuation
    perplexity, top-k recall, decode latency, KV bytes and peak memory."""
    from pydantic import ValidationError

    try:
        from plait.inference.config import PQCacheConfig

        try:
            config = PQCacheConfig(method=method, budget=budget, subspaces=subspaces, bits=bits,
                                   measure_recall=method == "pqcache")
        except ValidationError as exc:
            first = exc.errors()[0]
            raise PlaitError(f"--{'-'.join(map(str, first['loc'])) or 'method'}: {first['msg']}") from None
        if context < 64 or depths < 1 or continuation < 1:
            raise PlaitError("--context must be >= 64 tokens, --depths and --continuation >= 1")
        if method != "full" and config.tokens(context) >= context:
            raise PlaitError(f"--budget {budget:g} keeps all {context} tokens of the context; that is --method full, "
                             "or give a smaller budget")
        if text is not None and not text.is_file():
            why = "is a directory" if text.is_dir() else "does not exist"
            raise PlaitError(f"--text {str(text)!r} {why}; give a long plain-text file")
        _check_model_dir(model_dir, gguf)
        from plait.inference.evaluate import check_inputs, default_text, evaluate, load

        body = text.read_text(errors="replace") if text else default_text()
        model, tokenizer = load(model_dir, gguf)
        check_inputs(model, tokenizer, config, context, continuation, body)
        bar, update = _search_progress("{}")
        total = depths + continuation
        count = [0]

        def tick() -> None:
            count[0] += 1
            update(f"{method} at {context} tokens", count[0], total)

        with bar:
            row = evaluate(model, tokenizer, config, context, depths, continuation, body, seed, tick)
    except PlaitError as exc:
        fail(str(exc))
        return
    if as_json:
        sys.stdout.write(json_line(row))
        return
    print_kv_rows([row])


def _check_model_dir(model_dir: Path | None, gguf: str | None) -> None:
    """kv-eval's model: a directory that exists, and a --gguf file inside it."""
    if model_dir is None:
        if gguf:
            raise PlaitError("--gguf names a file in --model-dir; give --model-dir DIR too")
        return
    if not model_dir.is_dir():
        raise PlaitError(f"--model-dir {str(model_dir)!r} is not a directory; give a Hugging Face model directory")
    if gguf and not (model_dir / gguf).is_file():
        raise PlaitError(f"--gguf {gguf!r} is not a file in {str(model_dir)!r}; give the name of a .gguf file there")


def print_kv_rows(rows: list[dict]) -> None:
    """Selective-cache measurements side by side, one row per (method, budget, context)."""
    table = Table(title="selective KV caches (decode reads the budget; full = native attention)", box=box.SIMPLE_HEAD)
    for col in ("context", "method", "budget", "pass key", "by depth", "perplexity", "top-k recall",
                "decode ms/token", "prefill s", "KV MiB (all)", "KV MiB near device", "peak RSS MiB"):
        table.add_column(col, justify="left" if col in ("method", "by depth") else "right")
    for r in rows:
        depth = "".join("+" if ok else "-" for ok in r["passkey_by_depth"].values())
        recall = f"{r['topk_recall']:.2f}" if r["topk_recall"] is not None else "-"
        table.add_row(str(r["context"]), r["method"], "-" if r["method"] == "full" else f"{r['budget']:g}",
                      f"{r['passkey_found']}/{r['passkey_trials']}", depth, f"{r['perplexity']:.2f}", recall,
                      f"{r['decode_s_per_token'] * 1e3:.1f}", f"{r['prefill_s']:.1f}",
                      f"{r['kv_full_bytes'] / 2**20:.1f}", f"{r['kv_resident_bytes'] / 2**20:.2f}",
                      f"{r['peak_rss_bytes'] / 2**20:,.0f}")
    out.print(table)


@app.command(name="profile")
def profile_cmd(
    model: Annotated[str, typer.Option("--model", help="preset, config.json or inline spec whose layers to measure")],
    nproc: Annotated[int, typer.Option("--nproc", help="ranks to measure collectives with (group sizes up to it)")] = 2,
    out_path: Annotated[str, typer.Option("--out", help="the profile JSON to write")] = "profile.json",
    quick: Annotated[bool, typer.Option("--quick", help="fewer sizes and repetitions (seconds, not minutes)")] = False,
    gpu_type: Annotated[str | None, typer.Option(
        "--gpu-type", help="the cluster device type the profile applies to (default: CPU, or the CUDA name)")] = None,
) -> None:
    """Measure this machine and the runtime's parallel strategies on it; write a profile for --profile."""
    import time

    from plait.profile.run import profile

    try:
        profile_file = output_path(out_path, "profile.json", "--out")
        m = load_model(model)
        bar, update = _search_progress("measuring {}")
        t0 = time.perf_counter()
        with bar:
            result = profile(m, nproc, quick=quick, gpu_type=gpu_type, progress=update)
        result.save(profile_file)
    except PlaitError as exc:
        fail(str(exc))
        return
    print_profile(result)
    out.print(f"profiled in {time.perf_counter() - t0:.0f} s; written to {profile_file}")


def print_profile(p) -> None:
    """Device, layer curves and collective curves of a profile, as tables."""
    d = p.device
    out.print(f"[bold]{d.name}[/] ({d.kind}, applies to device type {d.gpu_type}): {d.peak_flops / 1e9:,.1f} GFLOP/s "
              f"per rank, copy {d.memory_bandwidth / 1e9:,.1f} GB/s, {d.memory_bytes / GIB:,.1f} GiB per rank, "
              f"process {p.process_bytes / 2**20:,.0f} MiB")
    layers = Table(title="layers (one micro-batch on one rank)", box=box.SIMPLE_HEAD)
    for col in ("part", "tp", "recompute", "fwd us/token", "bwd us/token", "fwd ns/token/seq", "act bytes/token"):
        layers.add_column(col, justify="right" if col not in ("part", "recompute") else "left")
    for lp in p.layers:
        layers.add_row(f"block of {lp.model}", str(lp.tp), lp.recompute, f"{lp.forward.per_token_s * 1e6:.2f}",
                       f"{lp.backward.per_token_s * 1e6:.2f}", f"{lp.forward.per_token_seq_s * 1e9:.3f}",
                       f"{lp.activation_bytes_per_token:,.0f}")
    for e in p.edges:
        layers.add_row(f"{e.part} of {e.model}", str(e.tp), "-", f"{e.forward.per_token_s * 1e6:.2f}",
                       f"{e.backward.per_token_s * 1e6:.2f}", f"{e.forward.per_token_seq_s * 1e9:.3f}", "-")
    out.print(layers)
    coll = Table(title="collectives (seconds = latency + bytes per rank / bandwidth)", box=box.SIMPLE_HEAD)
    for col in ("op", "ranks", "latency us", "bandwidth GB/s"):
        coll.add_column(col, justify="left" if col == "op" else "right")
    for c in p.collectives:
        coll.add_row(c.op, str(c.ranks), f"{c.latency_s * 1e6:,.0f}", f"{c.bandwidth / 1e9:.2f}")
    out.print(coll)
    out.print(f"overlap: compute x{p.overlap.compute_slowdown:.2f}, communication x{p.overlap.comm_slowdown:.2f} "
              "when both run at once")
    if p.strategies:
        strat = Table(title="a block under each parallel strategy, as the runtime runs it (wall time, "
                            "communication included)", box=box.SIMPLE_HEAD)
        for col in ("strategy", "group", "busy ranks", "seqs x seq_len", "fwd ms", "bwd ms"):
            strat.add_column(col, justify="left" if col == "strategy" else "right")
        for sp in p.strategies:
            big = max(sp.samples, key=lambda x: x.seqs * x.seq_len)
            tokens = big.seqs * big.seq_len
            strat.add_row(sp.kind, str(sp.group), str(sp.ranks), f"{big.seqs} x {big.seq_len}",
                          f"{sp.forward.at(tokens, big.seq_len) * 1e3:.1f}", f"{sp.backward.at(tokens, big.seq_len) * 1e3:.1f}")
        out.print(strat)
    if p.optimizer is not None:
        out.print(f"optimizer step (clip + AdamW + zero grads): {p.optimizer.intercept_s * 1e3:.1f} ms + "
                  f"{p.optimizer.per_param_s * 1e9:.2f} ns per parameter")


@app.command(name="train")
def train_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="preset, config.json path, or gpt:/llama:/t5: spec")],
    plan: Annotated[Path | None, typer.Option("--plan", help="plan JSON/YAML")] = None,
    strategy: Annotated[str | None, typer.Option("--strategy", help='e.g. "dp=2,tp=2,gbs=8"')] = None,
    nproc: Annotated[int | None, typer.Option("--nproc", help="ranks to launch (default: the plan's)")] = None,
    steps: Annotated[int, typer.Option("--steps", help="optimizer steps")] = 10,
    seq_len: Annotated[int | None, typer.Option("--seq-len", "-s", help="tokens per sequence")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", "-b", help="sequences per step")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    lr: Annotated[float, typer.Option("--lr", help="peak learning rate")] = 3e-4,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32 | bf16")] = "fp32",
    data: Annotated[Path | None, typer.Option("--data", help="text file (byte-level tokens); default synthetic")] = None,
    metrics_out: Annotated[str | None, typer.Option("--metrics-out", help="JSON lines, one per step")] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(
        "--checkpoint-dir", help="save (DCP) here and resume from the newest readable checkpoint in it")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="steps between checkpoints")] = 0,
    resume_from: Annotated[Path | None, typer.Option(
        "--resume-from", help="start from this checkpoint (a step-N directory) instead of the newest")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="seconds a rank waits in a collective before the job fails")] = 300.0,
    max_restarts: Annotated[int, typer.Option("--max-restarts", help="torchrun restarts after a failure")] = 0,
    hf_checkpoint: Annotated[Path | None, typer.Option(
        "--hf-checkpoint", help="start from Hugging Face safetensors weights in this directory")] = None,
    adaptive: Annotated[bool, typer.Option(
        "--adaptive", help="detect straggling ranks and re-plan around them while training")] = False,
    inject_slow: Annotated[str | None, typer.Option(
        "--inject-slow", help="simulated stragglers RANK:FACTOR@STEP[,...] (FACTOR 1: recovered)")] = None,
    profile: Annotated[Path | None, typer.Option(
        "--profile", help="a `plait profile` file the re-planner prices plans with")] = None,
    varlen: Annotated[str | None, typer.Option(
        "--varlen", help="variable-length documents, layout per step: flexsp | bytescale | static")] = None,
    lengths: Annotated[Path | None, typer.Option(
        "--lengths", help="--varlen: document lengths to draw from (default: 10k Wikipedia lengths)")] = None,
    capacity: Annotated[int, typer.Option("--capacity", help="--varlen: tokens a rank holds at once")] = 1024,
    sp: Annotated[int | None, typer.Option("--sp", help="--varlen static: the sequence-parallel degree")] = None,
    cp_mode: Annotated[str, typer.Option(
        "--cp-mode", help="--varlen flexsp/static: ulysses | ring (how a group splits a row)")] = "ulysses",
) -> None:
    """Train with a plan on this machine's ranks (launches torchrun), or inside an existing torchrun job.
    With --varlen, train on variable-length documents whose parallel layout is planned every step."""
    import os

    from plait.models.hf_weights import HF_FAMILIES
    from plait.runtime import preflight
    from plait.runtime.placement import check_executable
    from plait.runtime.train import TrainConfig
    from plait.spec.cluster import local_ranks

    try:
        m = load_model(model)
        preflight.check_numbers(lr=lr, seed=seed, timeout_s=timeout)
        metrics_file = output_path(metrics_out, "metrics.jsonl", "--metrics-out") if metrics_out is not None else None
        if seq_len is not None:
            preflight.check_seq_len(seq_len, m)
        inside = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
        world = int(os.environ["WORLD_SIZE"]) if inside else nproc
        if varlen is not None:
            cfg, world = _varlen_config(m, model, varlen, world or 1, steps, global_batch, seed, lr, dtype, data,
                                        metrics_file, lengths, capacity, sp, cp_mode, plan or strategy,
                                        checkpoint_dir or hf_checkpoint or adaptive or inject_slow or resume_from)
            if not inside:
                preflight.check_host_memory(m, world)
            _launch(replace(cfg, timeout_s=timeout), world, inside, max_restarts)
            return
        if (plan is None) == (strategy is None):
            raise PlaitError("give exactly one of --plan FILE or --strategy \"dp=..,tp=..\"")
        if steps <= 0 or (world is not None and world <= 0):
            raise PlaitError("--steps and --nproc must be positive")
        if plan is not None:
            p = read_plan(plan, m, local_ranks(world or 1), seq_len)
            world = world or p.ranks[-1] + 1
        else:
            world = world or 1
            text = strategy or ""
            if global_batch is not None and "gbs=" not in text:
                text += f",gbs={global_batch}"
            p = uniform_plan(text, m, local_ranks(world), seq_len or min(m.max_seq_len, 256))
        if global_batch is not None and global_batch != p.global_batch:
            raise PlaitError(f"--global-batch {global_batch} differs from the plan's {p.global_batch}")
        preflight.check_seq_len(p.seq_len, m)
        validate_plan(p, m, local_ranks(world))
        check_executable(p, m, world)
        if data is not None and not data.is_file():
            raise PlaitError(f"data file {str(data)!r} does not exist; give a text file or omit --data")
        if dtype not in ("fp32", "bf16"):
            raise PlaitError(f"--dtype must be fp32 or bf16, got {dtype!r}")
        cfg = TrainConfig(model=model, plan=json.loads(p.model_dump_json()), steps=steps, seed=seed, lr=lr,
                          dtype=dtype, data=str(data) if data else None,
                          metrics_out=str(metrics_file) if metrics_file else None,
                          checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                          checkpoint_every=checkpoint_every, timeout_s=timeout,
                          resume_from=str(resume_from) if resume_from else None,
                          hf_checkpoint=str(hf_checkpoint) if hf_checkpoint else None, adaptive=adaptive,
                          inject_slow=inject_slow, profile=str(profile) if profile else None)
        if inject_slow is not None:
            from plait.runtime.stragglers import parse_injections

            parse_injections(inject_slow, world)
        if profile is not None:
            from plait.cost.profile_file import load_profile

            load_profile(profile)
        if hf_checkpoint is not None and m.family not in HF_FAMILIES:
            raise PlaitError(f"--hf-checkpoint loads {' and '.join(HF_FAMILIES)} models, not {m.family} "
                             f"({m.name}); drop it to start from the seed")
        if hf_checkpoint is not None and not any(hf_checkpoint.glob("*.safetensors")):
            raise PlaitError(f"--hf-checkpoint {str(hf_checkpoint)!r} holds no .safetensors files; give a Hugging "
                             "Face model directory")
        if checkpoint_every < 0 or max_restarts < 0:
            raise PlaitError("--checkpoint-every and --max-restarts must be >= 0")
        if checkpoint_every and checkpoint_dir is None:
            raise PlaitError("--checkpoint-every saves into --checkpoint-dir; give --checkpoint-dir DIR or drop "
                             "--checkpoint-every")
        _check_checkpoints(checkpoint_dir, resume_from, m)
        if not inside:
            preflight.check_host_memory(m, world)
    except PlaitError as exc:
        fail(str(exc))
        return
    _launch(cfg, world, inside, max_restarts)


def _check_checkpoints(directory: Path | None, resume_from: Path | None, m: ModelSpec) -> None:
    """Before launching: the checkpoint directory can take a checkpoint, and the one to resume from is
    readable and holds this model (unreadable ones are skipped with a note)."""
    from plait.runtime import checkpoint
    from plait.runtime.preflight import check_checkpoint_dir

    if resume_from is not None:
        checkpoint.check_resume_from(resume_from, m)
    if directory is not None:
        check_checkpoint_dir(directory, m)
        if resume_from is None:
            checkpoint.resumable(directory, m, lambda line: None)  # rank 0 notes the ones it skips


def _varlen_config(m, model: str, method: str, world: int, steps: int, global_batch: int | None, seed: int,
                   lr: float, dtype: str, data: Path | None, metrics_out: Path | None, lengths: Path | None,
                   capacity: int, sp: int | None, cp_mode: str, layout: object, other: object):
    """The TrainConfig of a `train --varlen` run (PlaitError on bad options) and its ranks."""
    from importlib.resources import files

    from plait.planner.varlen import load_lengths
    from plait.runtime.train import TrainConfig
    from plait.runtime.varlen import check_config

    if layout:
        raise PlaitError("--varlen plans the layout of every step itself; drop --plan/--strategy")
    if steps <= 0 or world <= 0 or (global_batch is not None and global_batch <= 0):
        raise PlaitError("--steps, --nproc and --global-batch must be positive")
    if dtype not in ("fp32", "bf16"):
        raise PlaitError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    if data is not None and not data.is_file():
        raise PlaitError(f"data file {str(data)!r} does not exist; give a text file or omit --data")
    path = str(lengths) if lengths else str(files("plait") / "data" / "wikipedia-lengths-10k.txt")
    load_lengths(path)
    cfg = TrainConfig(model=model, plan={}, steps=steps, seed=seed, lr=lr, dtype=dtype,
                      data=str(data) if data else None, metrics_out=str(metrics_out) if metrics_out else None,
                      varlen=method, lengths=path, global_batch=global_batch or 4 * world, capacity=capacity,
                      sp=sp, cp_mode=cp_mode)
    check_config(cfg, m, world)
    if other:
        raise PlaitError("--checkpoint-dir, --resume-from, --hf-checkpoint, --adaptive and --inject-slow do not combine with "
                         "--varlen yet; drop them")
    return cfg, world


def _launch(cfg, world: int, inside: bool, max_restarts: int) -> None:
    """Run `cfg` on `world` ranks: here when already inside torchrun, else through a new torchrun job."""
    import os
    import subprocess
    import tempfile

    from plait.runtime.launch import ERROR_DIR_ENV

    with tempfile.TemporaryDirectory(prefix="plait-train.") as tmp:
        config_path = os.path.join(tmp, "config.json")
        Path(config_path).write_text(cfg.to_json())
        if inside:
            from plait.runtime.worker import main as worker_main

            code = worker_main([config_path])
        else:
            cmd = [sys.executable, "-m", "plait.runtime.launch", "--standalone", f"--nproc-per-node={world}",
                   f"--max-restarts={max_restarts}", "-m", "plait.runtime.worker", config_path]
            env = {**os.environ, "OMP_NUM_THREADS": "1", ERROR_DIR_ENV: tmp}
            code = subprocess.run(cmd, check=False, env=env).returncode
    raise typer.Exit(code)


def main() -> None:
    """Entry point of the `plait` console script: argument errors also end in one line and exit 2."""
    try:
        code = app(standalone_mode=False)
    except Exception as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help text has been printed
            sys.exit(0)
        if not hasattr(exc, "format_message"):
            raise
        message = exc.format_message().replace("\n", " ").rstrip(".")
        err.print(f"[bold red]error:[/] {message}; see `plait --help`", highlight=False)
        sys.exit(2)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
