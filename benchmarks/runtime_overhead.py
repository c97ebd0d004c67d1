"""Overhead of plait's training runtime over a plain hand-written PyTorch loop, on this machine (gloo, 2 ranks).

    python benchmarks/runtime_overhead.py            # ~4-5 minutes on 2 CPU cores

For DDP (composable `replicate`), FSDP2 ZeRO-3 (`fully_shard` per block + root) and TP (`parallelize_module`,
Megatron plan) it launches `plait train --strategy ...` and `benchmarks/handwritten_train.py` (the same
PyTorch APIs, same model from `plait.models.build_model`, same data, AdamW, warm-up/cosine learning rate and
gradient clipping), each under its own `torchrun --standalone` (a free port per job). Every pair runs twice
in alternating order (plait then hand-written, then hand-written then plait) to cancel drift; the first
`--skip` steps of each run are dropped and the median step time of the rest (both runs pooled) is compared.
The last-step losses of both must agree (same work); the ratio plait / hand-written should be <= 1.05.

Both loops time a step the same way on rank 0: from the start of the step to after the all-reduce of the
step's loss. The hand-written loop skips the gradient sync on micro-batches before the last, as one would
by hand; `--sync-every-microbatch` makes it sync every micro-batch, as plait does, for attribution.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=688,vocab=512"
SEQ = 256
# name -> (plait --strategy, hand-written --strategy, hand-written --mbs); mbs = sequences per dp rank per
# micro-batch (plait's default 1 gives 4 micro-batches per rank under dp=2; TP uses 2 for a ~1 s step).
CASES = {
    "DDP": ("dp=2,gbs=8", "ddp", 1),
    "FSDP2 ZeRO-3": ("dp=2,zero=3,gbs=8", "fsdp", 1),
    "TP": ("tp=2,mbs=2,gbs=8", "tp", 2),
}
HERE = Path(__file__).resolve().parent


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(cmd: list[str], metrics: Path) -> list[dict]:
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not metrics.exists():
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line]


def run_plait(strategy: str, steps: int, metrics: Path) -> list[dict]:
    return _run([sys.executable, "-m", "plait.cli", "train", "--model", MODEL, "--strategy", strategy,
                 "--nproc", "2", "--steps", str(steps), "--seq-len", str(SEQ), "--metrics-out", str(metrics)],
                metrics)


def run_handwritten(strategy: str, mbs: int, steps: int, metrics: Path, sync_every: bool) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "handwritten_train.py"), "--strategy", strategy, "--model", MODEL, "--seq", str(SEQ),
           "--gbs", "8", "--mbs", str(mbs), "--steps", str(steps), "--metrics-out", str(metrics)]
    return _run(cmd + (["--sync-every-microbatch"] if sync_every else []), metrics)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per run")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each run")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side (order alternates per round)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"subset of: {', '.join(CASES)}")
    ap.add_argument("--sync-every-microbatch", action="store_true",
                    help="hand-written loop all-reduces gradients after every micro-batch, as plait does")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",")]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")

    times: dict[tuple[str, str], list[float]] = {}
    per_run: dict[tuple[str, str], list[float]] = {}
    last: dict[tuple[str, str], dict] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for case in cases:
                plait_strategy, hw_strategy, mbs = CASES[case]
                order = ("plait", "hand") if rnd % 2 == 0 else ("hand", "plait")
                for side in order:
                    metrics = Path(tmp) / f"{case.replace(' ', '_')}-{side}-{rnd}.jsonl"
                    t0 = time.perf_counter()
                    if side == "plait":
                        records = run_plait(plait_strategy, args.steps, metrics)
                    else:
                        records = run_handwritten(hw_strategy, mbs, args.steps, metrics, args.sync_every_microbatch)
                    kept = [r["step_time_s"] for r in records if r["step"] >= args.skip]
                    times.setdefault((case, side), []).extend(kept)
                    per_run.setdefault((case, side), []).append(statistics.median(kept))
                    last[(case, side)] = records[-1]
                    print(f"round {rnd} {case:13s} {side:5s}: median {statistics.median(kept):.3f} s/step, "
                          f"last loss {records[-1]['loss']:.6f} (launch+run {time.perf_counter() - t0:.0f} s)",
                          flush=True)

    hand_label = "hand-written" + (" (sync every micro-batch)" if args.sync_every_microbatch else "")
    table = Table(title=f"plait runtime vs {hand_label}: {MODEL}, seq {SEQ}, gbs 8, gloo, 2 ranks; "
                        f"median step time over steps {args.skip}..{args.steps - 1} of {args.rounds} runs each")
    for col in ("strategy", "plait s/step", "hand s/step", "ratio", "per-run medians (plait | hand)",
                "plait last loss", "hand last loss"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for case in cases:
        p, h = statistics.median(times[(case, "plait")]), statistics.median(times[(case, "hand")])
        runs = (" ".join(f"{x:.3f}" for x in per_run[(case, "plait")]) + " | "
                + " ".join(f"{x:.3f}" for x in per_run[(case, "hand")]))
        table.add_row(f"{case} ({CASES[case][0]})", f"{p:.3f}", f"{h:.3f}", f"{p / h:.3f}", runs,
                      f"{last[(case, 'plait')]['loss']:.6f}", f"{last[(case, 'hand')]['loss']:.6f}")
    console = Console(width=170)
    console.print(table)
    console.print(f"total {time.perf_counter() - t_start:.0f} s; target ratio <= 1.05")


if __name__ == "__main__":
    main()
