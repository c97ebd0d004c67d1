"""`plait profile`: measure this machine and write a profile that calibrates the cost model."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from plait.cli.common import app, one_line_errors, out, search_progress
from plait.io import output_path
from plait.spec.cluster import GIB
from plait.spec.model import load_model


@app.command(name="profile")
def profile_cmd(
    model: Annotated[str, typer.Option("--model", help="preset, config.json or inline spec whose layers to measure")],
    nproc: Annotated[int, typer.Option("--nproc", help="ranks to measure collectives with (group sizes up to it)")] = 2,
    out_path: Annotated[str, typer.Option("--out", help="the profile JSON to write")] = "profile.json",
    quick: Annotated[bool, typer.Option("--quick", help="fewer sizes and repetitions (seconds, not minutes)")] = False,
    gpu_type: Annotated[str | None, typer.Option(
        "--gpu-type", help="the cluster device type the profile applies to (default: CPU, or the CUDA name)")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="measure the layers in fp32, or in bf16 (as bf16 training computes them)")] = "fp32",
) -> None:
    """Measure this machine and the runtime's parallel strategies on it; write a profile for --profile."""
    import time

    from plait.profile.run import profile

    with one_line_errors():
        profile_file = output_path(out_path, "profile.json", "--out")
        m = load_model(model)
        bar, update = search_progress("measuring {}")
        t0 = time.perf_counter()
        with bar:
            result = profile(m, nproc, quick=quick, gpu_type=gpu_type, progress=update, dtype=dtype)
        result.save(profile_file)
    print_profile(result)
    out.print(f"profiled in {time.perf_counter() - t0:.0f} s; written to {profile_file}")


def print_profile(p) -> None:
    """Device, layer curves and collective curves of a profile, as tables."""
    d = p.device
    out.print(f"[bold]{d.name}[/] ({d.kind}, applies to device type {d.gpu_type}; {p.dtype}): "
              f"{d.peak_flops / 1e9:,.1f} GFLOP/s "
              f"per rank, copy {d.memory_bandwidth / 1e9:,.1f} GB/s, {d.memory_bytes / GIB:,.1f} GiB per rank, "
              f"process {p.process_bytes / 2**20:,.0f} MiB")
    _print_layers(p)
    coll = Table(title="collectives (seconds = latency + bytes per rank / bandwidth)", box=box.SIMPLE_HEAD)
    for col in ("op", "ranks", "latency us", "bandwidth GB/s"):
        coll.add_column(col, justify="left" if col == "op" else "right")
    for c in p.collectives:
        coll.add_row(c.op, str(c.ranks), f"{c.latency_s * 1e6:,.0f}", f"{c.bandwidth / 1e9:.2f}")
    out.print(coll)
    out.print(f"overlap: compute x{p.overlap.compute_slowdown:.2f}, communication x{p.overlap.comm_slowdown:.2f} "
              "when both run at once")
    if p.strategies:
        _print_strategies(p)
    if p.optimizer is not None:
        out.print(f"optimizer step (clip + AdamW + zero grads): {p.optimizer.intercept_s * 1e3:.1f} ms + "
                  f"{p.optimizer.per_param_s * 1e9:.2f} ns per parameter")


def _print_layers(p) -> None:
    layers = Table(title="layers (one micro-batch on one rank)", box=box.SIMPLE_HEAD)
    for col in ("part", "tp", "ep", "recompute", "fwd us/token", "bwd us/token", "fwd ns/token/seq",
                "act bytes/token"):
        layers.add_column(col, justify="right" if col not in ("part", "recompute") else "left")
    for lp in p.layers:  # the trunk decoder layer, or another layer by its shape's fingerprint
        part = f"layer {lp.shape}" if lp.shape else f"block of {lp.model}"
        layers.add_row(part, str(lp.tp), str(lp.ep), lp.recompute, f"{lp.forward.per_token_s * 1e6:.2f}",
                       f"{lp.backward.per_token_s * 1e6:.2f}", f"{lp.forward.per_token_seq_s * 1e9:.3f}",
                       f"{lp.activation_bytes_per_token:,.0f}")
    for e in p.edges:
        layers.add_row(f"{e.part} of {e.model}", str(e.tp), "-", "-", f"{e.forward.per_token_s * 1e6:.2f}",
                       f"{e.backward.per_token_s * 1e6:.2f}", f"{e.forward.per_token_seq_s * 1e9:.3f}", "-")
    out.print(layers)


def _print_strategies(p) -> None:
    strat = Table(title="a block under each parallel strategy, as the runtime runs it (wall time, "
                        "communication included)", box=box.SIMPLE_HEAD)
    for col in ("strategy", "group", "busy ranks", "seqs x seq_len", "fwd ms", "bwd ms"):
        strat.add_column(col, justify="left" if col == "strategy" else "right")
    for sp in p.strategies:
        big = max(sp.samples, key=lambda x: x.seqs * x.seq_len)
        tokens = big.seqs * big.seq_len
        kind = f"{sp.kind} (layer {sp.shape})" if sp.shape else sp.kind
        strat.add_row(kind, str(sp.group), str(sp.ranks), f"{big.seqs} x {big.seq_len}",
                      f"{sp.forward.at(tokens, big.seq_len) * 1e3:.1f}",
                      f"{sp.backward.at(tokens, big.seq_len) * 1e3:.1f}")
    out.print(strat)
