"""What the runtime executes today: one rule set shared by the runtime (which refuses the rest at load
time) and the planner (whose `--runnable` search emits nothing else)."""

from __future__ import annotations

from plait.plan import Plan
from plait.spec.model import ModelSpec


def unsupported(plan: Plan, model: ModelSpec) -> str | None:
    """Why `plan` cannot run on this version's runtime (one line), or None if it can."""
    if len(plan.pipelines) > 1:
        return "plans with several pipelines are not executable yet; use one pipeline"
    stages = plan.pipelines[0].stages
    if model.tied_embeddings and len(stages) > 1:
        return (f"{model.name} ties its embedding and LM head, which pipeline stages would split; the runtime "
                "does not sync them across stages yet: use pp=1 or an untied model")
    pp = len(stages) // plan.chunks
    if pp > 1 and plan.pipelines[0].micro_batches < pp:
        return (f"the pipeline has {pp} stages but only {plan.pipelines[0].micro_batches} micro-batches; "
                "torch.distributed.pipelining needs at least one per stage: lower mbs or raise gbs")
    first = stages[0].strategies[0]
    for si, stage in enumerate(stages):
        if len(set(stage.strategies)) > 1:
            return (f"stage {si} mixes strategies across its layers, which the runtime does not execute yet; "
                    "use one strategy per stage")
        s = stage.strategies[0]
        if s.cp > 1 and s.cp_mode != "ulysses":
            return f"stage {si} uses ring context parallelism, which the runtime does not execute yet; use cp_mode=ulysses"
        if (s.dp, s.tp, s.sp, s.cp) != (first.dp, first.tp, first.sp, first.cp) or len(stage.ranks) != len(stages[0].ranks):
            return (f"stage {si} lays out its devices differently from stage 0 ({s.short()} vs {first.short()}); "
                    "the runtime needs one layout along the pipeline yet")
    return None
