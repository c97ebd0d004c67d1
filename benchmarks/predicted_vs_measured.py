"""Predicted vs measured step time and peak memory of real training runs on this machine (gloo ranks).

    python benchmarks/predicted_vs_measured.py                     # profile, then 39 runs (~35 minutes)
    python benchmarks/predicted_vs_measured.py --profile p.json    # reuse a profile of the same model
    python benchmarks/predicted_vs_measured.py --moe               # a mixture-of-experts model
    python benchmarks/predicted_vs_measured.py --report benchmarks/data/predicted_vs_measured.json  # print again

It profiles the model (`plait profile`, or `--profile`), predicts every plan's step time and peak memory with
that profile (`plait simulate --profile`), asks the search for the fastest plan on 4 ranks, and runs every
plan (the searched one too) with `plait train`, each in a job of its own, three times: all plans in one order,
then in the reverse order, then in the first again (this shared machine's speed drifts by 10-40% over minutes,
so one slow run must not decide a plan). A run's time is its median step time after the first `--skip` steps;
a plan's measured time is the median of its runs, and, beside it, the best of its runs (the machine's
neighbours only ever slow a run down). Its memory is rank 0's peak resident size and its terms in the first
run. Printed: predicted and measured side by side (for an MoE model also the expert load the runs realized,
`plait train`'s `expert_load`, where the plans price balanced routing), the memory terms, and for both
aggregates Spearman's rank correlation, the median absolute time error and the searched plan against the
fastest measured one. Targets: Spearman >= 0.9, median |error| <= 15% (time) and <= 10% (memory), searched plan
within 10% of the measured fastest.
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
from plait.cost.profile_file import load_profile
from plait.plan import Pipeline, Plan, Stage, Strategy, uniform_plan, write_atomically
from plait.planner.engine import search
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
MOE_MODEL = ("llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=688,vocab=512,experts=8,top_k=2,"
             "expert_ffn=256,dense_first=1")
"""One dense layer, then three of 8 SwiGLU experts (top 2), profiled per expert-parallel width."""
MOE_CASES: list[tuple[int, str]] = [
    (2, "dp=2"), (2, "dp=2,ep=2"), (2, "tp=2,sp=1"), (2, "pp=2,mbs=1"), (2, "dp=2,ep=2,recompute=full"),
    (4, "dp=4,ep=4"), (4, "dp=4,ep=2"), (4, "dp=2,tp=2,sp=1"), (4, "pp=2,dp=2,ep=2,mbs=1"),
]
SETS = {"dense": (MODEL, CASES), "moe": (MOE_MODEL, MOE_CASES)}
"""The model and plans of each comparison."""
SEARCH_RANKS = 4
ROUNDS = 3
"""Runs of every plan, each in a job of its own; a plan's time is the median (and the best) of them."""
console = Console(width=160)


def mixed_plan(model: str) -> Plan:
    """Layers 0-1 data parallel, layers 2-3 tensor parallel with sequence parallelism, on 2 ranks."""
    s = (Strategy(dp=2), Strategy(dp=2), Strategy(tp=2, sp=True), Strategy(tp=2, sp=True))
    return Plan(model=model, seq_len=SEQ, global_batch=GBS, precision="fp32",
                pipelines=(Pipeline(stages=(Stage(layers=(0, 4), ranks=(0, 1), strategies=s),), micro_batches=1,
                                    micro_batch_sequences=GBS),))


def measure(plan: Plan, model: str, steps: int, skip: int, tmp: Path
            ) -> tuple[float, float, dict[str, float], float | None]:
    """(median seconds per step after `skip` steps, rank 0's peak resident bytes, rank 0's memory terms at
    the first step, the median realized expert load over those steps, None without experts) of a real run
    of `model` in a job of its own."""
    path, metrics = tmp / "plan.json", tmp / "metrics.jsonl"
    plan.save(path)
    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", model, "--plan", str(path), "--steps",
           str(steps), "--metrics-out", str(metrics)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"training failed: {proc.stderr[-1500:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    loads = [r["expert_load"]["mean"] for r in records[skip:] if "expert_load" in r]
    return (statistics.median(r["step_time_s"] for r in records[skip:]), max(r["peak_memory_bytes"] for r in records),
            records[0]["memory_terms"][0], statistics.median(loads) if loads else None)


