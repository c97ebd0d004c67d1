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

LSH-MoE (`moe_comm=lsh`, `plait.runtime.lsh`): each rank hashes its routed pairs and sends only bucket
centroids, `LSH_COMPRESSION_RATE` of them, so the all-to-all bytes, the experts' rows and their saved
inputs scale by that rate; the hashing (a GEMM of the pairs by the rotations), the centroid means and the
expansion back to the pairs cost time on the sending rank.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from plait.cost import comm
from plait.cost.compute import elementwise_time, gemm_time
from plait.plan import Strategy
from plait.spec.layers import Block
from plait.spec.lsh import LSH_COMPRESSION_RATE, LSH_DIMS, LSH_HASHES

if TYPE_CHECKING:
    from plait.cost.layer import BlockContext


EXPERT_GEMM_HOST_S = 40e-6
"""Host seconds to issue one local expert's GEMM in a grouped expert layer, exposed because the GPU waits on
them. Megatron's dropless token dispatchers copy the tokens per expert to the host (a device-to-host sync that
drains the GPU's queue), after which the host issues the rest of the layer, the experts' GEMMs one per local
expert (TransformerEngine's GroupedLinear: a torch.split of the routed tokens and a general_grouped_gemm call
whose C++ loop launches them), so with many small experts the GPU idles behind the host; the reason Megatron
captures `moe_router` and `moe_preprocess` in CUDA graphs and prefers ep = experts (MoE README, "CUDA Graph
support"). Bounded by a profiled run: in Megatron-Bridge's Qwen3-30B-A3B A/B on 16 H100 (the run
`Calibration.moe_exchange_overhead_s` is taken from; 8 local experts of 4,096 rows) the GPU was idle for 1.89 s
of the 24.71 s step (GPU-active union 22.82 s), which 40 us an expert GEMM accounts for entirely (1.94 s: the
experts' GEMMs take 0.43 ms a forward, their launches 0.64 ms); 50 us, the value before that profile was read,
would idle it 3.4 s. The collected rows prefer the top of that bound: Qwen3-235B with 16 local experts of 512
rows (TP4 EP8) is -10% at 40 us, -25% at 25 us."""


def own_tokens(block: Block, s: Strategy, tokens: float) -> float:
    """Tokens a rank routes: its share of the `tokens` its tensor-parallel group holds (sequence parallel)."""
    return tokens / (s.tp if s.sp else 1)


def compression(block: Block, s: Strategy) -> float:
    """Rows that travel to the experts per routed pair: LSH-MoE's compression rate under moe_comm=lsh, else 1."""
    return LSH_COMPRESSION_RATE if s.moe_comm == "lsh" and block.kind == "moe" else 1.0


