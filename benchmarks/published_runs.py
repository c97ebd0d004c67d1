"""Predicted vs published: every published training run we have, simulated with plait's default model.

    python benchmarks/published_runs.py [--json] [--breakdown TEXT]

Reads the six reference runs in ../shared/data/published/training-runs.json (when present) and the
larger collection in benchmarks/data/published_runs.json, simulates each layout, and prints the published
figure, plait's prediction and the relative error, then summary statistics by software family
(Megatron-LM, DeepSpeed, FSDP, MoE, offload and long context; FSDP, MoE and offload also split into the rows
constants were chosen on and the held-out rows; MoE's held-out rows of the Mixtral and Qwen3 families on 64-256
H100 also apart). `--breakdown TEXT` prints instead, for every row whose source
or model contains TEXT (e.g. "MPT-30b", "seq 8192", "A100 40GB"), plait's step time by cause and the memory
of its fullest device by term, beside the step time the published figure implies.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from plait.published import PublishedRun, load_runs, relative_errors
from plait.simulate import BREAKDOWN_KEYS, Report
from plait.spec.cluster import GIB

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
    """'tp=8,pp=8,dp=24,...' -> 'tp8 pp8 dp24 mbs2 vpp2 full sp' (defaults dropped; Megatron's expert-parallel
    overlap as 'ep-overlap', its recompute modules after the recompute mode: 'none+mla_up_proj+mlp')."""
    d = dict(item.split("=") for item in strategy.split(","))
    parts = [f"{k}{d[k]}" for k in ("tp", "pp", "cp", "dp", "ep", "etp", "mbs", "vpp", "zero", "shard")
             if d.get(k, "1") not in ("1", "0") or k in ("tp", "pp", "dp")]
    parts.append(d["recompute"] + (f"+{d['recompute_modules']}" if d.get("recompute_modules") else ""))
    if d.get("sp") == "1":
        parts.append("sp")
    if d.get("ep_overlap") in ("True", "1"):
        parts.append("ep-overlap")
    return " ".join(parts)


def named_held_out(run: PublishedRun) -> bool:
    """Whether a row is of the held-out set the MoE bar names: Mixtral and Qwen3 families on 64-256 H100."""
    return run.cluster.gpu.name.startswith("H100") and 64 <= run.cluster.world_size <= 256 and \
        run.model.name.startswith(("mixtral", "qwen3"))


def published_step_s(run: PublishedRun, report: Report) -> float:
    """Seconds per step that the row's first published figure implies: its iteration time, or plait's scaled by
    predicted / published for a throughput (tokens/s, FLOP/s, MFU and HFU all grow as the step shrinks)."""
    key, value = next(iter(run.reported.items()))
    return value if key == "iteration_time_s" else report.iteration_time_s * float(getattr(report, key)) / value


def breakdown_rows(text: str) -> list[dict]:
    """Every collected or reference row whose source or model contains `text` (case-insensitive): its error,
    the published and predicted step (s), plait's step by cause (`time_s`, s) and its fullest device's memory
    by term (`memory_gib`, GiB; `states` = weights + gradients + optimizer, `headroom` = capacity - peak, and
    `headroom_layers` the headroom in units of one layer's ZeRO-3 buffers, half of `buffers`)."""
    out = []
    for path in FILES.values():
        if not path.exists():
            continue
        for run in load_runs(path)[0]:
            label = f"{run.source} {run.model.name}"
            if text.lower() not in label.lower():
                continue
            report = run.report()
            _, (pub, ours, err) = next(iter(relative_errors(run, report).items()))
            fullest = max(report.devices, key=lambda d: d.memory.total)
            memory = {k: v / GIB for k, v in fullest.memory.as_dict().items()}
            memory["states"] = memory["weights"] + memory["gradients"] + memory["optimizer"]
            memory["headroom"] = report.memory_capacity_gib - report.peak_memory_gib
            # ZeRO-3 buffers hold two layers' gathered parameters and gradients (the current and the prefetched)
            memory["headroom_layers"] = 2 * memory["headroom"] / memory["buffers"] if memory["buffers"] else 0.0
            out.append({"row": run.source, "strategy": run.strategy, "gpus": run.cluster.world_size,
                        "gpu": run.cluster.gpu.name, "held_out": run.held_out, "error": err,
                        "micro_batches": run.plan.pipelines[0].micro_batches,
                        "published_step_s": published_step_s(run, report), "step_s": report.iteration_time_s,
                        "time_s": dict(report.breakdown), "memory_gib": memory | {"peak": report.peak_memory_gib}})
    return out


MEMORY_KEYS = ("states", "activations", "buffers", "reserve", "peak", "headroom", "headroom_layers")


def print_breakdown(console: Console, text: str) -> None:
    """The table of `breakdown_rows(text)`: seconds per step by every cause that is not zero in all of them,
    then GiB of the fullest device."""
    rows = breakdown_rows(text)
    if not rows:
        console.print(f"no published row's source or model contains {text!r}")
        raise SystemExit(2)
    causes = [k for k in BREAKDOWN_KEYS if any(r["time_s"].get(k) for r in rows)]
    table = Table(title=f"step time (s) by cause and memory (GiB) of the rows matching {text!r}",
                  box=box.SIMPLE_HEAD)
    for col in ("row", "GPUs", "layout", "mb/step", "error", "published", "plait", *causes, *MEMORY_KEYS):
        table.add_column(col, justify="left" if col in ("row", "layout") else "right", no_wrap=True)
    for r in rows:
        row = r["row"]
        where = row.split(", row ")[-1].split(" (")[0] if ", row " in row else short_source(row)
        table.add_row(f"{where}{' (held out)' if r['held_out'] else ''}", f"{r['gpus']} {r['gpu']}",
                      compact(r["strategy"]), str(r["micro_batches"]), f"{r['error']:+.1%}",
                      f"{r['published_step_s']:.4g}", f"{r['step_s']:.4g}",
                      *(f"{r['time_s'][k]:.3g}" for k in causes), *(f"{r['memory_gib'][k]:.{2 if k == 'headroom_layers' else 1}f}" for k in MEMORY_KEYS))
    console.print(table)


def main() -> None:
    console = Console(width=200)
    if "--breakdown" in sys.argv:
        at = sys.argv.index("--breakdown")
        if at + 1 >= len(sys.argv):
            console.print("--breakdown needs the text to look for, e.g. --breakdown MPT-30b")
            raise SystemExit(2)
        print_breakdown(Console(width=260), sys.argv[at + 1])
        return
    table = Table(title="plait predictions vs published training runs", box=box.SIMPLE_HEAD)
    for col in ("set", "source", "model", "GPUs", "layout", "figure", "published", "plait", "error"):
        table.add_column(col, justify="right" if col in ("GPUs", "published", "plait", "error") else "left",
                         no_wrap=True)
    errors: dict[str, list[float]] = {"reference": [], "megatron": [], "deepspeed": [], "fsdp": [],
                                      "fsdp fitted": [], "fsdp held-out": [], "fsdp A100": [], "fsdp H100": [],
                                      "moe": [], "moe fitted": [], "moe held-out": [], "moe held-out named": [],
                                      "moe published layout": [],
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
                    if group == "moe" and run.held_out and named_held_out(run):
                        errors["moe held-out named"].append(err)
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
              "moe held-out": "  MoE, held-out rows",
              "moe held-out named": "  MoE held out: Mixtral, Qwen3 on 64-256 H100",
              "moe published layout": "  MoE, layout fully published",
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
