"""Mixture-of-experts layers under expert parallelism: Megatron's token dispatch, term by term.

A stage's ranks lay an MoE layer's experts out apart from its attention (parallel folding,
`plait.spec.degrees`): expert tensor parallel (etp) fastest, then expert parallel (ep), then expert data
parallel (edp). The attention hands each rank its own tokens (split by context parallelism, and by tensor
parallelism under the sequence parallelism an MoE layer needs with tp > 1); each token goes to top_k
experts. Forward: a dispatch all-to-all over the ep group (every routed token copy, hidden wide), an
all-gather over the etp group (each etp rank needs every token of its experts), the experts' grouped GEMMs
(experts/ep of them per rank, each 1/etp of its width), a reduce-scatter over the etp group and the combine
all-to-all back; backward repeats the four collectives. Megatron's all-to-all dispatcher runs them between
the GEMMs, so nothing hides them. The busiest rank gets `expert_load` times the mean routed tokens (1 with
balanced routing, the capacity factor with padded expert inputs). Times are seconds for one micro-batch on
one device; sizes are bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.cost import comm
from plait.cost.compute import gemm_time
from plait.plan import Strategy
from plait.spec.layers import Block

if TYPE_CHECKING:
    from plait.cost.layer import BlockContext


def own_tokens(block: Block, s: Strategy, tokens: float) -> float:
    """Tokens a rank routes: its share of the `tokens` its tensor-parallel group holds (sequence parallel)."""
    return tokens / (s.tp if s.sp else 1)


def routed_pairs(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> float:
    """(token, expert) pairs the busiest rank's experts process: its etp group's routed tokens spread over
    the ep ranks, times the load imbalance."""
    return own_tokens(block, s, tokens) * block.top_k * s.expert_tp * ctx.expert_load


def expert_params(block: Block) -> float:
    """Parameters of a layer's routed experts (weights and biases); 0 for layers without experts."""
    if block.kind != "moe":
        return 0.0
    bias = block.bias or block.mlp_bias
    return float(sum(g.params + g.n * g.count * bias for g in block.gemms if g.rows == "routed"))


def expert_params_per_rank(block: Block, s: Strategy) -> float:
    """Routed-expert parameters one rank holds: experts/ep experts, 1/etp of each."""
    return expert_params(block) / (s.ep * s.expert_tp)


def experts_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> tuple[float, float]:
    """(forward, backward) seconds of the routed experts' grouped GEMMs on the busiest rank."""
    if block.kind != "moe":
        return 0.0, 0.0
    gpu, cal, eb = ctx.cluster.gpu, ctx.cal, ctx.prec.activation
    peak = ctx.prec.peak_flops(gpu)
    local = block.experts // s.ep
    rows = max(1, int(routed_pairs(block, s, tokens, ctx) / local))  # tokens per local expert
    fwd = bwd = 0.0
    for g in block.gemms:
        if g.rows != "routed":
            continue
        k, n = (g.k, g.n // s.expert_tp) if g.split == "col" else (g.k // s.expert_tp, g.n)
        fwd += local * gemm_time(rows, n, k, gpu, cal, peak, eb)
        bwd += local * (gemm_time(rows, k, n, gpu, cal, peak, eb) + gemm_time(k, n, rows, gpu, cal, peak, eb))
    return fwd, bwd


def dispatch_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> float:
    """Seconds of one pass's token exchange on the busiest rank: dispatch and combine all-to-alls over the
    ep group, all-gather and reduce-scatter over the etp group (0 without experts or expert parallelism)."""
    if block.kind != "moe":
        return 0.0
    cluster, cal = ctx.cluster, ctx.cal
    sent = own_tokens(block, s, tokens) * block.top_k * ctx.expert_load * block.hidden * ctx.prec.activation
    a2a = comm.all_to_all(sent, ctx.ep_group, cluster, cal)
    gathered = sent * s.expert_tp
    etp = comm.all_gather(gathered, ctx.etp_group, cluster, cal) + comm.reduce_scatter(gathered, ctx.etp_group,
                                                                                       cluster, cal)
    return 2 * a2a + etp


def routed_activation_bytes(block: Block, s: Strategy, tokens: float, ctx: BlockContext, recompute: str) -> float:
    """Bytes the busiest rank keeps for backward of its experts, one micro-batch: each routed pair's input
    (gathered over etp) and its expert's hidden activations (1/etp of the width). Nothing under full
    recomputation."""
    if block.kind != "moe" or recompute == "full":
        return 0.0
    scale = ctx.prec.activation / 2  # the layer formulas count 16-bit activations
    per_pair_input, per_pair_hidden = block.routed_activation_bytes()
    return routed_pairs(block, s, tokens, ctx) * (per_pair_input + per_pair_hidden / s.expert_tp) * scale
