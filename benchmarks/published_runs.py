"""Predicted vs published: every published training run we have, simulated with plait's default model.

    python benchmarks/published_runs.py [--json]

Reads the six reference runs in ../shared/data/published/training-runs.json (when present) and the
larger collection in benchmarks/data/published_runs.json, simulates each layout, and prints the published
figure, plait's prediction and the relative error, then summary statistics by software family
(Megatron-LM, DeepSpeed, FSDP, MoE, offload and long context; FSDP, MoE and offload also split into the rows
constants were chosen on and the held-out rows).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from plait.published import load_runs, relative_errors

ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "reference": ROOT.parent / "shared" / "data" / "published" / "training-runs.json",
    "collected": ROOT / "benchmarks" / "data" / "published_runs.json",
}


FIGURES = {"hardware_tflops_per_gpu": "hw TFLOP/s", "model_tflops_per_gpu": "model TFLOP/s",
           "iteration_time_s": "s/iter", "mfu": "MFU", "hfu": "HFU", "tokens_per_s": "tokens/s"}


def short_source(source: str) -> str:
    """'Narayanan et al., SC21 ...' -> 'Narayanan SC21'; keeps the table narrow."""
    words = source.replace(",", " ").replace("'", " ").split()
    year = next((w for w in words if w.isdigit() and len(w) == 4), "")
    venue = next((w for w in words if w.startswith(("SC2", "NSDI", "README", "MPT-"))), year)
    return f"{words[0].split('/')[-1]} {venue}"[:24]


def compact(strategy: str) -> str:
    """'tp=8,pp=8,dp=24,...' -> 'tp8 pp8 dp24 mbs2 vpp2 full sp' (defaults dropped)."""
    d = dict(item.split("=") for item in strategy.split(","))
    parts = [f"{k}{d[k]}" for k in ("tp", "pp", "cp", "dp", "ep", "etp", "mbs", "vpp", "zero", "shard")
             if d.get(k, "1") not in ("1", "0") or k in ("tp", "pp", "dp")]
    parts.append(d["recompute"])
    if d.get("sp") == "1":
        parts.append("sp")
    return " ".join(parts)


def main() -> None:
    console = Console(width=200)
    table = Table(title="plait predictions vs published training runs", box=box.SIMPLE_HEAD)
    for col in ("set", "source", "model", "GPUs", "layout", "figure", "published", "plait", "error"):
        table.add_column(col, justify="right" if col in ("GPUs", "published", "plait", "error") else "left",
                         no_wrap=True)
    errors: dict[str, list[float]] = {"reference": [], "megatron": [], "deepspeed": [], "fsdp": [],
                                      "fsdp fitted": [], "fsdp held-out": [], "fsdp A100": [], "fsdp H100": [],
                                      "moe": [], "moe fitted": [], "moe held-out": [], "moe published layout": [],
                                      "offload": [], "offload fitted": [], "offload held-out": []}
    rows = []
    skipped_all: list[str] = []
    for name, path in FILES.items():
        if not path.exists():
            console.print(f"[yellow]{path} not found; skipped[/]")
            continue
        runs, skipped = load_runs(path)
        for run in runs:
            report = run.report()
            for key, (pub, ours, err) in relative_errors(run, report).items():
                group = "reference" if name == "reference" else run.group
                errors[group].append(err)
                if group == "fsdp":
                    errors["fsdp held-out" if run.held_out else "fsdp fitted"].append(err)
                    errors[f"fsdp {run.cluster.gpu.name[:4]}"].append(err)
                if group in ("moe", "offload"):
                    errors[f"{group} held-out" if run.held_out else f"{group} fitted"].append(err)
                    if group == "moe" and run.fully_published:
                        errors["moe published layout"].append(err)
                rows.append({"set": name, "group": group, "held_out": run.held_out, "source": run.source,
                             "gpus": run.cluster.world_size, "figure": key, "published": pub, "predicted": ours,
                             "error": err, "strategy": run.strategy})
                colour = "green" if abs(err) <= 0.10 else "red"
                label = f"{group}{' (held out)' if run.held_out else ''}" if name == "collected" else name
                table.add_row(label, short_source(run.source), run.model.name if run.group == "moe" else f"{run.model.params / 1e9:.0f}B",
                              f"{run.cluster.world_size} {run.cluster.gpu.name[:4]}", compact(run.strategy),
                              FIGURES[key], f"{pub:.4g}", f"{ours:.4g}", f"[{colour}]{err:+.1%}[/]")
        skipped_all.extend(f"{name}: {source[:90]}: {reason}" for source, reason in skipped)
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
        return
    console.print(table)
    for line in skipped_all:
        console.print(f"skipped {line}", highlight=False)
    summary = Table(title="summary (|relative error|)")
    for col in ("runs", "figures", "median", "max", "within 10%"):
        summary.add_column(col, justify="right")
    labels = {"reference": "reference runs (shared/data/published)", "megatron": "collected, Megatron-LM software",
              "deepspeed": "collected, DeepSpeed pipeline engine (MT-NLG)",
              "fsdp": "collected, FSDP / ZeRO-2/3 (all)", "fsdp fitted": "  FSDP, rows constants were chosen on",
              "fsdp held-out": "  FSDP, held-out rows", "fsdp A100": "  FSDP on A100", "fsdp H100": "  FSDP on H100",
              "moe": "collected, mixture-of-experts (all)", "moe fitted": "  MoE, rows constants were chosen on",
              "moe held-out": "  MoE, held-out rows", "moe published layout": "  MoE, layout fully published",
              "offload": "collected, offload and long context (all)",
              "offload fitted": "  offload, rows constants were chosen on", "offload held-out": "  offload, held-out rows"}
    for group, errs in errors.items():
        if errs:
            a = [abs(e) for e in errs]
            summary.add_row(labels[group], str(len(a)), f"{statistics.median(a):.1%}", f"{max(a):.1%}",
                            f"{sum(x <= 0.10 for x in a)}/{len(a)}")
    console.print(summary)


if __name__ == "__main__":
    main()
