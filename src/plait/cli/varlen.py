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
    stages: Annotated[int, typer.Option(
        "--stages", help="pipeline stages, each running the groups on its devices (0: the fewest whose states fit)")
                      ] = 0,
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
        stages, held = _check_states(states, m, c, precision, stages)
        if sp is not None and sp > c.world_size // stages:
            raise PlaitError(f"--sp {sp} exceeds the {c.world_size // stages} devices of a stage; give at most that")
        mode = "ring" if method == "bytescale" else cp_mode
        if offload_above < 0:
            raise PlaitError(f"--offload-above is a length in tokens (0: no offloading), got {offload_above}")
        cost = SequenceCost(m, c, precision=precision, cp_mode=mode, offload_above=offload_above, stages=stages)
        sampled = sample_batches(load_lengths(lengths), batches, global_batch, seed)
        rows = _plan_batches(sampled, c, cost, capacity, method, sp)
        total = sum(r["time_s"] for r in rows)
        solve = sum(r["solve_time_s"] for r in rows)
        stage_plan = {"stages": stages, "devices_per_stage": c.world_size // stages,
                      "layers": [list(cut) for cut in cost.cuts]}
        result = {"total_time_s": total, "solve_time_s": solve, "states": states, "states_bytes_per_device": held,
                  "pipeline": stage_plan, "per_batch": rows}
        if page_path is not None:
            from plait.report import write_page

            write_page(page_path, "varlen", result, [], m, c, {"method": method, "global batch": global_batch,
                                                                 "capacity": capacity, "precision": precision})
    if as_json:
        print_json(result)
        return
    _print_batches(rows, f"{m.name} on {c.name}, {method}{f' sp={sp}' if sp else ''}, {capacity} tokens per device")
    out.print(_stage_line(stage_plan, sum(r["bubble_s"] for r in rows)))
    out.print(f"total planned time {total:.3f} s over {len(rows)} batches; solver {solve:.2f} s "
              f"({solve / len(rows):.2f} s per batch); model states {held / 2**30:.2f} GiB per device ({states})")


def _check_states(states: str, m, c: Cluster, precision: str, stages: int) -> tuple[int, float]:
    """The pipeline stages (`stages`, or with 0 the fewest whose model states fit a device) and the states'
    bytes per device; PlaitError if they are not sharded|replicated, the stages do not cut the model and
    the devices, or the states exceed a device."""
    from plait.planner.varlen import STATES, fewest_stages, stage_counts, states_bytes

    if states not in STATES:
        raise PlaitError(f"--states must be one of {', '.join(STATES)}, got {states!r}")
    allowed = stage_counts(c.world_size, m.layers)
    if stages and stages not in allowed:
        raise PlaitError(f"--stages must be one of {', '.join(map(str, allowed))} (powers of two dividing the "
                         f"{c.world_size} devices, at most the {m.layers} layers), or 0 to choose; got {stages}")
    stages = stages or fewest_stages(m, c.world_size, precision, states, c.gpu.memory_bytes)
    held = states_bytes(m, c.world_size, precision, states, stages)
    if held > c.gpu.memory_bytes:
        raise PlaitError(f"{states} model states take {held / 2**30:.1f} GiB per device with {stages} stage(s), "
                         f"more than its {c.gpu.memory_bytes / 2**30:.0f} GiB; "
                         + ("use --states sharded or more --stages" if states == "replicated" else "use more devices"))
    return stages, held


def _stage_line(plan: dict, bubble_s: float) -> str:
    """The stage plan in one line: stages, devices each, their layers and the pipeline's fill and drain."""
    if plan["stages"] == 1:
        return f"one stage: every group of a micro-batch on the {plan['devices_per_stage']} devices"
    cuts = " | ".join(f"{a}-{b - 1}" for a, b in plan["layers"])
    return (f"pipeline of {plan['stages']} stages x {plan['devices_per_stage']} devices (layers {cuts}); each stage "
            f"runs every micro-batch's groups on its devices; fill and drain {fmt_s(bubble_s)} in all")


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
                         "micro_batches": len(p.micro_batches), "time_s": p.seconds, "bubble_s": p.bubble_s,
                         "solve_time_s": p.solve_time_s,
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
