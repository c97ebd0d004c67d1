"""A real straggler on this machine: 4 gloo ranks, one slowed mid-run, static plan vs live re-planning.

    python benchmarks/straggler_live.py        # ~4 minutes
    python benchmarks/straggler_live.py --strategy dp=2,tp=2 --replan-degrees keep --out /tmp/shrunk.json

Four runs of the same training job (same seed and data) with `plait train`: healthy; with rank 3 slowed
FACTORx from step SLOW_AT (a sleep of FACTOR - 1 times its compute, `--inject-slow`), keeping the plan
(static); and the same with `--adaptive` (detect, re-plan in the background, switch plans live), its state
moved over the network (the default) or through a DCP save and load (`--switch-via dcp`). Printed: median
step time of each run before the slowdown, while slowed after the switch, the losses' largest difference
from the static run, and the seconds each adaptive run's switch took. Target (issue: straggler-resilient
training): after detection and re-planning the step time is <= 0.6x the static plan's, and the losses match.
Starting from `--strategy dp=2,tp=2`, the re-plan shrinks the slow rank's tensor-parallel unit to its healthy
member beside the full unit (issue: every plan the planners find runs): after the switch the step time is
within 1.3x of the healthy run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from train_run import plait_train

MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=688,vocab=512"
console = Console(width=150)


def train(tmp: Path, name: str, args: argparse.Namespace, *extra: str) -> list[dict]:
    return plait_train(name, tmp / f"{name}.jsonl", "--model", MODEL, "--strategy",
                       f"{args.strategy},gbs={args.gbs}", "--nproc", "4", "--steps", str(args.steps),
                       "--seq-len", str(args.seq), *extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--slow-at", type=int, default=4)
    ap.add_argument("--factor", type=float, default=5.0)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--strategy", default="dp=4", help="the starting plan on 4 ranks (without gbs)")
    ap.add_argument("--replan-degrees", default="any", help="any | keep (plait train --replan-degrees)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "straggler_live.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    inject = f"3:{args.factor}@{args.slow_at}"
    replan = ("--replan-degrees", args.replan_degrees)
    runs = {"healthy": train(tmp, "healthy", args),
            "static": train(tmp, "static", args, "--inject-slow", inject),
            "adaptive": train(tmp, "adaptive", args, "--inject-slow", inject, "--adaptive", *replan),
            "adaptive (dcp)": train(tmp, "adaptive-dcp", args, "--inject-slow", inject, "--adaptive", *replan,
                                    "--switch-via", "dcp")}
    switches = {name: next((r for r in runs[name] if "switch" in r), None)
                for name in ("adaptive", "adaptive (dcp)")}
    if None in switches.values():
        raise SystemExit(f"an adaptive run never switched plans: {switches}")
    switch = switches["adaptive"]
    after = switch["step"] + 2  # the first full step under the new plan, plus one to settle
    phases = {"before the slowdown": range(1, args.slow_at), "slowed, after the switch": range(after, args.steps)}
    table = Table(title=f"median seconds per step, 4 gloo ranks, rank 3 slowed {args.factor}x from step {args.slow_at}")
    table.add_column("steps")
    for name in runs:
        table.add_column(name, justify="right")
    table.add_column("adaptive / static", justify="right")
    medians: dict[str, dict[str, float]] = {}
    for phase, steps in phases.items():
        medians[phase] = {name: statistics.median(r["step_time_s"] for r in rs if r["step"] in steps)
                          for name, rs in runs.items()}
        m = medians[phase]
        table.add_row(f"{phase} ({steps.start}-{steps.stop - 1})", *(f"{m[n]:.3f}" for n in runs),
                      f"{m['adaptive'] / m['static']:.2f}x")
    console.print(table)
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for name in switches
                for a, b in zip(runs["static"], runs[name]))
    ratio = medians["slowed, after the switch"]["adaptive"] / medians["slowed, after the switch"]["static"]
    for name, record in switches.items():
        console.print(f"{name}: switched after step {record['step']} to {record['switch']['to']} (detected speeds "
                      f"{', '.join(f'{s:.1f}' for s in record['speed'])})")
    seconds = {record["switch"]["via"]: {key: record["switch"][key] for key in ("seconds", "build_seconds",
                                                                                "state_seconds")}
               for record in switches.values()}
    console.print("switch seconds (total = building the new plan + moving the state): " + ", ".join(
        f"{via} {s['seconds']:.2f} = {s['build_seconds']:.2f} + {s['state_seconds']:.2f}"
        for via, s in seconds.items()) + f"; network switch sent {switch['switch']['sent_bytes']:,} bytes")
    healthy = medians["slowed, after the switch"]["adaptive"] / medians["slowed, after the switch"]["healthy"]
    console.print(f"adaptive step time {ratio:.2f}x the static plan's (target <= 0.6) and {healthy:.2f}x the "
                  f"healthy run's; losses differ from the static run's by at most {worst:.1e} (relative)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": MODEL, "strategy": args.strategy, "factor": args.factor,
                                    "slow_at": args.slow_at,
                                    "switch_step": switch["step"], "switch_to": switch["switch"]["to"],
                                    "switch_seconds": seconds,
                                    "medians": medians, "ratio": ratio, "vs_healthy": healthy,
                                    "max_loss_diff": worst}, indent=1) + "\n")


if __name__ == "__main__":
    main()