def searched_plan(profile, spec) -> Plan:
    """The fastest plan on SEARCH_RANKS ranks that the search finds with the profile."""
    cluster, cal = calibrate(profile, profiled_cluster(profile, f"1x{SEARCH_RANKS}x{profile.device.gpu_type}"))
    plan = search(spec, cluster, SEQ, GBS, precision="fp32", cal=cal).plan
    if plan is None:
        raise SystemExit("the search found no plan")
    return plan


PREDICTED_TERMS = {"weights": "weights", "grads": "gradients", "optim": "optimizer", "activ": "activations",
                   "buf": "buffers", "reserve": "reserve"}
"""`plait train`'s memory terms and the simulator's names for them."""


def memory_table(rows: list[dict]) -> Table:
    """Rank 0's memory terms, predicted / measured (MiB), per plan: which estimate was off."""
    table = Table(title="rank 0's peak memory by term, predicted / measured (MiB)")
    table.add_column("ranks", justify="right")
    table.add_column("plan")
    for term in PREDICTED_TERMS:
        table.add_column(term, justify="right")
    for r in rows:
        cells = [f"{r['predicted_terms'][name] / 2**20:.1f} / {r['measured_terms'][term] / 2**20:.1f}"
                 for term, name in PREDICTED_TERMS.items()]
        table.add_row(str(r["ranks"]), r["plan"], *cells)
    return table


def describe(plan: Plan) -> str:
    """pp, micro-batches and each stage's distinct layer strategies, short."""
    pipe = plan.pipelines[0]
    stages = " | ".join(", ".join(dict.fromkeys(s.short() for s, _ in st.layer_strategies())) for st in pipe.stages)
    pp = len(pipe.stages) // plan.chunks
    chunks = f" x {plan.chunks} chunks" if plan.chunks > 1 else ""
    return f"pp={pp}{chunks} m={pipe.micro_batches}x{pipe.micro_batch_sequences} {plan.schedule}: {stages}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, help="a profile of MODEL on this machine (default: measure one)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--moe", action="store_true", help=f"compare plans of {MOE_MODEL} instead of {MODEL}")
    ap.add_argument("--out", type=Path, help="where to save the comparison (default: "
                                             "data/predicted_vs_measured[_moe].json beside this script)")
    ap.add_argument("--report", type=Path, help="print a saved comparison (the --out of an earlier run) again")
    args = ap.parse_args()
    if args.report is not None:
        if not args.report.is_file():
            print(f"error: --report {args.report} does not exist; give the --out file of an earlier run",
                  file=sys.stderr)
            raise SystemExit(2)
        report(json.loads(args.report.read_text()))
        return
    model, plans = SETS["moe" if args.moe else "dense"]
    name = f"predicted_vs_measured{'_moe' if args.moe else ''}.json"
    out = args.out or Path(__file__).parent / "data" / name
    tmp = Path(tempfile.mkdtemp())
    profile_path = args.profile
    if profile_path is None:
        profile_path = tmp / "profile.json"
        subprocess.run([sys.executable, "-m", "plait.cli", "profile", "--model", model, "--nproc", "4",
                        "--out", str(profile_path)], check=True)
    profile = load_profile(profile_path)
    spec = load_model(model)
    search_plan = searched_plan(profile, spec)
    search_label = f"searched: {describe(search_plan)}"
    cases = [*plans, (SEARCH_RANKS, search_label)]
    rows = []
    for ranks, text in cases:
        cluster, cal = calibrate(profile, profiled_cluster(profile, f"1x{ranks}x{profile.device.gpu_type}"))
        if text == search_label:
            plan = search_plan
        elif text == "mixed":
            plan = mixed_plan(spec.name)
        else:
            plan = uniform_plan(f"{text},gbs={GBS},precision=fp32", spec, cluster, SEQ)
        predicted = simulate(plan, spec, cluster, cal=cal)
        rank0 = next(d for d in predicted.devices if 0 in d.ranks)
        rows.append({"ranks": ranks, "plan": text, "plan_json": plan, "predicted_s": predicted.iteration_time_s,
                     "predicted_bytes": rank0.memory.total, "predicted_terms": rank0.memory.as_dict(), "runs": []})
    for round_ in range(ROUNDS):  # every plan once per round, in alternating order: drift hits all alike
        for row in rows if round_ % 2 == 0 else rows[::-1]:
            time_s, memory, terms, load = measure(row["plan_json"], model, args.steps, args.skip, tmp)
            row["runs"].append(time_s)
            if load is not None:
                row.setdefault("expert_load", []).append(load)
            if round_ == 0:
                row["measured_bytes"], row["measured_terms"] = memory, terms
            console.print(f"round {round_ + 1}: {row['ranks']} ranks {row['plan']:40s} predicted "
                          f"{row['predicted_s']:.3f} s, measured {time_s:.3f} s; memory "
                          f"{row['predicted_bytes'] / 2**20:.0f} vs {memory / 2**20:.0f} MiB")
    for row in rows:
        del row["plan_json"]
    search_row = rows.pop()
    data = {"model": model, "seq_len": SEQ, "global_batch": GBS, "profile": profile_path.name, "rows": rows,
            "searched": {"plan": search_row["plan"], "predicted_s": search_row["predicted_s"],
                         "runs": search_row["runs"]}}
    data["summary"] = report(data)
    write_atomically(out, json.dumps(data, indent=1) + "\n")


