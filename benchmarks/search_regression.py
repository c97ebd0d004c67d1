"""Search regression: today's search against the plans recorded in tests/data/search_baseline.json.

    python benchmarks/search_regression.py [--max-gpus N]

For every recorded case of benchmarks/search_quality.py (up to 1,024 GPUs) it runs the search and prints the
recorded and the new predicted iteration time, their relative difference, whether the plan is the same one,
and the search time then and now.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from plait.plan import Plan
from plait.planner.engine import search
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS

BASELINE = Path(__file__).resolve().parent.parent / "tests" / "data" / "search_baseline.json"


def main() -> None:
    max_gpus = int(sys.argv[sys.argv.index("--max-gpus") + 1]) if "--max-gpus" in sys.argv else 1 << 30
    table = Table(title="search regression (predicted seconds per iteration)", box=box.SIMPLE_HEAD)
    for col in ("model", "GPUs", "seq", "GiB", "recorded s", "now s", "change", "same plan", "search then",
                "search now"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for row in json.loads(BASELINE.read_text()):
        name, nodes, per_node, gpu, seq, gbs, mem = row["case"]
        if nodes * per_node > max_gpus:
            continue
        cluster = dgx(nodes, per_node, gpu)
        if mem is not None:
            cluster = cluster.with_memory(mem)
        t0 = time.perf_counter()
        result = search(PRESETS[name], cluster, seq, gbs)
        elapsed = time.perf_counter() - t0
        now = result.report.iteration_time_s if result.report else float("inf")
        same = result.plan is not None and result.plan == Plan.model_validate(row["plan"])  # recorded as a version-1 plan
        table.add_row(name, str(nodes * per_node), str(seq), str(mem or "full"), f"{row['iteration_time_s']:.4f}",
                      f"{now:.4f}", f"{now / row['iteration_time_s'] - 1:+.4%}", "yes" if same else "no",
                      f"{row['search_s']:.1f} s", f"{elapsed:.1f} s")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
