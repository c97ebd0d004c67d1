"""What the runtime executes today: one rule set shared by the runtime (which refuses the rest at load
time) and the planner (whose `--runnable` search emits nothing else)."""

from __future__ import annotations

from plait.plan import Plan
from plait.spec.model import ModelSpec


def unsupported(plan: Plan, model: ModelSpec) -> str | None:
    """Why `plan` cannot run on this version's runtime (one line), or None if it can."""
    if (reason := unbuildable(model)) is not None:
        return reason
    if len(plan.pipelines) > 1 and (reason := _unsupported_replicas(plan, model)):
        return reason
    for pi, pipe in enumerate(plan.pipelines):
        stages = pipe.stages
        which = f"pipeline {pi} " if len(plan.pipelines) > 1 else "the pipeline "
        pp = len(stages) // plan.chunks
        if pp > 1 and pipe.micro_batches < pp:
            return (f"{which}has {pp} stages but only {pipe.micro_batches} micro-batches; "
                    "torch.distributed.pipelining needs at least one per stage: lower mbs or raise gbs")
        width = len(stages[0].ranks)
        for si, stage in enumerate(stages):
            if len(stage.ranks) != width:
                return (f"stage {si} has {len(stage.ranks)} ranks and stage 0 has {width}; the runtime pairs "
                        "stages rank by rank, so every stage needs the same number of ranks")
    stages = plan.pipelines[0].stages
    if model.tied_embeddings:
        first, last = stages[0].strategies[0], stages[-1].strategies[-1]
        if first.model_copy(update={"recompute": "none"}) != last.model_copy(update={"recompute": "none"}):
            return (f"{model.name} ties its embedding and LM head, so the first and last layers must share one "
                    f"layout ({first.short()} vs {last.short()})")
        mixed = len({s.model_copy(update={"recompute": "none"}) for s in stages[0].strategies}) > 1
        if len(stages) == 1 and mixed and first.zero > 0:
            return (f"{model.name} ties its embedding and LM head, which FSDP cannot shard as two units of a stage "
                    "with per-layer strategies; use zero=0 for its first and last layers")
    return None


def _unsupported_replicas(plan: Plan, model: ModelSpec) -> str | None:
    """Several pipelines (data-parallel replicas that may cut the model differently): the runtime reduces
    each layer's gradients over the ranks holding the same shard in every pipeline, so each layer needs
    the same tensor-parallel layout everywhere and no data, context or ZeRO sharding inside a stage."""
    if plan.chunks > 1:
        return "several pipelines with interleaved chunks are not executable yet; use one pipeline or vpp=1"
    shapes: dict[int, tuple[int, bool]] = {}
    for pi, pipe in enumerate(plan.pipelines):
        for stage in pipe.stages:
            for layer in range(*stage.layers):
                s = stage.strategy(layer)
                if s.dp > 1 or s.cp > 1 or s.zero:
                    return (f"pipeline {pi} uses {s.short()} at layer {layer}; with several pipelines every stage "
                            "is one tensor-parallel group (dp=1, cp=1, zero=0)")
                if shapes.setdefault(layer, (s.tp, s.sp)) != (s.tp, s.sp):
                    return (f"layer {layer} is split tp={s.tp} in pipeline {pi} but tp={shapes[layer][0]} in another; "
                            "with several pipelines a layer needs one tensor-parallel layout")
    return None


def unbuildable(model: ModelSpec) -> str | None:
    """Why the runtime cannot build `model` (one line), or None if it can: it builds GPT and Llama stacks of
    plain decoder layers with global attention."""
    if model.family not in ("llama", "gpt"):
        return f"model {model.name!r} has family {model.family!r}; the runtime builds llama or gpt models"
    if not model.uniform or model.window:
        kinds = ", ".join(f"{n} {k}" for k, n in model.kind_counts().items())
        return (f"model {model.name!r} mixes layer kinds or attention windows ({kinds}); the runtime builds "
                "stacks of identical decoder layers with global attention")
    return None
