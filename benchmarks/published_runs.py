"""Predicted vs published: every published training run we have, simulated with plait's default model.

    python benchmarks/published_runs.py [--json]

Reads the six reference runs in ../shared/data/published/training-runs.json (when present) and the
larger collection in benchmarks/data/published_runs.json, simulates each layout, and prints the published
figure, plait's prediction and the relative error, then summary statistics.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plait.published import load_runs, relative_errors
from plait.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "reference": ROOT.parent / "shared" / "data" / "published" / "training-runs.json",
    "collected": ROOT / "benchmarks" / "data" / "published_runs.json",
}


def main() -> None:
    console = Console(width=200)
    table = Table(title="plait predictions vs published training runs")
    for col in ("set", "source", "GPUs", "GPU", "layout", "figure", "published", "predicted", "error"):
        table.add_column(col, justify="right" if col in ("GPUs", "published", "predicted", "error") else "left",
                         overflow="fold")
    errors: dict[str, list[float]] = {"reference": [], "megatron": [], "other": []}
    rows = []
    for name, path in FILES.items():
        if not path.exists():
            console.print(f"[yellow]{path} not found; skipped[/]")
            continue
        runs, skipped = load_runs(path)
        for run in runs:
            report = simulate(run.plan, run.model, run.cluster)
            other = "DeepSpeed" in run.source
            for key, (pub, ours, err) in relative_errors(run, report).items():
                group = "reference" if name == "reference" else ("other" if other else "megatron")
                errors[group].append(err)
                rows.append({"set": name, "source": run.source, "gpus": run.cluster.world_size, "figure": key,
                             "published": pub, "predicted": ours, "error": err, "strategy": run.strategy})
                colour = "green" if abs(err) <= 0.10 else "red"
                table.add_row(name, run.source[:70], str(run.cluster.world_size), run.cluster.gpu.name,
                              run.strategy.replace(",precision", " ").replace("cp_mode=ulysses", "")[:60], key,
                              f"{pub:.4g}", f"{ours:.4g}", f"[{colour}]{err:+.1%}[/]")
        for source, reason in skipped:
            table.add_row(name, source[:70], "", "", "", "skipped", "", "", reason[:40])
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
        return
    console.print(table)
    summary = Table(title="summary (|relative error|)")
    for col in ("runs", "figures", "median", "max", "within 10%"):
        summary.add_column(col, justify="right")
    labels = {"reference": "reference runs (shared/data/published)", "megatron": "collected, Megatron-LM software",
              "other": "collected, DeepSpeed pipeline engine (MT-NLG)"}
    for group, errs in errors.items():
        if errs:
            a = [abs(e) for e in errs]
            summary.add_row(labels[group], str(len(a)), f"{statistics.median(a):.1%}", f"{max(a):.1%}",
                            f"{sum(x <= 0.10 for x in a)}/{len(a)}")
    console.print(summary)


if __name__ == "__main__":
    main()