def routed_pairs(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> float:
    """(token, expert) rows the busiest rank's experts process: its etp group's routed tokens spread over
    the ep ranks, times the load imbalance (LSH-MoE: centroids, the compression rate of them)."""
    return own_tokens(block, s, tokens) * block.top_k * s.expert_tp * ctx.expert_load * compression(block, s)


def lsh_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> tuple[float, float]:
    """(forward, backward) seconds of LSH-MoE's compression on a rank (0 without moe_comm=lsh). Forward: the
    hash GEMM [pairs, hidden] x [hidden, hashes*dims], then memory-bound passes that read the pairs to centre
    and hash them, sum them into centroids and write each pair's expanded output (3 pair-sized tensors, 2
    centroid-sized); backward: the gradients of the expansion and the means (2 and 2; the hash has none)."""
    if block.kind != "moe" or s.moe_comm != "lsh":
        return 0.0, 0.0
    gpu, cal, eb = ctx.cluster.gpu, ctx.cal, ctx.prec.activation
    pairs = own_tokens(block, s, tokens) * block.top_k
    centroids = pairs * compression(block, s)
    gemm = gemm_time(int(pairs), LSH_HASHES * LSH_DIMS, block.hidden, gpu, cal, ctx.prec.peak_flops(gpu), eb)
    fwd = gemm + elementwise_time((3 * pairs + 2 * centroids) * block.hidden * eb, gpu, cal, kernels=4)
    bwd = elementwise_time((2 * pairs + 2 * centroids) * block.hidden * eb, gpu, cal, kernels=2)
    return fwd, bwd


def permute_passes(block: Block, s: Strategy, ctx: BlockContext) -> int:
    """Memory-bound passes over the routed token copies in one forward pass of an MoE layer (as many in
    backward, their gradients), from Megatron-LM megatron/core/transformer/moe/token_dispatcher.py. The
    all-to-all dispatcher permutes the tokens into expert order before the dispatch (moe_utils.permute) and
    unpermutes them after the combine, and with several local experts under ep > 1 also sorts the received
    chunks by local expert after the dispatch and back before the combine (sort_chunks_by_idxs): 4 passes, 2
    with one local expert or without ep. DeepEP (_DeepepManager) receives each token once per rank and
    permutes it to its local experts after the dispatch, unpermutes before the combine: 2 passes.
    moe_permute_fusion runs each pass as one TransformerEngine kernel; the bytes are the same."""
    if ctx.dispatcher == "deepep":
        return 2
    return 4 if s.ep > 1 and block.experts // s.ep > 1 else 2


def permute_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> tuple[float, float]:
    """(forward, backward) seconds of the token permutations around the experts on the busiest rank
    (`permute_passes` of them each way): each pass reads and writes every routed copy, hidden wide, at the
    fused elementwise share of HBM bandwidth (0 without experts)."""
    if block.kind != "moe":
        return 0.0, 0.0
    passes = permute_passes(block, s, ctx)
    moved = passes * 2 * routed_pairs(block, s, tokens, ctx) * block.hidden * ctx.prec.activation
    t = elementwise_time(moved, ctx.cluster.gpu, ctx.cal, kernels=passes)
    return t, t


EXPERT_BIAS_FORWARD_BYTES = 28
"""Bytes moved per (routed pair, hidden element) in forward by Megatron's unfused bias of the experts' second
GEMM, scaled by the router probability (TEGroupedMLP._apply_bias, megatron/core/transformer/moe/experts.py, the
same from Megatron-LM a329dd6da5, MR !3858 "Enable bias in expert mlp [gpt-oss 5/5]", September 2025, until the
packed path of 883533e049, August 2026, so the code of the NeMo 26.02-26.04 containers: per local expert
`t + b * p` on a torch.split view, then torch.cat and .to(bf16)): b * p writes fp32 (4), the add reads the bf16 output and
the fp32 product and writes fp32 (2 + 4 + 4), cat copies fp32 (4 + 4), the cast reads fp32 and writes bf16
(4 + 2)."""
EXPERT_BIAS_BACKWARD_BYTES = 40
"""Bytes moved per (routed pair, hidden element) in backward by the same ops' autograd: the cast's gradient to
fp32 (2 + 4), the add's gradient cast to bf16 for the GEMM output (4 + 2), the bias and probability gradients
each a broadcast multiply and a reduction ((4 + 4) + 4, twice), and torch.split's backward, a cat of the bf16
gradients (2 + 2)."""


def expert_bias_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> tuple[float, float]:
    """(forward, backward) seconds of the experts' output bias on the busiest rank: memory-bound passes over every
    routed row, hidden wide (`EXPERT_BIAS_FORWARD_BYTES`, `EXPERT_BIAS_BACKWARD_BYTES`), issued per local expert
    (forward 2 kernels each plus the cat and the cast; backward 5 each plus the cast and split's cat). 0 for
    experts without biases (only GPT-OSS's have them) or layers without experts."""
    if block.kind != "moe" or not (block.bias or block.mlp_bias):
        return 0.0, 0.0
    local = block.experts // s.ep
    elements = routed_pairs(block, s, tokens, ctx) * block.hidden
    gpu, cal = ctx.cluster.gpu, ctx.cal
    return (elementwise_time(EXPERT_BIAS_FORWARD_BYTES * elements, gpu, cal, kernels=2 * local + 2),
            elementwise_time(EXPERT_BIAS_BACKWARD_BYTES * elements, gpu, cal, kernels=5 * local + 2))


def expert_params(block: Block) -> float:
    """Parameters of a layer's routed experts (weights and biases); 0 for layers without experts."""
    if block.kind != "moe":
        return 0.0
    bias = block.bias or block.mlp_bias
    return float(sum(g.params + g.n * g.count * bias for g in block.gemms if g.rows == "routed"))


def expert_params_per_rank(block: Block, s: Strategy) -> float:
    """Routed-expert parameters one rank holds: experts/ep experts, 1/etp of each."""
    return expert_params(block) / (s.ep * s.expert_tp)


def held_params(block: Block, s: Strategy, ctx: BlockContext) -> list[tuple[float, comm.GroupShape]]:
    """(parameters one rank holds, the group that shares them) of the layer's tensor-parallel part (over the
    data-parallel group) and, for an MoE layer, of its routed experts (over the expert data-parallel group)."""
    dense = [((block.params - expert_params(block)) / s.tp, ctx.dp_group)]
    routed = expert_params_per_rank(block, s)
    return dense + [(routed, ctx.edp_group)] if routed else dense


def experts_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> tuple[float, float]:
    """(forward, backward) seconds of the routed experts' grouped GEMMs on the busiest rank."""
    if block.kind != "moe":
        return 0.0, 0.0
    gpu, cal, eb = ctx.cluster.gpu, ctx.cal, ctx.prec.activation
    peak = ctx.prec.peak_flops(gpu)
    local = block.experts // s.ep
    rows = max(1, int(routed_pairs(block, s, tokens, ctx) / local))  # tokens per local expert
    fwd = bwd = 0.0
    calls = 0
    for g in block.gemms:
        if g.rows != "routed":
            continue
        k, n = g.shard(s.expert_tp)
        fwd += local * gemm_time(rows, n, k, gpu, cal, peak, eb)
        bwd += local * (gemm_time(rows, k, n, gpu, cal, peak, eb) + gemm_time(k, n, rows, gpu, cal, peak, eb))
        calls += 1
    # The host launches each local expert's GEMM one by one after the dispatcher's sync: a pass takes at
    # least its launches' host time (forward: one GEMM per weight; backward: data and weight gradients).
    launch = local * calls * EXPERT_GEMM_HOST_S
    return max(fwd, launch), max(bwd, 2 * launch)


def routed_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> tuple[float, float]:
    """(forward, backward) seconds of the busiest rank's work on its routed tokens: the experts' GEMMs,
    LSH-MoE's compression, the permutation passes and the experts' output bias (0 without experts)."""
    terms = [t(block, s, tokens, ctx) for t in (experts_time, lsh_time, permute_time, expert_bias_time)]
    return sum(f for f, _ in terms), sum(b for _, b in terms)


def extra_load_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> tuple[float, float]:
    """(forward, backward) seconds the busiest rank's extra routed tokens (`expert_load` over 1) add to its
    `routed_time`: what a measured layer, whose router spread the tokens about evenly, lacks (0 at balanced
    load or without experts)."""
    if block.kind != "moe" or ctx.expert_load == 1.0:
        return 0.0, 0.0
    (loaded_f, loaded_b), (even_f, even_b) = (routed_time(block, s, tokens, c)
                                              for c in (ctx, replace(ctx, expert_load=1.0)))
    return loaded_f - even_f, loaded_b - even_b


def extra_load_activation_bytes(block: Block, s: Strategy, tokens: float, ctx: BlockContext, recompute: str
                                ) -> float:
    """Bytes the busiest rank's extra routed tokens (`expert_load` over 1) keep for backward beyond a measured
    layer's (see `extra_load_time`)."""
    if block.kind != "moe" or ctx.expert_load == 1.0:
        return 0.0
    even = replace(ctx, expert_load=1.0)
    return (routed_activation_bytes(block, s, tokens, ctx, recompute)
            - routed_activation_bytes(block, s, tokens, even, recompute))


def expert_sync_window(block: Block, s: Strategy, ctx: BlockContext, group: comm.GroupShape,
                       ep_pass: float) -> float:
    """Seconds of one pass's token exchange (`ep_pass`, from `dispatch_time`) that a ZeRO-2/3 collective over
    `group` can also run beside: the collectives sit on their own stream and keep going through the dispatch
    and combine, and when the routed experts' weights sync over the expert data-parallel group across nodes
    while the exchange stays inside one node (ep <= GPUs per node), the two use different links (InfiniBand and
    NVLink), so the exchange lengthens the overlap window. 0 when the exchange also crosses nodes (the two
    share the network), for the dense part's group, or without experts."""
    if block.kind != "moe" or group != ctx.edp_group or group.nodes <= 1 or ctx.ep_group.nodes > 1:
        return 0.0
    return ep_pass


def dispatch_time(block: Block, s: Strategy, tokens: float, ctx: BlockContext) -> float:
    """Seconds of one pass's token exchange on the busiest rank: dispatch and combine all-to-alls over the
    ep group, each with the dispatchers' fixed cost beyond its transfer (`Calibration.moe_exchange_overhead_s`),
    all-gather and reduce-scatter over the etp group (0 without experts or expert parallelism)."""
    if block.kind != "moe":
        return 0.0
    cluster, cal = ctx.cluster, ctx.cal
    gathered = routed_pairs(block, s, tokens, ctx) * block.hidden * ctx.prec.activation  # the etp group's rows
    sent = gathered / s.expert_tp  # this rank's own routed rows
    a2a = token_exchange_time(block, sent, ctx)
    etp = comm.all_gather(gathered, ctx.etp_group, cluster, cal) + comm.reduce_scatter(gathered, ctx.etp_group,
                                                                                       cluster, cal)
    overhead = cal.moe_exchange_overhead_s if ctx.ep_group.size > 1 else 0.0
    return 2 * (a2a + overhead) + etp


def destinations(block: Block, parts: int, routing: str = "random") -> float:
    """Expected number of the `parts` equal parts of `block`'s experts (the ranks, or the nodes, of the ep group)
    that a token's top_k distinct experts fall in. Random routing (Megatron's forced balance draws random
    logits): each part holds experts/parts of them and is missed by all top_k picks with probability
    C(experts - experts/parts, top_k) / C(experts, top_k). With router groups (`Block.expert_groups`, DeepSeek's
    node-limited routing) the picks come from group_top_k random groups (`_missed_with_groups`). Contiguous
    routing (NeMo AutoModel's FakeBalancedGate, nemo_automodel/components/moe/layers.py: token t takes experts
    t*top_k .. t*top_k + top_k - 1 modulo experts, whatever the groups): a block of top_k consecutive experts
    starting at a multiple of top_k, which spans ceil(top_k / (experts/parts)) parts."""
    if parts <= 1:
        return float(parts)
    experts, top_k = block.experts, block.top_k
    per_part = experts // parts
    if routing == "contiguous":
        return float(min(parts, math.ceil(top_k / per_part)))
    missed = _missed_with_groups(block, parts)
    if missed is None:
        missed = math.comb(experts - per_part, top_k) / math.comb(experts, top_k)
    return parts * (1.0 - missed)


def _missed_with_groups(block: Block, parts: int) -> float | None:
    """Probability that a token's top_k experts all miss one of `parts` equal parts of the experts when they come
    from the group_top_k of expert_groups groups it picks (random groups, then random experts of theirs). A part
    of q whole groups is missed unless some of the c of them picked (hypergeometric) get a pick; a part inside
    a group is missed unless its group is picked and one of the picked groups' top_k experts is its. None without
    router groups, or where parts and groups do not nest (priced as without them)."""
    groups, picked = block.expert_groups, block.group_top_k
    if not block.grouped_routing or (groups % parts and parts % groups):
        return None
    per_group = block.experts // groups
    pool = picked * per_group
    if groups % parts == 0:
        q = groups // parts
        return sum(math.comb(q, c) * math.comb(groups - q, picked - c) / math.comb(groups, picked)
                   * math.comb(pool - c * per_group, block.top_k) / math.comb(pool, block.top_k)
                   for c in range(min(q, picked) + 1))
    chosen = picked / groups
    inside = math.comb(pool - block.experts // parts, block.top_k) / math.comb(pool, block.top_k)
    return (1.0 - chosen) + chosen * inside


def remote_nodes_per_token(block: Block, nodes: int, routing: str = "random") -> float:
    """Expected number of other nodes a token's top_k distinct experts fall on, with `block`'s experts spread
    evenly over `nodes` nodes (`destinations`; a token's own node is any one of them alike)."""
    if nodes <= 1:
        return 0.0
    return destinations(block, nodes, routing) * (nodes - 1) / nodes


def token_exchange_time(block: Block, sent: float, ctx: BlockContext) -> float:
    """Seconds of one dispatch (or combine) all-to-all of `sent` bytes of routed token copies over the ep group.

    Megatron's all-to-all dispatcher (`ctx.dispatcher` "alltoall", and plait's runtime) is one NCCL
    all_to_all_single of every routed copy: each copy bound for another rank crosses NVLink inside the node and
    the rank's NIC to another node, so across nodes the network carries top_k times the remote share of the
    token's bytes. DeepEP and HybridEP ("deepep": Megatron's flex dispatcher, NeMo AutoModel) send a token once
    per destination rank inside a node (its is_token_in_rank layout; the receiver copies it to its experts), and
    between nodes once per destination node, however many of its experts live there, forwarded to them over
    that node's NVLink (DeepSeek-V3 report, sec. 3.2.2: "each token ... transmitted via IB to the GPUs with the
    same in-node index on its target nodes ... then forwarded via NVLink"): the network carries the token's bytes
    times the expected number of other nodes its experts fall on (`remote_nodes_per_token`)."""
    group, cluster, cal = ctx.ep_group, ctx.cluster, ctx.cal
    if ctx.dispatcher != "deepep":
        return comm.all_to_all(sent, group, cluster, cal)
    token_bytes = sent / block.top_k
    copies = token_bytes * destinations(block, group.size, ctx.routing)  # once per rank
    if group.nodes <= 1:
        return comm.all_to_all(copies, group, cluster, cal)
    local = comm.all_to_all(copies, comm.GroupShape(group.per_node, 1, group.per_node), cluster, cal)
    remote_bytes = token_bytes * remote_nodes_per_token(block, group.nodes, ctx.routing)
    remote = remote_bytes / (cluster.inter.bandwidth * cal.network_efficiency) + cluster.inter.latency
    return max(local, remote)


def routed_activation_bytes(block: Block, s: Strategy, tokens: float, ctx: BlockContext, recompute: str) -> float:
    """Bytes the busiest rank keeps for backward of its experts, one micro-batch: each routed pair's input
    (gathered over etp) and its expert's hidden activations (1/etp of the width). Nothing under full
    recomputation, nor under attn_kept (the experts are recomputed too)."""
    if block.kind != "moe" or recompute in ("full", "attn_kept"):
        return 0.0
    scale = ctx.prec.activation / 2  # the layer formulas count 16-bit activations
    per_pair_input, per_pair_hidden = block.routed_activation_bytes(recompute)  # type: ignore[arg-type]
    return routed_pairs(block, s, tokens, ctx) * (per_pair_input + per_pair_hidden / s.expert_tp) * scale
