"""The search with the memory below the device (`plait plan --host-memory`) on models whose states outgrow the
nodes' host memory: without NVMe, with NVMe as the layer search leaves it (a stage's offloaded layers all on
NVMe where the host cannot hold every layer), and with as many of them moved to the host as the plan fits with
(`plait.planner.host_fill`). Predicted seconds a step side by side, and the search's own time.

    python benchmarks/nvme_search.py
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

from rich.console import Console
from rich.table import Table

from plait.planner import engine
from plait.planner.engine import DEFAULT_LIMITS, SearchResult, search
from plait.planner.space import HIERARCHY
from plait.spec.cluster import load_cluster
from plait.spec.model import PRESETS

CASES = (("llama2-13b", "1x1xA100-80GB", 2048, 8), ("llama2-70b", "1x8xA100-80GB", 2048, 64),
         ("gpt3-175b", "1x8xA100-80GB", 2048, 64))
"""(model, cluster, sequence, global batch): one A100 with an eighth of a DGX A100's host memory and NVMe, and
a whole DGX A100 (1 TB of host memory, 15.4 TB of NVMe)."""


def offloads(result: SearchResult) -> str:
    """Layers by where their states live: 'host N, nvme M' (the device keeps the rest)."""
    if result.plan is None:
        return "-"
    kinds = [st.strategy(i).offload for st in result.plan.pipelines[0].stages for i in range(*st.layers)]
    return ", ".join(f"{k} {kinds.count(k)}" for k in ("optim", "params", "nvme") if k in kinds) or "none"


def step(result: SearchResult) -> str:
    """Predicted seconds a step of the result, or that nothing fits."""
    return f"{result.report.iteration_time_s:.1f} s" if result.report is not None else "nothing fits"


def main() -> None:
    limits = replace(DEFAULT_LIMITS, **HIERARCHY)
    table = Table(title="plait plan --host-memory: predicted s/step")
    for col in ("model", "cluster", "host only", "NVMe, as searched", "NVMe, host filled", "layers offloaded",
                "filled / searched", "search s"):
        table.add_column(col, justify="left" if col in ("model", "cluster", "layers offloaded") else "right")
    for name, cluster_name, seq, gbs in CASES:
        model, cluster = PRESETS[name], load_cluster(cluster_name)
        host_only = search(model, replace(cluster, host=replace(cluster.host_side, nvme_bytes=0.0)), seq, gbs,
                           limits=limits)
        with mock.patch.object(engine, "fill_host", lambda cand, judge: cand):
            unfilled = search(model, cluster, seq, gbs, limits=limits)
        filled = search(model, cluster, seq, gbs, limits=limits)
        ratio = filled.report.iteration_time_s / unfilled.report.iteration_time_s \
            if filled.report and unfilled.report else float("nan")
        table.add_row(name, cluster_name, step(host_only), step(unfilled), step(filled), offloads(filled),
                      f"{ratio:.2f}", f"{filled.search_time_s:.1f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
