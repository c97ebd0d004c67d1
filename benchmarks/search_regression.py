"""Search regression: today's search against the plans recorded in tests/data/search_baseline.json.

    python benchmarks/search_regression.py [--max-gpus N] [--record]

For every recorded case of benchmarks/search_quality.py (up to 1,024 GPUs) it runs the search and prints the
recorded and the new predicted iteration time, their relative difference, whether the plan is the same one,
and the search time then and now. `--record` writes today's plans, times and search times back to the
baseline (all cases; do it only when the cost model changed on purpose, and say which plans changed and why).
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
    record = "--record" in sys.argv
    if record and "--max-gpus" in sys.argv:
        sys.exit("--record re-records every case; drop --max-gpus")
    recorded = []
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
        if record and result.plan is not None:
            recorded.append({"case": row["case"], "search_s": elapsed, "iteration_time_s": now,
                             "plan": json.loads(result.plan.model_dump_json())})
        elif record:  # nothing found now: keep the old row, so that the test reports it
            recorded.append(row)
            print(f"{row['case']}: no plan found; the recorded row is kept")
        table.add_row(name, str(nodes * per_node), str(seq), str(mem or "full"), f"{row['iteration_time_s']:.4f}",
                      f"{now:.4f}", f"{now / row['iteration_time_s'] - 1:+.4%}", "yes" if same else "no",
                      f"{row['search_s']:.1f} s", f"{elapsed:.1f} s")
    Console(width=200).print(table)
    if record:
        BASELINE.write_text(json.dumps(recorded, indent=1) + "\n")
        print(f"recorded {len(recorded)} cases in {BASELINE}")


if __name__ == "__main__":
    main()
