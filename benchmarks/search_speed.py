"""Search speed against cluster size: how long `plait plan` takes, and what it finds.

    python benchmarks/search_speed.py [--max-gpus N] [--repeat R]

Llama-2-7B (seq 2048, global batch 64) on one 8xA100-80GB node, then Llama-3-405B (seq 8192, global batch
2048) on 8xH100-80GB nodes from 8 to 16,384 GPUs. Each search runs in a fresh process (cold caches, as one
`plait plan` does); the run with the least wall time of `--repeat` is shown, with the CPU seconds it used
(its own and its child's: with a second core the uniform grid runs beside the layer-wise search; on a busy
machine the wall time also counts waiting for a core). "predicted" is the found plan's predicted
seconds per iteration. Targets (wall): Llama-2-7B on 8 GPUs <= 1 s, Llama-3-405B on 16,384 GPUs <= 10 s.
Gemma-2-9B (local and global attention layers alternating: two layer kinds) is searched beside the same
model with every layer of one kind; the two-kind search may cost at most 2x the one-kind one (CPU seconds).
MoE models (expert layouts searched per layer): Mixtral-8x7B on 64 H100 <= 5 s, Qwen3-235B-A22B on 256 H100
<= 20 s; both again with Megatron-LM's recompute modules searched per layer (`plait plan --recompute-modules`).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context

from rich import box
from rich.console import Console
from rich.table import Table

from plait.planner.engine import DEFAULT_LIMITS, search
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS, ModelSpec


@dataclass(frozen=True)
class Case:
    """One search: a model preset on `nodes` x `gpus_per_node` GPUs of one type."""

    model: str
    nodes: int
    gpus_per_node: int
    gpu: str
    seq_len: int
    global_batch: int
    target_s: float | None = None  # search time to stay under, seconds
    one_kind: bool = False  # the model's layers all made its default block (same depth, one kind)
    modules: bool = False  # the search may choose recompute modules (SpaceLimits.recompute_modules)

    @property
    def label(self) -> str:
        return self.model + (" (one kind)" if self.one_kind else "") + (" +modules" if self.modules else "")

    def spec(self) -> ModelSpec:
        model = PRESETS[self.model]
        return replace(model, name=f"{model.name}-one-kind", mixed=()) if self.one_kind else model

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


LLAMA3_405B_NODES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
"""8xH100 nodes of the Llama-3-405B rows: 8 to 16,384 GPUs."""
CASES = (Case("llama2-7b", 1, 8, "A100-80GB", 2048, 64, target_s=1.0),
         Case("gemma2-9b", 1, 8, "A100-80GB", 4096, 64),  # two kinds: local and global attention
         Case("gemma2-9b", 1, 8, "A100-80GB", 4096, 64, one_kind=True),
         Case("mixtral-8x7b", 8, 8, "H100-80GB", 4096, 1024, target_s=5.0),  # MoE: ep and etp per layer
         Case("qwen3-235b-a22b", 32, 8, "H100-80GB", 4096, 1024, target_s=20.0),
         Case("mixtral-8x7b", 8, 8, "H100-80GB", 4096, 1024, modules=True),
         Case("qwen3-235b-a22b", 32, 8, "H100-80GB", 4096, 1024, modules=True),
         *(Case("llama3-405b", n, 8, "H100-80GB", 8192, 2048, target_s=10.0 if n == 2048 else None)
           for n in LLAMA3_405B_NODES))


@dataclass(frozen=True)
class Outcome:
    """What one search took and found."""

    seconds: float  # wall time
    cpu_seconds: float  # CPU time of the searching process
    evaluated: int
    predicted_s: float | None  # seconds per iteration of the found plan; None when nothing fits
    plan: str


def run(case: Case) -> Outcome:
    """Search `case` and describe the plan found."""
    cluster = dgx(case.nodes, case.gpus_per_node, case.gpu)
    t0, c0 = time.perf_counter(), _cpu_seconds()
    limits = replace(DEFAULT_LIMITS, recompute_modules=case.modules)
    result = search(case.spec(), cluster, case.seq_len, case.global_batch, limits=limits)
    seconds, cpu_seconds = time.perf_counter() - t0, _cpu_seconds() - c0
    plan = result.plan
    if plan is None:
        return Outcome(seconds, cpu_seconds, result.evaluated, None, "none fits")
    layouts = sorted({s.short() for st in plan.pipelines[0].stages for s in st.strategies})
    desc = f"pp{plan.pp} m{plan.pipelines[0].micro_batches} {plan.schedule} " + " | ".join(layouts)
    return Outcome(seconds, cpu_seconds, result.evaluated, result.report.iteration_time_s,  # type: ignore[union-attr]
                   desc)


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (the search runs the uniform grid in a
    child beside its layer-wise search where a second core is free)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_fresh(case: Case) -> Outcome:
    """`run` in a new process, so no cache of an earlier search helps."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(run, case).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gpus", type=int, default=16384, help="skip larger clusters")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; the fastest is shown")
    args = ap.parse_args()
    console = Console(width=200)
    table = Table(title=f"search time vs cluster size (best of {args.repeat}; predicted = seconds per iteration "
                        "of the plan found)", box=box.SIMPLE_HEAD)
    for col in ("model", "GPUs", "seq", "batch", "search s", "CPU s", "target", "plans", "predicted s", "plan"):
        table.add_column(col, justify="left" if col in ("model", "plan") else "right", no_wrap=True)
    found: dict[Case, Outcome] = {}
    for case in CASES:
        if case.gpus > args.max_gpus:
            continue
        outcomes = [run_fresh(case) for _ in range(args.repeat)]
        best = found[case] = min(outcomes, key=lambda o: o.seconds)
        target = "" if case.target_s is None else f"<= {case.target_s:g}" + (
            " ok" if best.seconds <= case.target_s else " MISSED")
        predicted = "-" if best.predicted_s is None else f"{best.predicted_s:.3f}"
        table.add_row(case.label, f"{case.gpus:,}", str(case.seq_len), str(case.global_batch), f"{best.seconds:.2f}",
                      f"{best.cpu_seconds:.2f}", target, str(best.evaluated), predicted, best.plan[:70])
    console.print(table)
    kinds = [o for c, o in found.items() if c.model == "gemma2-9b"]
    if len(kinds) == 2:
        ratio = kinds[0].cpu_seconds / kinds[1].cpu_seconds
        console.print(f"two layer kinds / one kind (gemma2-9b, CPU seconds): {ratio:.2f}x "
                      f"(target <= 2x: {'ok' if ratio <= 2 else 'MISSED'})")


if __name__ == "__main__":
    main()
