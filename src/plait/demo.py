"""`make demo` (`python -m plait.demo`): the main job end to end, in about a minute on a laptop.

1. Search the fastest plan for a real model on a real cluster, beside the baselines, and write the HTML
   report page.
2. Describe this machine's CPU ranks (one quick GEMM and copy measurement) and search a plan for a tiny
   model on them.
3. Train the tiny model with that plan for a few steps and print the predicted step time beside the
   measured one.

Every step runs a `plait` command, printed before it runs, so each can be copied and varied. The demo
needs only plait's base dependencies (no test or inference extras).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.rule import Rule
from rich.table import Table

BIG_MODEL = ("llama3-8b", "1x8xA100-80GB", 8192, 64)
"""(model, cluster, seq_len, global_batch) of step 1: one DGX A100 node training Llama-3-8B at 8k context."""
TINY_MODEL = "tiny-llama"
TINY_SEQ, TINY_BATCH = 128, 8
RANKS = 2
LOCAL_LINK = {"bandwidth_gbps": 1.3, "latency_us": 300}
"""Gloo over loopback between two processes of a small machine (what `plait profile` measures here)."""
WARMUP_STEPS = 2
"""Steps left out of the measured step time (allocator and thread-pool warm-up)."""

console = Console()


def plait_argv(*args: str) -> list[str]:
    """The command line that runs `plait ARGS` with this interpreter (works without the console script on
    PATH, as `python -m plait.demo` does)."""
    return [sys.executable, "-c", "from plait.cli import main; main()", *args]


def show(args: list[str]) -> None:
    console.print(f"$ plait {shlex.join(args)}", style="bold cyan", markup=False, soft_wrap=True)


def run_plait(args: list[str], dry_run: bool, capture: bool = False) -> str:
    """Print `plait ARGS`, run it (unless a dry run) and return its output when captured."""
    show(args)
    if dry_run:
        return ""
    proc = subprocess.run(plait_argv(*args), text=True, capture_output=capture, check=False,
                          env={**os.environ, "COLUMNS": os.environ.get("COLUMNS", "120")})
    if proc.returncode != 0:
        if capture:
            sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"demo: `plait {args[0]}` failed (exit {proc.returncode})")
    return proc.stdout or ""


def heading(text: str) -> None:
    console.print()
    console.print(Rule(f"[bold]{text}[/]", align="left"))


def cpu_cluster(path: Path, ranks: int, dry_run: bool) -> None:
    """Write a cluster file of `ranks` CPU ranks of this machine from one rank's measured GEMM rate and copy
    bandwidth (a second or two), with the machine's memory shared among the ranks."""
    if dry_run:
        console.print(f"(would measure one rank's GEMM rate and copy bandwidth and write {path})")
        return
    from plait.profile.device import measure_device

    d = measure_device(ranks)
    tflops = d.peak_flops / 1e12
    gpu = {"name": "CPU", "peak_tflops": round(tflops, 4), "peak_tf32_tflops": round(tflops, 4),
           "memory_gib": round(d.memory_bytes / 2**30, 1), "hbm_gbps": round(d.memory_bandwidth / 1e9, 1),
           "sm_count": 1}
    spec = {"name": f"this machine, {ranks} CPU ranks", "nodes": 1, "gpus_per_node": ranks, "gpu": gpu,
            "intra": LOCAL_LINK, "inter": LOCAL_LINK}
    path.write_text(json.dumps(spec, indent=2) + "\n")  # JSON is YAML: the cluster loader reads it
    console.print(f"{d.name}: one rank (1 thread) does {d.peak_flops / 1e9:,.1f} GFLOP/s and copies "
                  f"{d.memory_bandwidth / 1e9:,.1f} GB/s; {ranks} ranks share "
                  f"{d.memory_bytes * ranks / 2**30:,.1f} GiB; written to {path}")


def measured_step_time(metrics: Path) -> tuple[float, int]:
    """(median step time after the warm-up steps, steps it is over) from `plait train --metrics-out`."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r]
    kept = times[WARMUP_STEPS:] or times
    return statistics.median(kept), len(kept)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m plait.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out", help="folder for the plans, report page and metrics (default: out)")
    parser.add_argument("--steps", type=int, default=5, help="training steps of the tiny model (default: 5)")
    parser.add_argument("--profile", action="store_true",
                        help="measure this machine with `plait profile --quick` (about a minute) and predict with "
                             "it, instead of the analytic model with the measured GEMM rate")
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than {WARMUP_STEPS} (the warm-up steps left out of the measurement)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    model, cluster, seq, batch = BIG_MODEL
    heading(f"1. The fastest plan for {model} on {cluster}, beside the baselines")
    run_plait(["plan", "--model", model, "--cluster", cluster, "--seq-len", str(seq), "--global-batch",
               str(batch), "--compare", "--report", str(out / "plan.html"), "--out", str(out / f"{model}-plan.json")],
              args.dry_run)
    console.print(f"Open [bold]{out / 'plan.html'}[/] in a browser: the plan per layer, the pipeline timeline, "
                  "memory by term and the search's alternatives.")

    heading(f"2. A plan for {TINY_MODEL} on this machine's {RANKS} CPU ranks")
    cluster_file = out / "cpu-cluster.yaml"
    cpu_cluster(cluster_file, RANKS, args.dry_run)
    calib: list[str] = []
    if args.profile:
        profile_file = out / "profile.json"
        run_plait(["profile", "--model", TINY_MODEL, "--nproc", str(RANKS), "--quick", "--out", str(profile_file)],
                  args.dry_run)
        calib = ["--profile", str(profile_file)]
    else:
        console.print("Predicting with the analytic cost model and the measured GEMM rate; `python -m plait.demo "
                      "--profile` measures the layers, collectives and the runtime's overheads first (a minute more) "
                      "and predicts closer.")
    plan_file = out / f"{TINY_MODEL}-plan.json"
    common = ["--model", TINY_MODEL, "--cluster", str(cluster_file), "--seq-len", str(TINY_SEQ)]
    run_plait(["plan", *common, "--global-batch", str(TINY_BATCH), "--precision", "fp32",
               "--out", str(plan_file), *calib], args.dry_run)
    predicted = None
    if not args.dry_run:
        report = json.loads(run_plait(["simulate", *common, "--plan", str(plan_file), "--json", *calib],
                                      args.dry_run, capture=True))
        predicted = report["iteration_time_s"] if "iteration_time_s" in report else report["report"]["iteration_time_s"]

    heading(f"3. Train {TINY_MODEL} with that plan for {args.steps} steps")
    metrics = out / f"{TINY_MODEL}-train.jsonl"
    run_plait(["train", "--model", TINY_MODEL, "--plan", str(plan_file), "--steps", str(args.steps),
               "--metrics-out", str(metrics)], args.dry_run)
    if args.dry_run:
        return
    measured, kept = measured_step_time(metrics)
    table = Table(title=f"{TINY_MODEL} step time on this machine", title_justify="left")
    table.add_column("predicted")
    table.add_column(f"measured (median of the last {kept} steps)")
    table.add_column("measured / predicted")
    table.add_row(f"{predicted * 1e3:,.1f} ms", f"{measured * 1e3:,.1f} ms", f"{measured / predicted:.2f}x")
    console.print()
    console.print(table)
    console.print(f"demo done in {time.perf_counter() - t0:.0f} s; files in {out}/")


if __name__ == "__main__":
    main()
