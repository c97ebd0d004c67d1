"""plait: find, predict and run the fastest hybrid-parallel layout for training a transformer.

    >>> import plait
    >>> plan, report = plait.search("llama2-7b", "1x8xA100-80GB", seq_len=2048, global_batch=64)
"""

from __future__ import annotations

from plait.errors import PlaitError
from plait.plan import Plan, load_plan
from plait.simulate import Report, simulate
from plait.spec.cluster import Cluster, load_cluster
from plait.spec.model import ModelSpec, load_model

__all__ = [
    "Cluster",
    "ModelSpec",
    "PlaitError",
    "Plan",
    "Report",
    "load_cluster",
    "load_model",
    "load_plan",
    "search",
    "simulate",
]


def search(model: ModelSpec | str, cluster: Cluster | str, *, seq_len: int, global_batch: int,
           memory_gib: float | None = None, precision: str = "bf16") -> tuple[Plan, Report]:
    """The fastest plan that fits and its predicted report; PlaitError if nothing fits.

    `model` is a ModelSpec or anything `plait.load_model` reads (preset, config.json, inline spec);
    `cluster` a Cluster or `NODESxGPUSxTYPE` / a YAML path; `memory_gib` overrides device memory.
    """
    from plait.planner.engine import search as run_search

    m = load_model(model) if isinstance(model, str) else model
    c = load_cluster(cluster) if isinstance(cluster, str) else cluster
    if memory_gib is not None:
        c = c.with_memory(memory_gib)
    result = run_search(m, c, seq_len, global_batch, precision=precision)
    if result.plan is None or result.report is None:
        need = f"; the closest plan needs {result.closest.report.peak_memory_gib:.1f} GiB" if result.closest else ""
        raise PlaitError(f"no plan for {m.name} fits {c.name}{need}")
    return result.plan, result.report  # type: ignore[return-value]
