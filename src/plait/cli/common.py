"""What every `plait` command shares: the typer app and its entry point, one-line errors, the options that
several commands take, reading the model, cluster and plan they name, progress bars and JSON output.

Bad input ends with one line on stderr (what is wrong and what fixes it) and exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from plait.cost.precision import PRECISIONS as PRICED_PRECISIONS
from plait.errors import PlaitError
from plait.io import json_line, output_path
from plait.plan import Plan, load_plan, uniform_plan, validate_plan
from plait.spec.cluster import Cluster, load_cluster
from plait.spec.model import ModelSpec, load_model

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find, predict and run the fastest hybrid-parallel layout for training a transformer.")
out = Console(width=None if sys.stdout.isatty() else 120)  # files and pipes get full-width tables
err = Console(stderr=True, width=10_000)  # one-line errors are never wrapped

MAX_MEMORY_GIB = 2.0**20
"""Largest --memory-gib (1 PiB per device)."""
MAX_GLOBAL_BATCH = 65536
"""Largest `plan --global-batch`, sequences (the search's time and memory grow with it)."""
PRECISIONS = tuple(PRICED_PRECISIONS)
"""--precision choices: those the cost model prices."""

# Options that several commands take, with the same flags and help text.
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="preset, config.json path, or gpt:/llama:/t5: spec")]
ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="NODESxGPUSxTYPE (e.g. 2x8xH100-80GB) or YAML")]
SeqLenOpt = Annotated[int | None, typer.Option("--seq-len", "-s", help="tokens per sequence")]
PlanOpt = Annotated[Path | None, typer.Option("--plan", help="plan JSON/YAML")]
StrategyOpt = Annotated[str | None, typer.Option("--strategy", help='e.g. "tp=8,pp=8,dp=16,mbs=1,gbs=1536"')]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object and nothing else")]
SlowOpt = Annotated[str | None, typer.Option("--slow", help="straggling devices RANK:FACTOR[,...]")]
MemoryOpt = Annotated[float | None, typer.Option("--memory-gib", help="device memory override, GiB")]
GalvatronProfileOpt = Annotated[str | None, typer.Option(
    "--galvatron-profile", help="calibrate from Galvatron profiles: GPU:MODEL_DIR[:HARDWARE_DIR]")]
GalvatronSpOpt = Annotated[bool, typer.Option(
    "--galvatron-sequence-parallel", help="Galvatron runs with --sequence-parallel (Megatron SP on every "
                                          "tensor-parallel layer)")]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="calibrate from a `plait profile` file")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="bf16 | fp16 | fp32")]
ReportOpt = Annotated[str | None, typer.Option("--report", help="also write an HTML report page")]


def fail(message: str) -> None:
    """Print a one-line error and exit with 2."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@contextmanager
def one_line_errors() -> Iterator[None]:
    """A PlaitError raised inside ends the command with its one line and exit code 2."""
    try:
        yield
    except PlaitError as exc:
        fail(str(exc))


def print_json(obj: object) -> None:
    """The `--json` output: one JSON object on one line of stdout, and nothing else."""
    sys.stdout.write(json_line(obj))


def optional_output(value: str | None, default_name: str, option: str) -> Path | None:
    """The checked output path of an optional `option` (None when it is not given)."""
    return output_path(value, default_name, option) if value is not None else None


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise PlaitError(f"--precision must be {', '.join(PRECISIONS[:-1])} or {PRECISIONS[-1]}, got {precision!r}")


def draw_picture(draw: Callable[[], None], path: str) -> None:
    """Run `draw`, which writes the picture at `path`; an OS error becomes a one-line PlaitError."""
    try:
        draw()
    except OSError as exc:
        raise PlaitError(f"cannot write timeline {path!r}: {exc.strerror or exc}; choose a writable path") from None


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
                profile: Path | None = None, galvatron_profile: str | None = None, seq_len: int | None = None):
    """(model, cluster, calibration or None) from the command line; a `plait profile` file calibrates the
    cluster's device type (and names it: `1x4xCPU`); `seq_len` dates Galvatron profiles whose file names do
    not."""
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
        cal = load_calibration(galvatron_profile, m, c, seq_len)
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


def load_calibration(spec: str | None, model: ModelSpec, cluster: Cluster, seq_len: int | None = None):
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
    profiles = load_galvatron_profiles(model_dir, hardware_dir or None, gpu, seq_len=seq_len)
    return to_calibration(profiles, model, cluster, calibration_for(cluster.gpu.name))


@contextmanager
def warnings_as_notes() -> Iterator[None]:
    """Print the warnings the block issues as one-line notes on stderr (not Python's warning format)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                err.print(f"[yellow]note:[/] {escape(str(w.message))}", highlight=False)


def read_plan(path: Path, model: ModelSpec, cluster: Cluster, seq_len: int | None,
              galvatron_sp: bool = False) -> Plan:
    """A plait plan file, or a Galvatron `galvatron_config_*.json` (recognised by its keys; `galvatron_sp`:
    Galvatron ran it with --sequence-parallel)."""
    if path.suffix == ".json" and path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raw = None
        if isinstance(raw, dict) and "pp_deg" in raw and "tp_sizes_enc" in raw:
            from plait.galvatron import load_galvatron_config

            with warnings_as_notes():
                return load_galvatron_config(path, model, cluster, seq_len or model.max_seq_len,
                                             sequence_parallel=galvatron_sp)
    if galvatron_sp:
        raise PlaitError(f"--galvatron-sequence-parallel applies to a Galvatron galvatron_config_*.json, but "
                         f"{str(path)!r} is not one; drop the option (a plait plan says sp per layer)")
    plan = load_plan(path)
    if seq_len is not None and seq_len != plan.seq_len:
        plan = Plan.model_validate({**plan.model_dump(), "seq_len": seq_len})
    return plan


def plan_of(plan: Path | None, strategy: str | None, m: ModelSpec, c: Cluster, seq_len: int | None,
            galvatron_sp: bool = False) -> Plan:
    """The validated plan that `--plan FILE` or `--strategy` gives (exactly one of them); `galvatron_sp`:
    a Galvatron config given with --plan ran with --sequence-parallel."""
    if (plan is None) == (strategy is None):
        raise PlaitError("give exactly one of --plan FILE or --strategy \"tp=..,pp=..,dp=..\"")
    if galvatron_sp and plan is None:
        raise PlaitError("--galvatron-sequence-parallel applies to a Galvatron config given with --plan; with "
                         "--strategy write sp=1 instead")
    if seq_len is not None and seq_len <= 0:
        raise PlaitError(f"--seq-len must be a positive number of tokens, got {seq_len}")
    p = read_plan(plan, m, c, seq_len, galvatron_sp) if plan is not None else \
        uniform_plan(strategy or "", m, c, seq_len or m.max_seq_len)
    validate_plan(p, m, c)
    return p


def search_progress(label: str = "searching ({} plans)"):
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