AGGREGATES = {"median": statistics.median, "best": min}
"""How a plan's runs make its measured time: the median run, and the best run (this shared machine's
neighbours only ever slow a run down, so the fastest of the runs is the least disturbed one)."""


def report(data: dict) -> dict:
    """Print the saved comparison `data` (tables and summaries, over the median and over the best run of
    each plan); return the summaries."""
    rows, searched = data["rows"], data["searched"]
    table = Table(title=f"{data['model']}, seq {data['seq_len']}, global batch {data['global_batch']}: predicted "
                        f"vs measured (profile {data.get('profile', '?')})")
    loads = any("expert_load" in r for r in rows)  # the realized load, beside the load of 1 the plans price
    for col in ("ranks", "plan", "pred s/step", "runs s/step", "median", "err", "best", "err", "pred MiB",
                "meas MiB", "mem err", *(["load"] if loads else [])):
        table.add_column(col, justify="left" if col in ("plan", "runs s/step") else "right")
    for r in rows:
        med, best = statistics.median(r["runs"]), min(r["runs"])
        load = [f"{statistics.median(r['expert_load']):.2f}" if "expert_load" in r else "-"] if loads else []
        table.add_row(str(r["ranks"]), r["plan"], f"{r['predicted_s']:.3f}", " ".join(f"{x:.3f}" for x in r["runs"]),
                      f"{med:.3f}", f"{r['predicted_s'] / med - 1:+.1%}", f"{best:.3f}",
                      f"{r['predicted_s'] / best - 1:+.1%}", f"{r['predicted_bytes'] / 2**20:.0f}",
                      f"{r['measured_bytes'] / 2**20:.0f}", f"{r['predicted_bytes'] / r['measured_bytes'] - 1:+.1%}",
                      *load)
    console.print(table)
    console.print(memory_table(rows))
    mem_err = statistics.median(abs(r["predicted_bytes"] / r["measured_bytes"] - 1) for r in rows)
    console.print(f"memory: median |error| {mem_err:.1%} (target <= 10%)")
    summary: dict = {"median_abs_memory_error": mem_err}
    four = [r for r in rows if r["ranks"] == SEARCH_RANKS]
    console.print(f"searched plan on {SEARCH_RANKS} ranks: {searched['plan']}, predicted {searched['predicted_s']:.3f} "
                  f"s/step, runs {' '.join(f'{x:.3f}' for x in searched['runs'])}")
    for name, agg in AGGREGATES.items():
        measured = [agg(r["runs"]) for r in rows]
        rho = spearmanr([r["predicted_s"] for r in rows], measured).statistic
        time_err = statistics.median(abs(r["predicted_s"] / m - 1) for r, m in zip(rows, measured, strict=True))
        chosen = agg(searched["runs"])
        other = min(four, key=lambda r: agg(r["runs"]))
        fastest, fastest_s = ("the searched plan", chosen) if chosen <= agg(other["runs"]) else (
            other["plan"], agg(other["runs"]))
        summary[name] = {"spearman_time": rho, "median_abs_time_error": time_err, "searched_s": chosen,
                         "fastest": fastest, "fastest_s": fastest_s, "searched_vs_fastest": chosen / fastest_s}
        console.print(f"{name} run of each plan: Spearman (time) {rho:.3f} (target >= 0.9); median |error| time "
                      f"{time_err:.1%} (<= 15%); searched plan {chosen:.3f} s/step, {chosen / fastest_s:.2f}x the "
                      f"fastest measured on {SEARCH_RANKS} ranks ({fastest}, {fastest_s:.3f}) (<= 1.10)")
    return summary

if __name__ == "__main__":
    main()
