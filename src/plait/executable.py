"""What the runtime executes today: one rule set shared by the runtime (which refuses the rest at load
time) and the contract test (`tests/test_contract.py`: no planner's output is refused)."""

from __future__ import annotations

import re

from plait.cost.offload import PAGED
from plait.plan import Pipeline, Plan, Stage, expert_problem, kind_problem
from plait.spec.model import ModelSpec


def unsupported(plan: Plan, model: ModelSpec) -> str | None:
    """Why `plan` cannot run on this version's runtime (one line), or None if it can."""
    if (reason := unbuildable(model)) is not None or (reason := _kind_problem(plan, model)) is not None or \
            (reason := _expert_problem(plan, model)) is not None:
        return reason
    if (reason := _unsupported_sharding(plan, model)) is not None or \
            (reason := _unsupported_hierarchy(plan, model)) is not None or \
            (reason := _unsupported_recompute(plan, model)) is not None:
        return reason
    if len(plan.pipelines) > 1 and (reason := _unsupported_replicas(plan, model)):
        return reason
    if model.mtp_layers and (reason := _mtp_problem(plan, model)) is not None:
        return reason
    if plan.ep_overlap:
        return ("ep_overlap: the runtime exchanges MoE tokens without overlapping them with another micro-batch "
                "(Megatron-LM's option, priced for comparison); set ep_overlap=0 to train")
    for pi, pipe in enumerate(plan.pipelines):  # fewer micro-batches than stages: the runtime's own schedule
        if not pipe.even_widths and (reason := _uneven_problem(plan, model, pi)) is not None:
            return reason
    return None


def tied_ends_alike(pipe: Pipeline) -> bool:
    """Whether `pipe`'s first and last layers lay a tied embedding and head out alike (the same strategy but
    for recompute, on as many ranks): the two copies' gradients then add shard by shard; else each end
    gathers its whole gradient and sums them (`plait.runtime.placement.Placement.tied_whole`)."""
    first, last = pipe.stages[0], pipe.stages[-1]
    a, b = first.strategies[0], last.strategies[-1]
    return len(first.ranks) == len(last.ranks) and \
        a.without_recompute() == b.without_recompute()


def tied_copies(plan: Plan) -> bool:
    """Whether the pipelines of `plan` hold a tied embedding table twice, the embedding's copy laid out like
    the first layer and the head's like the last, whose whole gradients are summed after backward: in
    pipelines of several stages, and in one stage whose first and last layers lay the table out
    differently, or whose per-layer strategies (segments, `plait.runtime.parallelize.apply_dp_segment`)
    would put one table into two ZeRO (FSDP) units. Then every pipeline does, also one of one stage beside
    pipelines of several, so that pipelines reduce each copy with its own kind; else each stage holds one
    table."""
    return any(_tied_apart(pipe) for pipe in plan.pipelines)


def _tied_apart(pipe: Pipeline) -> bool:
    """Whether `pipe` cannot hold a tied table as one parameter (`tied_copies`)."""
    if len(pipe.stages) > 1 or not tied_ends_alike(pipe):
        return True
    stage = pipe.stages[0]
    return len(stage.layer_strategies()) > 1 and stage.strategies[0].zero > 0


def _uneven_problem(plan: Plan, model: ModelSpec, pi: int) -> str | None:
    """Why pipeline `pi`, whose stages have different widths, cannot run (one line), or None: the runtime's
    own schedule (`plait.runtime.pipeline_uneven`, `plait.runtime.pipeline_chunks` with interleaved chunks)
    runs the stages of any pipeline of a plan of one or several pipelines, whose boundaries hand over the
    state every family carries (`plait.runtime.boundary`: [B, T, H]; T5's [B, T, 2H]; LLaVA's flat image and
    text before its projector). Nothing is refused today."""
    return None


def _unsupported_sharding(plan: Plan, model: ModelSpec) -> str | None:
    """HSDP (a ZeRO shard group smaller than the data-parallel ranks) runs on FSDP2's 2-D mesh
    (`plait.runtime.placement.Segment.hsdp`), in MoE layers too: their dense weights shard over the shard
    group, their routed experts over the whole expert data-parallel group, as `plait.cost.experts.held_params`
    prices them. Every `grad_reduce` runs (`plait.runtime.zero.REDUCE_DTYPES`)."""
    return None


