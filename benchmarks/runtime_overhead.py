"""Overhead of plait's training runtime over a plain hand-written PyTorch loop, on this machine (gloo, 2 ranks).

    python benchmarks/runtime_overhead.py                 # ~3-4 minutes on 2 CPU cores
    python benchmarks/runtime_overhead.py --mode launch   # one `plait train` / torchrun launch per run

Cases: DDP (composable `replicate`), FSDP2 ZeRO-3 (`fully_shard` per block + root) and TP
(`parallelize_module`, Megatron plan, output Replicate). The baseline, `benchmarks/handwritten_train.py`, uses
the same PyTorch APIs, the same model (`plait.models.build_model`), data, micro-batching, AdamW, warm-up/cosine
learning rate and gradient clipping, written as one would by hand (see its docstring).

Mode `interleaved` (default): ONE `torchrun --standalone` job of 2 ranks. For every round and case it runs
plait's training loop (`plait.runtime.train.run`, what `plait train` runs on each rank) and the hand-written
loop (`handwritten_train.Trainer`) alternating STEP BY STEP (hand k, plait k in even rounds; plait k, hand k in
odd ones): the hand-written step runs in the `before_step` hook of plait's loop, before plait starts its
timer. Both sides then see the same background load, which on a shared 2-core machine swings step times by
2x between runs. Mode `launch`: `plait train --strategy`
and a torchrun launch of `handwritten_train.py` per run, alternating (end to end, including plait's worker
and progress bar; noisier).

Both loops time a step the same way on rank 0: from the start of the step to after the all-reduce of its
loss. The first `--skip` steps of every run are dropped. Columns: pooled median step time of each side, their
ratio, the median of the per-step ratio (each plait step over the hand-written step next to it), and the
ratio of the 25th percentiles (less sensitive to other processes stealing the CPUs: the load average is
printed); the last-step losses of both sides must agree (same work). Target: ratio <= 1.05.
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

MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=688,vocab=512"
SEQ = 256
GBS = 8
# name -> (plait --strategy, hand-written --strategy, --mbs). mbs = sequences per data-parallel rank per
# micro-batch: plait's default 1 gives 4 micro-batches per rank under dp=2; TP uses 2 (4 micro-batches).
CASES = {
    "DDP": ("dp=2,gbs=8", "ddp", 1),
    "FSDP2 ZeRO-3": ("dp=2,zero=3,gbs=8", "fsdp", 1),
    "TP": ("tp=2,mbs=2,gbs=8", "tp", 2),
}
HERE = Path(__file__).resolve().parent
SIDES = ("plait", "hand")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _hand_args(case: str, steps: int, sync_every: bool) -> list[str]:
    _, strategy, mbs = CASES[case]
    return (["--strategy", strategy, "--model", MODEL, "--seq", str(SEQ), "--gbs", str(GBS), "--mbs", str(mbs),
             "--steps", str(steps)] + (["--sync-every-microbatch"] if sync_every else []))


def _order(rnd: int) -> tuple[str, str]:
    return SIDES if rnd % 2 == 0 else SIDES[::-1]


def _progress(rnd: int, case: str, side: str, records: list[dict], skip: int, seconds: float) -> None:
    kept = [r["step_time_s"] for r in records[skip:]]
    print(f"round {rnd} {case:13s} {side:5s}: median {statistics.median(kept):.3f} s/step, "
          f"last loss {records[-1]['loss']:.6f} ({seconds:.0f} s)", flush=True)


# ---- mode interleaved: the torchrun worker ----------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import handwritten_train as hw
    import torch.distributed as dist

    import plait.runtime.train as plait_train
    from plait.plan import uniform_plan
    from plait.spec.cluster import local_ranks
    from plait.spec.model import load_model

    plait_train.init_distributed()  # plait's: gloo with a finite timeout, torch.set_num_threads(1)
    rank = dist.get_rank()
    spec = load_model(MODEL)
    # plait's loop calls `before_step(step)` on every rank before it starts timing a step: running one
    # hand-written step there makes the two loops alternate step by step.
    results = []
    for rnd in range(args.rounds):
        for case in args.cases.split(","):
            dist.barrier()
            t0 = time.perf_counter()
            hand = hw.Trainer(hw.parser().parse_args(_hand_args(case, args.steps, args.sync_every_microbatch)))
            hand_records: list[dict] = []
            plan = uniform_plan(CASES[case][0], spec, local_ranks(2), SEQ)
            cfg = plait_train.TrainConfig(model=MODEL, plan=json.loads(plan.model_dump_json()), steps=args.steps)
            lag = rnd % 2  # even rounds: hand k, plait k; odd rounds: plait k, hand k

            def interleave(step: int, hand=hand, out=hand_records, lag=lag) -> None:
                if step - lag >= 0:
                    out.append(hand.step(step - lag))

            plait_records = plait_train.run(cfg, before_step=interleave)  # rank 0 gets the records
            hand_records += [hand.step(k) for k in range(len(hand_records), args.steps)]
            del hand
            if rank == 0:
                seconds = time.perf_counter() - t0
                for side, records in (("plait", plait_records), ("hand", hand_records)):
                    _progress(rnd, case, side, records, args.skip, seconds)
                    results.append({"round": rnd, "case": case, "side": side, "records": records})
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_interleaved(args: argparse.Namespace, tmp: str) -> list[dict]:
    out = Path(tmp) / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker-out", str(out), "--steps", str(args.steps), "--skip", str(args.skip), "--rounds",
           str(args.rounds), "--cases", args.cases] + (["--sync-every-microbatch"] if args.sync_every_microbatch else [])
    with open(Path(tmp) / "stderr.txt", "w+") as err:
        code = subprocess.run(cmd, env=_env(), stderr=err, check=False).returncode
        if code != 0 or not out.exists():
            err.seek(0)
            sys.stderr.write(err.read()[-8000:])
            raise SystemExit(f"the benchmark job failed ({code})")
    return json.loads(out.read_text())


# ---- mode launch: one process group per run ----------------------------------------------------------------

def _launch(cmd: list[str], metrics: Path) -> list[dict]:
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not metrics.exists():
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line]


def run_launch(args: argparse.Namespace, tmp: str) -> list[dict]:
    results = []
    for rnd in range(args.rounds):
        for case in args.cases.split(","):
            for side in _order(rnd):
                metrics = Path(tmp) / f"{case.replace(' ', '_')}-{side}-{rnd}.jsonl"
                t0 = time.perf_counter()
                if side == "plait":
                    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", MODEL, "--strategy", CASES[case][0],
                           "--nproc", "2", "--steps", str(args.steps), "--seq-len", str(SEQ),
                           "--metrics-out", str(metrics)]
                else:  # --standalone: torchrun picks a free port
                    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(HERE / "handwritten_train.py"), "--metrics-out", str(metrics)]
                           + _hand_args(case, args.steps, args.sync_every_microbatch))
                records = _launch(cmd, metrics)
                _progress(rnd, case, side, records, args.skip, time.perf_counter() - t0)
                results.append({"round": rnd, "case": case, "side": side, "records": records})
    return results


# ---- report -----------------------------------------------------------------------------------------------

def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(results: list[dict], args: argparse.Namespace, seconds: float, load: tuple[float, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    cases = args.cases.split(",")
    hand = "hand-written" + (" (syncing every micro-batch)" if args.sync_every_microbatch else "")
    table = Table(title=f"plait runtime vs {hand} ({args.mode}): {MODEL}, seq {SEQ}, gbs {GBS}, gloo, 2 ranks; "
                        f"{args.rounds} runs per side, steps {args.skip}..{args.steps - 1} of each")
    for col in ("strategy", "plait s/step", "hand s/step", "ratio", "paired ratio", "p25 ratio", "plait last loss",
                "hand last loss"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    summary = {}
    for case in cases:
        pooled = {s: [] for s in SIDES}
        per_step: dict[tuple[int, int], dict[str, float]] = {}
        last = {}
        for r in results:
            if r["case"] != case:
                continue
            for x in r["records"][args.skip:]:
                pooled[r["side"]].append(x["step_time_s"])
                per_step.setdefault((r["round"], x["step"]), {})[r["side"]] = x["step_time_s"]
            last[r["side"]] = r["records"][-1]["loss"]
        p, h = statistics.median(pooled["plait"]), statistics.median(pooled["hand"])
        paired = statistics.median(v["plait"] / v["hand"] for v in per_step.values())
        p25 = _quantile(pooled["plait"], 0.25) / _quantile(pooled["hand"], 0.25)
        summary[case] = {"plait_s": p, "hand_s": h, "ratio": p / h, "paired_ratio": paired, "p25_ratio": p25,
                         "plait_loss": last["plait"], "hand_loss": last["hand"]}
        table.add_row(f"{case} ({CASES[case][0]})", f"{p:.3f}", f"{h:.3f}", f"{p / h:.3f}", f"{paired:.3f}",
                      f"{p25:.3f}", f"{last['plait']:.6f}", f"{last['hand']:.6f}")
    console = Console(width=160)
    console.print(table)
    console.print(f"total {seconds:.0f} s; load average (1 min) {load[0]:.1f} before, {load[1]:.1f} after, on "
                  f"{os.cpu_count()} CPUs; target ratio <= 1.05")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("interleaved", "launch"), default="interleaved")
    ap.add_argument("--steps", type=int, default=10, help="steps per run")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each run")
    ap.add_argument("--rounds", type=int, default=None, help="runs per side and case (default 3 interleaved, 2 launch)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of: {', '.join(CASES)}")
    ap.add_argument("--sync-every-microbatch", action="store_true",
                    help="the hand-written loop all-reduces gradients after every micro-batch, as plait does")
    ap.add_argument("--json-out", help="also write the summary and every step record here")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)  # set on the torchrun ranks of mode interleaved
    args = ap.parse_args()
    if args.worker_out:
        worker(args)
        return
    args.rounds = args.rounds or (3 if args.mode == "interleaved" else 2)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown or args.steps <= args.skip:
        raise SystemExit(f"unknown case(s) {unknown} (choose from {list(CASES)}) or --steps <= --skip")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = (run_interleaved if args.mode == "interleaved" else run_launch)(args, tmp)
    report(results, args, time.perf_counter() - t0, (load0, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
