"""`plait varlen`: plan sampled global batches of variable-length sequences."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from plait.cli.common import (JsonOpt, ModelOpt, PrecisionOpt, ReportOpt, app, check_precision, load_inputs,
                              one_line_errors, optional_output, out, print_json, search_progress)
from plait.cli.tables import fmt_s
from plait.errors import PlaitError
from plait.spec.cluster import Cluster


@app.command(name="varlen")
def varlen_cmd(
    model: ModelOpt,
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="NODESxGPUSxTYPE (e.g. 8x8xA100-80GB) or YAML")],
    lengths: Annotated[Path, typer.Option("--lengths", help="sequence lengths, one token count per line")],
    global_batch: Annotated[int, typer.Option("--global-batch", "-b", help="sequences per global batch")],
    batches: Annotated[int, typer.Option("--batches", help="global batches to sample and plan")] = 4,
    seed: Annotated[int, typer.Option("--seed", help="seed of the sampling")] = 0,
    method: Annotated[str, typer.Option("--method", help="flexsp | bytescale | static")] = "flexsp",
    sp: Annotated[int | None, typer.Option("--sp", help="static: the sequence-parallel degree")] = None,
    cp_mode: Annotated[str, typer.Option("--cp-mode", help="static: ulysses | ring (a DP x CP mesh)")] = "ulysses",
    capacity: Annotated[int, typer.Option("--capacity", help="tokens a device holds at once")] = 32768,
    states: Annotated[str, typer.Option("--states", help="model states: sharded (over all devices) | replicated")
                      ] = "sharded",
    offload_above: Annotated[int, typer.Option(
        "--offload-above", help="sequences of at least this many tokens swap activations to host (0: none)")] = 0,
    precision: PrecisionOpt = "bf16",
    as_json: JsonOpt = False,
    report_out: ReportOpt = None,
) -> None:
    """Plan sampled global batches of variable-length sequences: per-step sequence-parallel groups (FlexSP),
    ByteScale-style balance scheduling, or static sequence parallelism."""
    from plait.planner.varlen import SequenceCost, load_lengths, sample_batches

    with one_line_errors():
        page_path = optional_output(report_out, "report.html", "--report")
        m, c, _ = load_inputs(model, cluster, None, None)
        _check_options(method, cp_mode, sp, c, batches, global_batch, capacity, precision)
        held = _check_states(states, m, c, precision)
        mode = "ring" if method == "bytescale" else cp_mode
        if offload_above < 0:
            raise PlaitError(f"--offload-above is a length in tokens (0: no offloading), got {offload_above}")
        cost = SequenceCost(m, c, precision=precision, cp_mode=mode, offload_above=offload_above)
        sampled = sample_batches(load_lengths(lengths), batches, global_batch, seed)
        rows = _plan_batches(sampled, c, cost, capacity, method, sp)
        total = sum(r["time_s"] for r in rows)
        solve = sum(r["solve_time_s"] for r in rows)
        result = {"total_time_s": total, "solve_time_s": solve, "states": states, "states_bytes_per_device": held,
                  "per_batch": rows}
        if page_path is not None:
            from plait.report import write_page

            write_page(page_path, "varlen", result, [], m, c, {"method": method, "global batch": global_batch,
                                                                 "capacity": capacity, "precision": precision})
    if as_json:
        print_json(result)
        return
    _print_batches(rows, f"{m.name} on {c.name}, {method}{f' sp={sp}' if sp else ''}, {capacity} tokens per device")
    out.print(f"total planned time {total:.3f} s over {len(rows)} batches; solver {solve:.2f} s "
              f"({solve / len(rows):.2f} s per batch); model states {held / 2**30:.2f} GiB per device ({states})")


def _check_states(states: str, m, c: Cluster, precision: str) -> float:
    """Model states' bytes per device; PlaitError if they are not sharded|replicated or exceed a device."""
    from plait.planner.varlen import STATES, states_bytes

    if states not in STATES:
        raise PlaitError(f"--states must be one of {', '.join(STATES)}, got {states!r}")
    held = states_bytes(m, c.world_size, precision, states)
    if held > c.gpu.memory_bytes:
        raise PlaitError(f"{states} model states take {held / 2**30:.1f} GiB per device, more than its "
                         f"{c.gpu.memory_bytes / 2**30:.0f} GiB; "
                         + ("use --states sharded" if states == "replicated" else "use more devices"))
    return held


def _check_options(method: str, cp_mode: str, sp: int | None, c: Cluster, batches: int, global_batch: int,
                   capacity: int, precision: str) -> None:
    if method not in ("flexsp", "bytescale", "static"):
        raise PlaitError(f"--method must be flexsp, bytescale or static, got {method!r}")
    if cp_mode not in ("ulysses", "ring"):
        raise PlaitError(f"--cp-mode must be ulysses or ring, got {cp_mode!r}")
    if sp is not None and (method != "static" or sp <= 0 or sp & (sp - 1) or sp > c.world_size):
        raise PlaitError(f"--sp goes with --method static and is a power of two up to {c.world_size}; got {sp}")
    if batches <= 0 or global_batch <= 0 or capacity <= 0:
        raise PlaitError("--batches, --global-batch and --capacity must be positive")
    check_precision(precision)


def _plan_batches(sampled: list, c: Cluster, cost, capacity: int, method: str, sp: int | None) -> list[dict]:
    """Plan every sampled batch under a progress bar; one row of numbers per batch."""
    from plait.planner.varlen import plan_batch

    bar, update = search_progress("planning {} batches")
    rows = []
    with bar:
        for i, batch in enumerate(sampled):
            p = plan_batch(batch, c.world_size, cost, capacity, method, sp)
            rows.append({"sequences": len(batch), "tokens": int(sum(batch)), "longest": int(max(batch)),
                         "micro_batches": len(p.micro_batches), "time_s": p.seconds, "solve_time_s": p.solve_time_s,
                         "group_sizes": [sorted(Counter(g.degree for g in mb.groups).items())
                                         for mb in p.micro_batches]})
            update(method, i + 1, len(sampled))
    return rows


def _print_batches(rows: list[dict], title: str) -> None:
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("batch", "tokens", "longest", "micro-batches", "group sizes (size x count)", "planned", "solver"):
        table.add_column(col, justify="left" if col.startswith("group") else "right")
    for i, r in enumerate(rows):
        sizes = " | ".join(" ".join(f"{d}x{n}" for d, n in mb) for mb in r["group_sizes"])
        table.add_row(str(i), f"{r['tokens']:,}", f"{r['longest']:,}", str(r["micro_batches"]), sizes,
                      fmt_s(r["time_s"]), f"{r['solve_time_s']:.2f} s")
    out.print(table)