def _unsupported_hierarchy(plan: Plan, model: ModelSpec) -> str | None:
    """Token-wise swapping runs with every recomputation (checkpoint saves the block's input under the swap's
    hooks; selective recomputation's kept GEMM outputs and attn_kept's attention outputs are cut in its
    cache), with tensor and sequence parallelism (DTensors cut as their local tensors) and context
    parallelism (each rank's chunk). Offload runs per layer (`plait.runtime.offload`): "optim" and "nvme" step
    AdamW on the CPU over this rank's shard (its states in host memory, or in files), with any ZeRO stage, on
    one replica, with context parallelism and in MoE layers; "params" and "nvme" page the parameter shard with
    FSDP2's CPUOffloadPolicy (its units over one replica too, and over MoE layers' expert groups), which needs
    ZeRO where the weights have several replicas."""
    strategies = [s for p in plan.pipelines for st in p.stages for s in st.strategies]
    for s in strategies:
        if s.offload in PAGED and s.zero == 0 and s.dp * s.cp > 1:
            return (f"{s.short()}: offload={s.offload} pages the parameter shard with FSDP2, which needs ZeRO "
                    "over replicated weights; use zero >= 1 or offload=optim")
    return None


def _mtp_problem(plan: Plan, model: ModelSpec) -> str | None:
    """Multi-token-prediction modules (`plait.models.mtp`) run in plans of one pipeline without context
    parallelism, on layers without tensor parallelism: they read the step's targets whole on the last stage
    and look them up in a plain copy of the embedding table."""
    if len(plan.pipelines) > 1:
        return (f"model {model.name!r} ends in multi-token-prediction modules, which the runtime trains in plans of "
                "one pipeline; plan one pipeline")
    for stage in plan.pipelines[0].stages:
        for layer in range(*stage.layers):
            s = stage.strategy(layer)
            if s.cp > 1 or (s.tp > 1 and layer >= model.trunk_layers):
                return (f"layer {layer} ({s.short()}): the runtime trains multi-token-prediction models without "
                        "context parallelism and their modules without tensor parallelism; use cp=1 (and tp=1 on "
                        "the modules)")
    return None


def _unsupported_recompute(plan: Plan, model: ModelSpec) -> str | None:
    """gemm_kept (op-level selective checkpointing, `plait.runtime.parallelize.apply_ac`) keeps every GEMM
    output in the checkpointed block: ring attention (`plait.runtime.ring`) multiplies its score blocks with
    matmuls inside the block, so they would be kept too (s^2 bytes, not priced) and its K/V passes rerun;
    refused there. Every other recompute mode runs with every strategy."""
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            for layer in range(*stage.layers):
                s = stage.strategy(layer)
                if s.recompute == "gemm_kept" and s.ring and \
                        layer < model.layers and model.stack[layer].has_attention:
                    return (f"layer {layer} ({s.short()}): recompute=gemm_kept would keep ring attention's "
                            "score blocks; use cp_mode=ulysses or another recompute mode")
    return None


def shard_shape(stage: Stage, layer: int) -> tuple:
    """What decides how a stage's ranks shard `layer`'s weights and gradients: the stage's width, the
    tensor-, data- and context-parallel degrees, whether ZeRO shards them and over how many (HSDP), and the
    expert-parallel and
    expert-tensor-parallel degrees (1 and tp outside MoE layers). Pipelines whose holders of a
    layer differ in it reduce its gradients as whole tensors (`plait.runtime.placement.Replicas`)."""
    s = stage.strategy(layer)
    return len(stage.ranks), s.tp, s.dp, s.cp, s.zero > 0, s.shard, s.ep, s.expert_tp


def holders(plan: Plan, layer: int) -> list[Stage]:
    """The stage of each pipeline that holds `layer`."""
    return [next(st for st in pipe.stages if st.layers[0] <= layer < st.layers[1]) for pipe in plan.pipelines]


def _unsupported_replicas(plan: Plan, model: ModelSpec) -> str | None:
    """Several pipelines (data-parallel replicas that may cut and shard the model differently, with stages
    of different widths or interleaved chunks): the runtime reduces each layer's gradients across pipelines,
    shard by shard where every pipeline shards it alike, else as whole tensors over all its holders
    (`plait.runtime.placement.Replicas`). ZeRO over the pipelines themselves splits the optimizer state of a
    layer held alike among its holders (`plait.runtime.replica_zero`). A tied embedding and head is held
    twice by every pipeline when any pipeline holds it twice (`tied_copies`): the embedding's copies reduce
    with the first layer's holders, the head's with the last's, then each pipeline sums its two. Nothing is
    refused today."""
    return None


