"""Speed of one simulator evaluation: a uniform plan of Llama-3 405B (126 layers) on 16,384 H100s.

    python benchmarks/simulator_speed.py

Prints the time of one evaluation with every cache cleared (what a planner pays for a new shape), with
warm caches (a planner revisiting shapes), and the rate over a sweep of distinct plans.
"""

from __future__ import annotations

import statistics
import time

from rich.console import Console
from rich.table import Table

from plait.cost import comm, compute, layer, pipeline
from plait.plan import uniform_plan
from plait.simulate import simulate
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS

STRATEGIES = (
    "tp=8,pp=16,dp=128,mbs=1,gbs=2048,sp=1,zero=1",
    "tp=8,pp=16,dp=128,mbs=1,gbs=2048,sp=1,zero=1,vpp=2",
    "tp=8,pp=8,dp=256,mbs=1,gbs=4096,sp=1,zero=1,recompute=full",
)


def clear_caches() -> None:
    for cache in (compute.gemm_time, layer.block_time, comm.bus_bandwidth, comm._shape, comm.nodes_of):
        cache.cache_clear()
    pipeline.clear_plan_cache()


def main() -> None:
    model = PRESETS["llama3-405b"]
    cluster = dgx(2048, 8, "H100-80GB")
    table = Table(title=f"one simulate() of {model.name} on {cluster.world_size} GPUs (ms; median of 7)")
    for col in ("strategy", "cold", "warm", "predicted s/iter"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for strategy in STRATEGIES:
        plan = uniform_plan(strategy, model, cluster, 8192)
        cold, warm = [], []
        for _ in range(7):
            clear_caches()
            t0 = time.perf_counter()
            report = simulate(plan, model, cluster)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            simulate(plan, model, cluster)
            warm.append(time.perf_counter() - t0)
        table.add_row(strategy, f"{statistics.median(cold) * 1e3:.2f}", f"{statistics.median(warm) * 1e3:.2f}",
                      f"{report.iteration_time_s:.2f}")
    console = Console(width=140)
    console.print(table)
    # A planner-like sweep: distinct uniform plans over tp, pp, mbs, recompute, zero.
    plans = []
    for tp in (4, 8):
        for pp in (8, 16, 32):
            for mbs in (1, 2):
                for recompute in ("none", "selective", "full"):
                    for zero in (0, 1, 3):
                        dp = cluster.world_size // (tp * pp)
                        plans.append(uniform_plan(f"tp={tp},pp={pp},dp={dp},mbs={mbs},gbs={dp * mbs * 2 * pp},"
                                                  f"sp=1,recompute={recompute},zero={zero}", model, cluster, 8192))
    clear_caches()
    t0 = time.perf_counter()
    for plan in plans:
        simulate(plan, model, cluster)
    elapsed = time.perf_counter() - t0
    console.print(f"sweep: {len(plans)} distinct plans in {elapsed:.2f} s = {elapsed / len(plans) * 1e3:.2f} ms each "
                  f"({len(plans) / elapsed:.0f} plans/s)")


if __name__ == "__main__":
    main()
