"""The search with the memory below the device (`plait plan --host-memory`) as host memory per node grows, with
and without NVMe: predicted seconds a step, the host memory the plan uses, where its layers' states live, and the
search's own time. More host memory should never give a slower plan.

    python benchmarks/host_memory_sweep.py
"""

from __future__ import annotations

import time
from dataclasses import replace

from nvme_search import offloads
from rich.console import Console
from rich.table import Table

from plait.planner.engine import DEFAULT_LIMITS, search
from plait.planner.space import HIERARCHY
from plait.spec.cluster import load_cluster
from plait.spec.model import PRESETS

GIB = 2**30
CASES = (("llama2-13b", "1x1xA100-80GB", 2048, 8, (100, 130, 160, 200, 260)),
         ("llama2-70b", "1x8xA100-80GB", 2048, 64, (512, 768, 1024)))
"""(model, cluster, sequence, global batch, host memory per node in GiB to try)."""


def main() -> None:
    limits = replace(DEFAULT_LIMITS, **HIERARCHY)
    table = Table(title="plait plan --host-memory as host memory grows: predicted s/step")
    for col in ("model", "cluster", "host GiB/node", "NVMe", "s/step", "host used GiB", "layers offloaded",
                "search s"):
        table.add_column(col, justify="left" if col in ("model", "cluster", "NVMe", "layers offloaded")
                         else "right")
    for name, cluster_name, seq, gbs, hosts in CASES:
        model, cluster = PRESETS[name], load_cluster(cluster_name)
        side = cluster.host_side
        for host in hosts:
            for nvme in (False, True):
                sized = replace(cluster, host=replace(side, memory_bytes=host * GIB,
                                                      nvme_bytes=side.nvme_bytes if nvme else 0.0))
                start = time.perf_counter()
                result = search(model, sized, seq, gbs, limits=limits)
                seconds = time.perf_counter() - start
                if result.plan is None or result.report is None:
                    table.add_row(name, cluster_name, str(host), "yes" if nvme else "no", "nothing fits", "-",
                                  "-", f"{seconds:.1f}")
                    continue
                table.add_row(name, cluster_name, str(host), "yes" if nvme else "no",
                              f"{result.report.iteration_time_s:.2f}", f"{result.report.host_memory_gib:.1f}",
                              offloads(result), f"{seconds:.1f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