BUILT_STACKS: dict[str, tuple[str, str]] = {
    "gpt": (r"(decoder )+", "decoder layers"),
    "llama": (r"((decoder|moe) )+", "decoder and moe layers"),
    "t5": (r"(encoder )+(cross_decoder )+", "encoder layers then cross_decoder layers"),
    "llava": (r"patch_embed (vision )*projector (decoder )+",
              "patch_embed, vision layers, projector, then decoder layers"),
}
"""The stacks the runtime builds for each family (plait.models): a pattern over the layer kinds, and its text."""


def unbuildable(model: ModelSpec) -> str | None:
    """Why the runtime cannot build `model` (one line), or None if it can: GPT and Llama stacks of identical
    decoder layers (but for their attention windows), T5-style encoder layers then cross-decoder layers, and
    LLaVA-style patch embedding, vision layers and projector then decoder layers; Llama stacks of decoder
    and MoE layers; global or sliding-window attention on any layer; latent attention (DeepSeek-V2/V3) on
    every layer of a Llama stack; q/k norms (Qwen3), attention sinks and the clamped SwiGLU (GPT-OSS) in Llama
    stacks without it; multi-token-prediction modules after a Llama stack with an untied head."""
    kinds = ", ".join(f"{n} {k}" for k, n in model.kind_counts().items())
    if model.mtp_layers and (model.family != "llama" or model.tied_embeddings):
        return (f"model {model.name!r}: the runtime builds multi-token-prediction modules in llama models with "
                "an untied head; untie it (tied=0) or drop mtp")
    if model.family not in BUILT_STACKS:
        return (f"model {model.name!r} has family {model.family!r}; the runtime builds "
                f"{', '.join(BUILT_STACKS)} models")
    if "moe" in model.kind_counts() and model.family != "llama":
        return f"model {model.name!r} has MoE layers ({kinds}); the runtime builds MoE layers in llama models"
    latent = {b.rope_head_dim if b.latent else None for b in model.stack if b.has_attention}
    if latent != {None} and (model.family != "llama" or len(latent) > 1):
        return (f"model {model.name!r} has latent-attention layers; the runtime builds them in llama models whose "
                "every layer uses latent attention with one rotary width")
    if any(b.qk_norm for b in model.stack) and (model.family != "llama" or latent != {None}):
        return (f"model {model.name!r} has q/k norms (Qwen3's); the runtime builds them in llama models without "
                "latent attention")
    if any(b.sinks or b.swiglu_limit for b in model.stack) and (model.family != "llama" or latent != {None}):
        return (f"model {model.name!r} has GPT-OSS's attention sinks or clamped SwiGLU; the runtime builds them in "
                "llama models without latent attention")
    if model.family == "gpt" and any(b.with_(window=0) != model.block.with_(window=0) for b in model.stack):
        return (f"model {model.name!r} mixes layer kinds ({kinds}); the runtime builds {model.family} stacks of "
                "identical decoder layers")
    pattern, text = BUILT_STACKS[model.family]
    if not re.fullmatch(pattern, "".join(f"{b.kind} " for b in model.stack)):
        return f"model {model.name!r} stacks {kinds}; the runtime builds {model.family} models as {text}"
    return None


def _kind_problem(plan: Plan, model: ModelSpec) -> str | None:
    """The first layer whose strategy its kind does not run with (`plait.plan.kind_problem`), or whose image
    leaves no text in the sequence."""
    if model.family in ("gpt", "llama"):  # decoder layers run with every strategy
        return None
    if model.family == "llava":
        image = model.image_tokens
        if plan.seq_len <= image:
            return (f"seq_len={plan.seq_len} leaves no text after the {image} image tokens of {model.name}; "
                    f"raise the sequence length above {image}")
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            for layer in range(*stage.layers):
                if layer < model.layers and (why := kind_problem(stage.strategy(layer), model.stack[layer])):
                    return f"layer {layer} ({model.stack[layer].kind}): {why}"
    return None


def _expert_problem(plan: Plan, model: ModelSpec) -> str | None:
    """The first MoE layer whose degrees do not lay out its experts over its stage's ranks
    (`plait.plan.expert_problem`). Each stage of each pipeline holds whole experts (ep and etp span a
    stage's ranks only), so with several pipelines their gradients cross pipelines like any layer's
    (`plait.runtime.placement.Replicas`), under the same rules (`_unsupported_replicas`)."""
    if "moe" not in model.kind_counts():
        return None
    for pi, pipe in enumerate(plan.pipelines):
        which = f"pipeline {pi} " if len(plan.pipelines) > 1 else ""
        for stage in pipe.stages:
            for layer in range(*stage.layers):
                block, s = model.stack[layer], stage.strategy(layer)
                if block.kind == "moe" and (why := expert_problem(s, block)) is not None:
                    return f"{which}layer {layer} (moe, {s.short()}): {why}"
    return None
