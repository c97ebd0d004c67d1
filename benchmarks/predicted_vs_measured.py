"""Predicted vs measured step time and peak memory of real training runs on this machine (gloo ranks).

    python benchmarks/predicted_vs_measured.py                     # profile, then 2 x 8 runs (~10 minutes)
    python benchmarks/predicted_vs_measured.py --profile p.json    # reuse a profile of the same model

It profiles the model (`plait profile`, or `--profile`), predicts every plan's step time and peak memory
with that profile (`plait simulate --profile`), trains each plan with `plait train` for a few steps and
takes the median step time after the first `--skip` steps and rank 0's peak resident memory, then prints
them side by side with the rank correlation (Spearman) and the median absolute errors. Last, it asks the
search for the fastest plan on 4 ranks, runs it, and compares it with the fastest plan measured.
Targets (issue: profiler and calibration): Spearman >= 0.9, median |error| <= 15% (time) and <= 10% (memory),
searched plan within 10% of the measured fastest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from scipy.stats import spearmanr

from plait.cost.measured import calibrate, profiled_cluster
from plait.plan import Pipeline, Plan, Stage, Strategy, uniform_plan
from plait.profile.schema import load_profile
from plait.simulate import simulate
from plait.spec.model import load_model

MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=688,vocab=512"
SEQ = 128
GBS = 8
CASES: list[tuple[int, str]] = [  # (ranks, strategy); "mixed" is a per-layer plan built below
    (2, "dp=2"), (2, "dp=2,zero=3"), (2, "tp=2"), (2, "tp=2,sp=1"), (2, "pp=2,mbs=1"),
    (2, "pp=2,mbs=1,schedule=gpipe"), (2, "dp=2,recompute=full"), (2, "mixed"),
    (4, "dp=4"), (4, "dp=2,tp=2"), (4, "pp=2,dp=2,mbs=1"), (4, "dp=4,zero=3,recompute=full"),
]
console = Console(width=160)


def mixed_plan(model: str) -> Plan:
    """Layers 0-1 data parallel, layers 2-3 tensor parallel with sequence parallelism, on 2 ranks."""
    s = (Strategy(dp=2), Strategy(dp=2), Strategy(tp=2, sp=True), Strategy(tp=2, sp=True))
    return Plan(model=model, seq_len=SEQ, global_batch=GBS, precision="fp32",
                pipelines=(Pipeline(stages=(Stage(layers=(0, 4), ranks=(0, 1), strategies=s),), micro_batches=1,
                                    micro_batch_size=GBS),))


def measure(plan: Plan, steps: int, skip: int, tmp: Path) -> tuple[float, float]:
    """(median seconds per step after `skip` steps, rank 0's peak resident bytes) of a real run."""
    path, metrics = tmp / "plan.json", tmp / "metrics.jsonl"
    plan.save(path)
    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", MODEL, "--plan", str(path), "--steps", str(steps),
           "--metrics-out", str(metrics)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"training failed: {proc.stderr[-1500:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[skip:]), max(r["peak_memory_bytes"] for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, help="a profile of MODEL on this machine (default: measure one)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "predicted_vs_measured.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    profile_path = args.profile
    if profile_path is None:
        profile_path = tmp / "profile.json"
        subprocess.run([sys.executable, "-m", "plait.cli", "profile", "--model", MODEL, "--nproc", "4", "--out",
                        str(profile_path)], check=True)
    profile = load_profile(profile_path)
    spec = load_model(MODEL)
    rows = []
    for ranks, text in CASES:
        cluster, cal = calibrate(profile, profiled_cluster(profile, f"1x{ranks}x{profile.device.gpu_type}"))
        plan = mixed_plan(spec.name) if text == "mixed" else uniform_plan(f"{text},gbs={GBS},precision=fp32", spec,
                                                                          cluster, SEQ)
        report = simulate(plan, spec, cluster, cal=cal)
        rank0 = next(d for d in report.devices if 0 in d.ranks)
        time_s, memory = measure(plan, args.steps, args.skip, tmp)
        rows.append({"ranks": ranks, "plan": text, "predicted_s": report.iteration_time_s, "measured_s": time_s,
                     "predicted_bytes": rank0.memory.total, "measured_bytes": memory})
        console.print(f"{ranks} ranks {text:32s} predicted {report.iteration_time_s:.3f} s measured {time_s:.3f} s; "
                      f"memory {rank0.memory.total / 2**20:.0f} vs {memory / 2**20:.0f} MiB")
    table = Table(title=f"{MODEL}, seq {SEQ}, global batch {GBS}: predicted vs measured (profile {profile_path.name})")
    for col in ("ranks", "plan", "pred s/step", "meas s/step", "time err", "pred MiB", "meas MiB", "mem err"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for r in rows:
        table.add_row(str(r["ranks"]), r["plan"], f"{r['predicted_s']:.3f}", f"{r['measured_s']:.3f}",
                      f"{r['predicted_s'] / r['measured_s'] - 1:+.1%}", f"{r['predicted_bytes'] / 2**20:.0f}",
                      f"{r['measured_bytes'] / 2**20:.0f}", f"{r['predicted_bytes'] / r['measured_bytes'] - 1:+.1%}")
    console.print(table)
    rho = spearmanr([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]).statistic
    time_err = statistics.median(abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows)
    mem_err = statistics.median(abs(r["predicted_bytes"] / r["measured_bytes"] - 1) for r in rows)
    summary = {"spearman_time": rho, "median_abs_time_error": time_err, "median_abs_memory_error": mem_err}
    console.print(f"Spearman (time) {rho:.3f} (target >= 0.9); median |error| time {time_err:.1%} (<= 15%), "
                  f"memory {mem_err:.1%} (<= 10%)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": MODEL, "seq_len": SEQ, "global_batch": GBS, "rows": rows,
                                    "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
