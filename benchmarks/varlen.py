"""Variable-length global batches: FlexSP and ByteScale-style balance vs static sequence parallelism, planned.

    python benchmarks/varlen.py           # 8 batches of 1024 Wikipedia lengths, Llama-2-7B, 64 A100s, 32K tokens/GPU

Every method plans the same global batches, sampled with fixed seeds from the real length distribution
(`../shared/data/seqlens/wikipedia.txt`, 1M documents: median 347 tokens, p99 10,919, max 1.8M). Static
sequence parallelism (Ulysses) uses the smallest degree that holds the longest sequence of each batch, or
every device (SP=64); the static data x context parallel mesh uses ring attention at that smallest degree.
Targets (issue: variable-length sequences): FlexSP <= 0.8x the minimum feasible static SP and <= 0.6x SP=64;
the balance scheduler <= 0.8x the static DP x CP mesh; solver time per global batch <= 5 s on this machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

from plait.planner.varlen import SequenceCost, load_lengths, plan_batch, sample_batches
from plait.spec.cluster import load_cluster
from plait.spec.model import load_model

console = Console(width=140)
DEFAULT_LENGTHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "seqlens" / "wikipedia.txt"
METHODS = [  # (name, method, cp mode, static degree)
    ("flexsp", "flexsp", "ulysses", None),
    ("static SP (smallest)", "static", "ulysses", None),
    ("static SP=all", "static", "ulysses", "all"),
    ("bytescale balance", "bytescale", "ring", None),
    ("static DP x CP (ring)", "static", "ring", None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--cluster", default="8x8xA100-80GB")
    ap.add_argument("--lengths", type=Path, default=DEFAULT_LENGTHS)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--capacity", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "varlen.json")
    args = ap.parse_args()
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    devices = cluster.world_size
    batches = sample_batches(load_lengths(args.lengths), args.batches, args.global_batch, args.seed)
    costs = {mode: SequenceCost(model, cluster, cp_mode=mode) for mode in ("ulysses", "ring")}
    results: dict[str, list[dict]] = {}
    for name, method, mode, degree in METHODS:
        rows = []
        for batch in track(batches, description=name, console=console, transient=True):
            p = plan_batch(batch, devices, costs[mode], args.capacity, method, devices if degree == "all" else None)
            rows.append({"time_s": p.seconds, "solve_time_s": p.solve_time_s, "micro_batches": len(p.micro_batches)})
        results[name] = rows
    table = Table(title=f"{model.name} on {cluster.name}, {args.batches} global batches of {args.global_batch} "
                        f"sequences, {args.capacity} tokens per device: planned seconds per batch")
    table.add_column("batch")
    for name, *_ in METHODS:
        table.add_column(name, justify="right")
    for i, batch in enumerate(batches):
        table.add_row(f"{i} (longest {max(batch):,})", *(f"{results[n][i]['time_s']:.3f}" for n, *_ in METHODS))
    totals = {n: sum(r["time_s"] for r in results[n]) for n, *_ in METHODS}
    solve = {n: max(r["solve_time_s"] for r in results[n]) for n, *_ in METHODS}
    table.add_row("total", *(f"{totals[n]:.3f}" for n, *_ in METHODS))
    table.add_row("longest solve", *(f"{solve[n]:.2f} s" for n, *_ in METHODS))
    console.print(table)
    summary = {"flexsp_vs_static_smallest": totals["flexsp"] / totals["static SP (smallest)"],
               "flexsp_vs_static_all": totals["flexsp"] / totals["static SP=all"],
               "bytescale_vs_static_dp_cp": totals["bytescale balance"] / totals["static DP x CP (ring)"],
               "max_solve_s": max(solve["flexsp"], solve["bytescale balance"])}
    console.print(f"FlexSP {summary['flexsp_vs_static_smallest']:.2f}x the smallest static SP (target <= 0.8), "
                  f"{summary['flexsp_vs_static_all']:.2f}x SP={devices} (<= 0.6); balance scheduler "
                  f"{summary['bytescale_vs_static_dp_cp']:.2f}x the static DP x CP mesh (<= 0.8); longest solve "
                  f"{summary['max_solve_s']:.2f} s per batch (<= 5)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": model.name, "cluster": cluster.name, "global_batch": args.global_batch,
                                    "capacity": args.capacity, "seed": args.seed, "totals": totals,
                                    "summary": summary, "per_batch": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
