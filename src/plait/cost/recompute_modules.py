"""Megatron-LM's module-wise selective recompute (`--recompute-granularity selective --recompute-modules`,
`Strategy.recompute_modules`): named parts of a layer drop what they keep for backward and run their forward
again there. Only strategies that keep their activations take them (recompute none, or selective: the
attention core, Megatron's `core_attn`); full, attn_kept and gemm_kept recompute more already.

    mla_up_proj  latent attention's up-projections: queries, keys and values (after rotary) are not kept; the
                 q_up and kv_up GEMMs run again before the attention core's backward (Megatron-Core
                 multi_latent_attention.py, `recompute_up_proj`)
    mlp          a dense layer's MLP keeps only its input; its GEMMs and activation run again (MoE layers
                 are untouched: Megatron's `mlp` module is the dense MLP)
    moe_act      routed experts keep their first GEMM's output, not the activation's; the activation runs again
    layernorm    the norms' outputs (inputs of the attention and MLP projections) are not kept; both norms
                 run again

Seconds and bytes for one micro-batch on one device, as `plait.cost.layer` prices the rest of the layer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from plait.cost import experts
from plait.cost.compute import elementwise_time, gemm_time
from plait.plan import RECOMPUTE_MODULES, Strategy
from plait.spec.layers import GATED_MLP_SAVED, UNGATED_MLP_SAVED, Block

if TYPE_CHECKING:
    from plait.cost.layer import BlockContext

UP_PROJECTIONS = ("q_up", "kv_up")
"""Latent attention's up-projection GEMMs (`Block.gemms`), re-run by `mla_up_proj`."""
MLP_GEMMS = ("mlp_up", "mlp_down")
"""A dense layer's MLP GEMMs, re-run by `mlp`."""
NORMED_INPUTS = 2
"""Hidden-wide norm outputs a layer keeps (into the attention and into the MLP projections), dropped by
`layernorm`."""
ELEMENTWISE_MODULES = ("layernorm", "moe_act")
"""Modules that run only elementwise work again (no GEMM): the cheapest bytes to drop."""


@lru_cache(maxsize=256)
def changed_by(block: Block) -> tuple[str, ...]:
    """The recompute modules that change `block` (in RECOMPUTE_MODULES' order): `layernorm` where it has
    attention, `moe_act` in MoE layers, `mla_up_proj` under latent attention, `mlp` where its MLP is dense."""
    changes = {"layernorm": block.has_attention, "moe_act": block.kind == "moe", "mla_up_proj": block.latent,
               "mlp": _dense_mlp(block)}
    return tuple(m for m in RECOMPUTE_MODULES if changes[m])


def _applied(block: Block, s: Strategy) -> frozenset[str]:
    """The strategy's recompute modules that change `block` (`changed_by`)."""
    return frozenset(s.recompute_modules).intersection(changed_by(block)) if s.recompute_modules else frozenset()


def modules_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> float:
    """Seconds of forward the strategy's recompute modules run again in the backward of `block` under `s`
    (`tokens`: the device's tokens outside attention)."""
    mods = _applied(block, s)
    if not mods:
        return 0.0
    gpu, cal, eb = ctx.cluster.gpu, ctx.cal, ctx.prec.activation
    peak = ctx.prec.peak_flops(gpu)
    rows = max(1, int(tokens))
    names = (UP_PROJECTIONS if "mla_up_proj" in mods else ()) + (MLP_GEMMS if "mlp" in mods else ())
    seconds = 0.0
    for g in (g for g in block.gemms if g.name in names):
        k, n = g.shard(s.tp)
        seconds += g.count * gemm_time(rows, n, k, gpu, cal, peak, eb)
    elements = 0.0
    if "mlp" in mods:
        elements += tokens * (3 if block.gated_mlp else 2) * block.ffn / s.tp  # the activation: read, write
    if "moe_act" in mods:
        pairs = experts.routed_pairs(block, s, tokens, ctx)
        elements += pairs * (3 if block.gated_mlp else 2) * block.expert_ffn / s.expert_tp
    if "layernorm" in mods:
        elements += NORMED_INPUTS * 2 * tokens * block.hidden / (s.tp if s.sp else 1)  # read, write each
    return seconds + (elementwise_time(elements * eb, gpu, cal) if elements else 0.0)


def dropped_bytes(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> float:
    """Bytes `block` no longer keeps for backward under `s` for the strategy's recompute modules."""
    mods = _applied(block, s)
    if not mods:
        return 0.0
    eb = ctx.prec.activation
    per_token = 0.0
    if "mla_up_proj" in mods:
        per_token += (block.q_dim + block.k_dim + block.v_dim) / s.tp
    if "mlp" in mods:
        per_token += (GATED_MLP_SAVED if block.gated_mlp else UNGATED_MLP_SAVED) * block.ffn / s.tp
    if "layernorm" in mods:
        per_token += NORMED_INPUTS * block.hidden / (s.tp if s.sp else 1)
    dropped = tokens * per_token * eb
    if "moe_act" in mods:  # the activation's output (gated: and the product's input)
        kept_after = 2 if block.gated_mlp else 1  # the first GEMM's outputs stay
        width = (GATED_MLP_SAVED if block.gated_mlp else UNGATED_MLP_SAVED) - kept_after
        dropped += experts.routed_pairs(block, s, tokens, ctx) * width * block.expert_ffn / s.expert_tp * eb
    return dropped


def _dense_mlp(block: Block) -> bool:
    """Whether `block` has a dense MLP (Megatron's `mlp` module; an MoE layer's experts are not one)."""
    return block.kind != "moe" and any(g.name == "mlp_up" for g in block.gemms)
