"""Moving layers paged from NVMe to host memory, as far as the nodes' host memory holds them.

The layer search shares each device's part of its node's host memory among its stage's layers by pricing host
bytes (`planner.host_budget`), which reaches only the answers on the lower convex hull of (host bytes, seconds):
a stage may leave host memory free that some of its NVMe layers could use. `offload=params` keeps the device's
memory the same as `offload=nvme` (both page the shard in), is never slower (the host link, not the device's
share of the NVMe, and no file reads and writes beside the CPU's step) and only adds host bytes: so, stage by
stage, the most of its NVMe layers that the assembled plan still fits with (its host memory per node as the
simulator counts it) move to the host, found by bisection, each try priced as the search prices any plan.
"""

from __future__ import annotations

from plait.plan import Plan, stage_strategies
from plait.planner.baselines import Candidate, Judge


def with_params(plan: Plan, stage: int, layers: list[int]) -> Plan:
    """`plan` with `layers` (model layer indices of its `stage`-th stage, in its one pipeline) paged from the
    host (`offload=params`) instead of NVMe."""
    pipe = plan.pipelines[0]
    st = pipe.stages[stage]
    moved = set(layers)
    strategies = stage_strategies([st.strategy(i).model_copy(update={"offload": "params"}) if i in moved
                                   else st.strategy(i) for i in range(*st.layers)])
    stages = (*pipe.stages[:stage], st.model_copy(update={"strategies": strategies}), *pipe.stages[stage + 1:])
    return plan.model_copy(update={"pipelines": (pipe.model_copy(update={"stages": stages}),)})


def fill_host(best: Candidate, judge: Judge) -> Candidate:
    """`best` (a fitting plan of one pipeline) with, stage by stage, the most of its NVMe layers moved to the
    host that it still fits with, if that is faster (`best` unchanged when nothing moves)."""
    if len(best.plan.pipelines) != 1 or not best.report.fits:
        return best
    for index, stage in enumerate(best.plan.pipelines[0].stages):
        nvme = [i for i in range(*stage.layers) if stage.strategy(i).offload == "nvme"]
        lo, hi, found = 0, len(nvme), best
        while lo < hi:  # the most layers that fit: host bytes grow and time falls with every layer moved
            k = (lo + hi + 1) // 2
            tried = judge(with_params(best.plan, index, nvme[:k]), float("inf"))
            if tried is not None and tried.report.fits and \
                    tried.report.iteration_time_s <= best.report.iteration_time_s:
                lo, found = k, tried
            else:
                hi = k - 1
        best = found
    return best
