"""Variable-length training measured on this machine: 4 gloo ranks, per-step layouts vs static ones.

    python benchmarks/varlen_live.py                # ~5 minutes
    python benchmarks/varlen_live.py --profile P    # plan with a `plait profile` of this machine

The same job (same seed, same documents: lengths drawn from 10k real Wikipedia lengths, cut at the model's
positions) trained with `plait train --varlen` under each layout method: FlexSP (Ulysses groups sized per
micro-batch), ByteScale-style balance (ring context parallelism over ad-hoc rank sets), static sequence
parallelism of the smallest degree that holds the longest possible document (for the whole run), static
SP over all 4 ranks, and a static
DP x CP (ring) mesh. Printed: median measured seconds per step (step 0, which also makes the process groups,
left out), the ratio to the smallest static SP, the planner's solver seconds per step and how long training
waited for it (planning runs one step ahead in a background thread), and the largest loss difference from
the FlexSP run (all methods train the same batch to the same loss).
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

MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=688,vocab=512,seq=4096"
METHODS = {"flexsp": ["flexsp"], "bytescale": ["bytescale"], "static (smallest SP)": ["static"],
           "static SP=4": ["static", "--sp", "4"], "static DP x CP ring": ["static", "--cp-mode", "ring"]}
console = Console(width=160)


def train(tmp: Path, name: str, args: argparse.Namespace, method: list[str]) -> list[dict]:
    extra = ["--profile", str(args.profile)] if args.profile else []
    return plait_train(name, tmp / f"{name.replace(' ', '_')}.jsonl", "--model", args.model, "--nproc", "4",
                       "--steps", str(args.steps), "--global-batch", str(args.gbs), "--capacity", str(args.capacity),
                       "--seed", str(args.seed), "--varlen", *method, *extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--gbs", type=int, default=16, help="documents per step")
    ap.add_argument("--capacity", type=int, default=2048, help="tokens a rank holds at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "varlen_live.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    runs = {}
    for name, method in METHODS.items():
        console.print(f"training with {name} ...")
        runs[name] = train(tmp, name, args, method)
    base = statistics.median(r["step_time_s"] for r in runs["static (smallest SP)"][1:])
    reference = runs["flexsp"]
    table = Table(title=f"4 gloo ranks, {args.gbs} documents per step (Wikipedia lengths, cut at 4096), "
                        f"{args.capacity} tokens per rank, steps 1-{args.steps - 1}")
    for col in ("method", "s / step", "vs smallest static SP", "tokens / s", "solver s / step", "waited for plan s",
                "max loss diff", "layouts (size x groups per micro-batch), step 1"):
        table.add_column(col, justify="left" if col in ("method",) or col.startswith("layouts") else "right")
    rows = {}
    for name, recs in runs.items():
        step = statistics.median(r["step_time_s"] for r in recs[1:])
        diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(recs, reference))
        rows[name] = {"step_s": step, "ratio": step / base, "tokens_per_s": statistics.median(
            r["tokens_per_s"] for r in recs[1:]), "solve_s": statistics.mean(r["solve_s"] for r in recs),
            "plan_wait_s": statistics.mean(r["plan_wait_s"] for r in recs[1:]), "loss_diff": diff,
            "layout": recs[1]["layout"]}
        r = rows[name]
        table.add_row(name, f"{step:.3f}", f"{r['ratio']:.2f}x", f"{r['tokens_per_s']:,.0f}", f"{r['solve_s']:.2f}",
                      f"{r['plan_wait_s']:.3f}", f"{diff:.1e}", r["layout"])
    console.print(table)
    ratio = {k: r["step_s"] for k, r in rows.items()}
    console.print(f"measured: FlexSP {ratio['flexsp'] / ratio['static (smallest SP)']:.2f}x the smallest static SP, "
                  f"{ratio['flexsp'] / ratio['static SP=4']:.2f}x static SP=4; ByteScale-style balance "
                  f"{ratio['bytescale'] / ratio['static DP x CP ring']:.2f}x the static DP x CP ring mesh; "
                  f"losses equal the FlexSP run's within {max(r['loss_diff'] for r in rows.values()):.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    tmp_out.replace(args.out)


if __name__ == "__main__":
    main()
