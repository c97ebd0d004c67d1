"""Search quality and speed: plait's per-layer search vs the best uniform Megatron grid layout.

    python benchmarks/search_quality.py [--quick]

For each case (model, cluster, sequence length, global batch, device memory) it runs the search and the
megatron-grid baseline and prints both predicted iteration times and their ratio (grid time / search
time: above 1 means the search found a faster plan), plus the search time. Memory budgets range from
tight to loose; a case is "tight" when the budget is below what the best unconstrained grid plan needs.
"""

from __future__ import annotations

import sys
import time

from rich import box
from rich.console import Console
from rich.table import Table

from plait.planner.baselines import run_baseline
from plait.planner.engine import search
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS

# (model, nodes, gpus per node, gpu, seq_len, global batch, memory GiB or None for the device's own)
CASES = [
    ("llama2-7b", 1, 8, "A100-80GB", 2048, 64, None),
    ("llama2-7b", 1, 8, "A100-80GB", 2048, 64, 40),
    ("llama2-7b", 1, 8, "A100-80GB", 4096, 64, 24),
    ("llama2-7b", 1, 8, "A100-40GB", 8192, 32, None),
    ("gpt3-1.3b", 1, 8, "A100-40GB", 2048, 256, 16),
    ("gpt3-2.7b", 2, 8, "A100-40GB", 2048, 256, 20),
    ("gpt3-6.7b", 2, 8, "A100-80GB", 2048, 256, None),
    ("gpt3-13b", 4, 8, "A100-80GB", 2048, 512, 40),
    ("llama2-13b", 2, 8, "A100-80GB", 4096, 128, 48),
    ("llama3-8b", 1, 8, "H100-80GB", 8192, 64, None),
    ("llama3-8b", 1, 8, "H100-80GB", 32768, 16, None),
    ("llama3-8b", 2, 8, "H100-80GB", 16384, 64, 40),
    ("llama2-70b", 8, 8, "A100-80GB", 4096, 256, None),
    ("llama2-70b", 8, 8, "A100-80GB", 4096, 256, 48),
    ("llama3-70b", 8, 8, "H100-80GB", 8192, 128, None),
    ("llama3-70b", 8, 8, "H100-80GB", 8192, 128, 60),
    ("llama3-70b", 16, 8, "H100-80GB", 32768, 64, None),
    ("llama3-70b", 4, 8, "H200-141GB", 8192, 128, None),
    ("gpt3-175b", 16, 8, "A100-80GB", 2048, 1536, None),
    ("gpt3-175b", 64, 8, "A100-80GB", 2048, 1536, 64),
    ("llama3-405b", 128, 8, "H100-80GB", 8192, 1024, None),
    ("llama3-405b", 2048, 8, "H100-80GB", 8192, 2048, None),
]


def main() -> None:
    quick = "--quick" in sys.argv
    cases = [c for c in CASES if not quick or c[1] * c[2] <= 64]
    console = Console(width=220)
    table = Table(title="per-layer search vs best uniform Megatron grid (predicted seconds per iteration)",
                  box=box.SIMPLE_HEAD)
    for col in ("model", "GPUs", "seq", "batch", "GiB", "tight", "grid s", "search s", "ratio", "search time",
                "search plan"):
        table.add_column(col, justify="left" if col in ("model", "search plan") else "right", no_wrap=True)
    better_tight = tight_cases = never_below = 0
    for name, nodes, per_node, gpu, seq, gbs, mem in cases:
        model = PRESETS[name]
        cluster = dgx(nodes, per_node, gpu)
        free_grid, _ = run_baseline("megatron-grid", model, cluster, seq, gbs)
        if mem is not None:
            cluster = cluster.with_memory(mem)
        t0 = time.perf_counter()
        result = search(model, cluster, seq, gbs)
        elapsed = time.perf_counter() - t0
        grid = result.best_uniform
        tight = free_grid is not None and free_grid.report.peak_memory_gib > cluster.gpu.memory_bytes / 2**30
        grid_s = grid.report.iteration_time_s if grid and grid.report.fits else float("inf")
        search_s = result.report.iteration_time_s if result.report else float("inf")
        ratio = grid_s / search_s if search_s < float("inf") else float("nan")
        never_below += search_s <= grid_s
        if tight:
            tight_cases += 1
            better_tight += ratio > 1.0 + 1e-9
        plan = result.plan
        layouts = sorted({s.short() for st in plan.pipelines[0].stages for s in st.strategies}) if plan else []
        desc = f"pp{plan.pp} m{plan.pipelines[0].micro_batches} " + " | ".join(layouts) if plan else "none fits"
        table.add_row(name, f"{cluster.world_size}x{gpu[:4]}", str(seq), str(gbs),
                      f"{cluster.gpu.memory_bytes / 2**30:.0f}", "yes" if tight else "", f"{grid_s:.3f}",
                      f"{search_s:.3f}", f"{ratio:.3f}", f"{elapsed:.2f} s", desc[:80])
    console.print(table)
    console.print(f"search never slower than the grid: {never_below}/{len(cases)}; strictly faster on "
                  f"{better_tight}/{tight_cases} memory-tight cases")


if __name__ == "__main__":
    main()
