"""Time and activation memory of one transformer block for one micro-batch on one device.

Each term has a name. Compute: the block's GEMMs (column/row split by tensor parallelism, tokens split by
data and context parallelism), the attention core (flash or eager), and memory-bound elementwise work
(norms, residual adds, dropout, activation functions, RoPE), whose replicated part is divided by the
tensor-parallel degree only under sequence parallelism. Communication: Megatron tensor-parallel
collectives (2 forward, 2 backward; repeated by full, attn_kept and gemm_kept recompute), Ulysses all-to-alls
or ring K/V passes for context parallelism, and ZeRO-2/3 per-micro-batch gathers and reduce-scatters that overlap with compute.
With a profile, measured compute replaces the arithmetic, and what the runtime's tensor, Ulysses and ZeRO-3
machinery was measured to add to a block replaces that dimension's analytic communication
(`measured_overheads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.cached_hash import cached_hash
from plait.cost import comm, experts, offload, recompute_modules
from plait.cost.calibration import Calibration
from plait.cost.comm import GroupShape
from plait.cost.compute import eager_attention_time, elementwise_time, flash_attention_time, gemm_time
from plait.cost.memory import model_state_bytes
from plait.cost.precision import PrecisionBytes
from plait.cost.profile_file import LayerProfile
from plait.plan import Strategy
from plait.spec.cluster import Cluster
from plait.spec.degrees import Degrees
from plait.spec.layers import FUSED_ATTENTION, Block
from plait.spec.model import ModelSpec


@dataclass(frozen=True)
class BlockTime:
    """Seconds for one block and one micro-batch on one device, by cause."""

    forward: float  # compute of the forward pass
    backward: float  # compute of the backward pass (without recompute)
    recompute: float  # compute repeated in backward by activation recomputation
    tp_comm: float  # tensor-parallel collectives, all passes (never overlapped)
    cp_comm: float  # exposed context-parallel communication, all passes
    zero_comm: float  # exposed ZeRO-2/3 parameter gathers and gradient reduce-scatters
    forward_comm: float  # the part of tp/cp/zero/ep communication that lies in the forward pass
    ep_comm: float = 0.0  # an MoE layer's token dispatch and combine (expert parallel), all passes
    host_comm: float = 0.0  # exposed host-link copies (swapped activations, offloaded gradients), all passes

    @property
    def forward_total(self) -> float:
        return self.forward + self.forward_comm

    @property
    def backward_total(self) -> float:
        return (self.backward + self.recompute + self.tp_comm + self.cp_comm + self.zero_comm + self.ep_comm
                + self.host_comm - self.forward_comm)

    @property
    def flops_time(self) -> float:
        return self.forward + self.backward + self.recompute


@cached_hash
@dataclass(frozen=True)
class BlockContext:
    """Everything besides the strategy that a block's cost depends on (hashable, for caching)."""

    model: ModelSpec
    cluster: Cluster
    cal: Calibration
    prec: PrecisionBytes
    seq_len: int
    seqs: int  # sequences per data-parallel replica per micro-batch
    tp_group: GroupShape
    cp_group: GroupShape
    dp_group: GroupShape  # ranks ZeRO shards this block's weights over (data and context parallel, every pipeline)
    replica_group: GroupShape = comm.SINGLE  # HSDP: ranks holding the same shard, which all-reduce its gradients
    ep_group: GroupShape = comm.SINGLE  # an MoE layer's expert-parallel group (exchanges tokens)
    etp_group: GroupShape = comm.SINGLE  # its expert tensor-parallel group
    edp_group: GroupShape = comm.SINGLE  # ranks that share its experts' weights (expert data parallel)
    expert_load: float = 1.0  # routed tokens of the busiest expert rank over the mean (plan.expert_load)
    dispatcher: str = "alltoall"  # how routed tokens travel (plan.dispatcher): "alltoall" or "deepep"
    routing: str = "random"  # which experts a token picks (plan.routing): "random" or "contiguous"
    ep_hidden: float = 0.0  # share of the token exchange hidden behind another micro-batch (plan.ep_overlap)
    pipeline_dp: int = 0  # several pipelines: the ranks of this pipeline's stage that shard the weights (0: one
    # pipeline); weights and gradients shard over these alone (`plait.runtime.replica_zero`)
    states_alike: bool = True  # several pipelines hold the layer in one shape: the optimizer state shards over
    # `dp_group` (every pipeline); else over `pipeline_dp` alone (whole gradients, whole optimizer state)

    @staticmethod
    def for_ranks(model: ModelSpec, cluster: Cluster, cal: Calibration, prec: PrecisionBytes, seq_len: int,
                  seqs: int, s: Strategy, ranks: tuple[int, ...], dp_ranks: tuple[int, ...],
                  expert_load: float = 1.0, dispatcher: str = "alltoall", routing: str = "random",
                  ep_hidden: float = 0.0) -> BlockContext:
        """The context of strategy `s` on a stage's `ranks` (Megatron order: tp fastest, then cp, then dp;
        experts: etp, ep, edp); `dp_ranks` are the ranks sharing its weights (under HSDP cut into shard and
        replicate groups)."""
        groups = _group_shapes(s.degrees, tuple(ranks), tuple(dp_ranks), cluster.gpus_per_node, model.has_experts)
        return BlockContext(model, cluster, cal, prec, seq_len, seqs, *groups, expert_load, dispatcher, routing,
                            ep_hidden)


@lru_cache(maxsize=65536)
def _group_shapes(d: Degrees, ranks: tuple[int, ...], dp_ranks: tuple[int, ...], gpn: int, has_experts: bool
                  ) -> tuple[GroupShape, ...]:
    """(tp, cp, shard, replica, ep, etp, edp) group shapes of a strategy of degrees `d` on a stage's `ranks` with
    data-parallel ranks `dp_ranks`, `gpn` GPUs a node (see BlockContext.for_ranks); the search asks for the same
    stage under many strategies of the same degrees, so they are computed once."""

    def shape(group: tuple[int, ...]) -> GroupShape:
        return GroupShape.of(group, gpn) if len(group) > 1 else comm.SINGLE

    tp_group = shape(d.group(ranks, "tp")) if d.tp > 1 else comm.SINGLE
    cp_group = shape(d.group(ranks, "cp")) if d.cp > 1 else comm.SINGLE
    shard_ranks, replica_ranks = d.split_data(dp_ranks)
    expert_groups = tuple(shape(d.expert_group(ranks, dim)) if has_experts else comm.SINGLE  # type: ignore[arg-type]
                          for dim in ("ep", "etp", "edp"))
    return (tp_group, cp_group, shape(shard_ranks), shape(replica_ranks), *expert_groups)


SUBLAYERS = {"decoder": 2, "moe": 2, "encoder": 2, "vision": 2, "cross_decoder": 3, "patch_embed": 1, "projector": 1}
"""Residual sublayers of each layer kind (attention, cross-attention, MLP), each closing with one
row-parallel GEMM whose output tensor parallelism reduces (patch embedding and projector: one output)."""


def _elementwise_bytes_per_token(block: Block, s: Strategy, eb: int) -> float:
    """Forward bytes moved per token by the layer's memory-bound kernels on one device."""
    h, subs = block.hidden, SUBLAYERS[block.kind]
    # Norms (read + write) and residual adds (read 2, write 1), each on the full hidden state.
    replicated = (block.norms * 2 * h + subs * 3 * h) * eb
    if block.dropout:
        replicated += subs * (2 * h * eb + h)  # dropout read+write and 1-byte mask after each sublayer
    width = block.ffn + (block.top_k * block.expert_ffn if block.kind == "moe" else 0)
    sharded = (3 if block.gated_mlp else 2) * width * eb  # SwiGLU reads gate and up, writes the product
    if block.rope:
        sharded += 2 * (block.q_dim + block.k_dim) * eb  # RoPE on q and k
    return replicated / (s.tp if s.sp else 1) + sharded / s.tp


def measured_block(block: Block, ctx: BlockContext) -> bool:
    """Whether `block` is the model's trunk decoder layer, which the profile also times under each parallel
    strategy as the runtime runs it (`measured_overheads`)."""
    return ctx.cal.measured is not None and block == ctx.model.block


def measured_layer(block: Block, s: Strategy, ctx: BlockContext, recompute: str = "none"
                   ) -> LayerProfile | None:
    """The profile's timing of `block`'s shard under `s` (its tensor-parallel width; an MoE layer's
    expert-parallel one, `measured_ep`), or None where the profile did not measure it. A layer is found by its
    shape: the trunk decoder layer, or any other the profiler measured (`Block.fingerprint`). LSH-MoE's
    compression is not measured: its layers are priced analytically."""
    measured = ctx.cal.measured
    if measured is None or (block.kind == "moe" and s.moe_comm == "lsh"):
        return None
    ep = measured_ep(s) if block.kind == "moe" else 1
    return measured.block(ctx.model.name, s.tp, recompute, ctx.model.shape_of(block), ep) if ep else None


def measured_ep(s: Strategy) -> int:
    """The profiled expert-parallel width whose MoE shard computes what a rank of `s` does (0: none). The
    profiler splits each expert as tp splits the attention (etp = tp); a rank of (tp, ep, etp) has E/ep experts
    of width F/etp, each taking T k ep etp / (tp E) rows of its tp group's T tokens, and the shard of
    ep' = ep etp / tp has the same rows per expert and the same FLOPs (E/ep' experts of width F/tp): the same
    work in GEMMs of another split, exact when etp = tp."""
    width, rest = divmod(s.ep * s.expert_tp, s.tp)
    return width if width >= 1 and not rest else 0


def _gemms_time(block: Block, s: Strategy, tokens: float, memory_tokens: float, ctx: BlockContext
                ) -> tuple[float, float]:
    """(forward, backward) seconds of the layer's GEMMs on one device: forward [rows, k] @ [k, n]; backward
    computes dgrad and wgrad of the same size. Routed experts are priced apart (`experts.experts_time`)."""
    gpu, cal, eb = ctx.cluster.gpu, ctx.cal, ctx.prec.activation
    peak = ctx.prec.peak_flops(gpu)
    fwd = bwd = 0.0
    for g in block.gemms:
        if g.rows == "routed":  # experts: cost/experts.py
            continue
        k, n = g.shard(s.tp)  # "none": replicated on every tensor-parallel rank
        rows = max(1, int(tokens if g.rows == "self" else memory_tokens))
        fwd += g.count * gemm_time(rows, n, k, gpu, cal, peak, eb)
        bwd += g.count * (gemm_time(rows, k, n, gpu, cal, peak, eb) + gemm_time(k, n, rows, gpu, cal, peak, eb))
    return fwd, bwd


def _attention_time(block: Block, s: Strategy, ctx: BlockContext) -> tuple[float, float]:
    """(forward, backward) seconds of the attention cores. Ulysses gives each device all tokens of
    heads/(tp*cp) heads; ring gives it a 1/cp slice of queries against all keys: the same work either way.
    A sliding window caps the keys each query sees; bidirectional layers do the whole score matrix."""
    if not block.has_attention:
        return 0.0, 0.0
    cal, gpu, eb = ctx.cal, ctx.cluster.gpu, ctx.prec.activation
    peak = ctx.prec.peak_flops(gpu)
    seq = block.seq(ctx.seq_len)
    heads = block.heads // s.tp
    if block.attention in FUSED_ATTENTION:
        keys = block.keys(ctx.seq_len)
        causal = block.causal and keys == seq
        f, b = flash_attention_time(ctx.seqs * heads, seq // s.cp, keys, block.head_dim, causal, cal, peak,
                                    block.attention)
        if block.kind == "cross_decoder":
            cf, cb = flash_attention_time(ctx.seqs * heads, seq // s.cp, block.memory_seq(ctx.seq_len),
                                          block.head_dim, False, cal, peak, block.attention)
            f, b = f + cf, b + cb
        return f, b
    passes = 2 if block.kind == "cross_decoder" else 1
    f, b = eager_attention_time(ctx.seqs * heads // s.cp, seq, block.head_dim, block.dropout, gpu, cal, peak, eb)
    return passes * f, passes * b


ATTENTION_MACHINERY = ("tp", "cp")
"""Dimensions whose runtime machinery (DTensor tensor parallelism, Ulysses) a measured MoE layer takes from the
trunk decoder layer's strategy timings: its attention runs the same; its experts exchange tokens over their own
groups (priced from the collectives), and ZeRO-3 gathers its own (larger) weights, priced analytically."""
REPEATS_FORWARD = ("full", "attn_kept", "gemm_kept")
"""Recompute modes that run the layer's forward again outside the attention core, so its tensor-parallel
collectives and expert dispatch come again in backward."""


def recompute_time(recompute: str, forward: float, attention: float, elementwise: float = 0.0,
                   ring: bool = False) -> float:
    """Seconds of forward compute repeated in backward by `recompute`, of a layer whose forward computes for
    `forward` seconds, `attention` of them in the attention cores and `elementwise` in its memory-bound
    kernels: none nothing, selective the cores (nothing under ring attention, `ring`: its own autograd
    function, left as it is), full the whole forward, attn_kept (MEMO) the forward less the cores (their
    outputs are kept), gemm_kept the cores and the elementwise kernels (the GEMM outputs are kept)."""
    return {"none": 0.0, "selective": 0.0 if ring else attention, "attn_kept": max(0.0, forward - attention),
            "gemm_kept": attention + elementwise, "full": forward}[recompute]


@dataclass(frozen=True)
class _Work:
    """Seconds of one micro-batch of a layer on one device that depend only on how its work is split (tp, sp,
    cp and its mode, ep, etp, moe_comm) and on the run, not on how its states are sharded (zero, shard),
    recomputed or offloaded: shared by every strategy of the same split. Analytic terms (a profile's
    timings replace some of them in `block_time`)."""

    tokens: int  # tokens this device holds outside attention
    gemm: tuple[float, float]  # (forward, backward) of the non-expert GEMMs
    experts: tuple[float, float]  # of the routed experts
    attention: tuple[float, float]  # of the attention cores
    elementwise: float  # forward memory-bound kernels (backward: twice)
    tp: float  # one pass's tensor-parallel collectives
    cp: tuple[float, float]  # exposed context-parallel communication
    ep: float  # one pass's expert dispatch and combine


_SPLIT_ONLY = {"zero": 0, "recompute": "none", "recompute_modules": (), "shard": 0, "swap": 0.0, "offload": "none"}


@lru_cache(maxsize=4096)
def _split_of(s: Strategy) -> Strategy:
    """`s` with what does not change a layer's work (`_Work`) at its defaults: one cache key per split."""
    return s if all(getattr(s, k) == v for k, v in _SPLIT_ONLY.items()) else s.model_copy(update=_SPLIT_ONLY)


@lru_cache(maxsize=16384)
def _work(block: Block, s: Strategy, ctx: BlockContext) -> _Work:
    """`_Work` of `block` under split `s` (`_split_of`) in the run `ctx`."""
    cal, eb = ctx.cal, ctx.prec.activation
    seq = block.seq(ctx.seq_len)
    tokens = ctx.seqs * seq // s.cp
    gemm = _gemms_time(block, s, tokens, ctx.seqs * block.memory_seq(ctx.seq_len) // s.cp, ctx)
    attn_f, attn_b = _attention_time(block, s, ctx)
    elem_f = elementwise_time(tokens * _elementwise_bytes_per_token(block, s, eb), ctx.cluster.gpu, cal, kernels=8)
    # Tensor parallelism: per pass one all-reduce per sublayer (or, with sp, an all-gather and a
    # reduce-scatter of the same total traffic) of the full hidden state of the device's tokens.
    # An MoE layer's routed experts exchange tokens over their own groups instead (`experts.dispatch_time`).
    act_bytes = tokens * block.tp_comm_elements_per_token * eb
    sublayers = SUBLAYERS[block.kind] - (1 if block.kind == "moe" and not block.ffn else 0)
    tp = sublayers * comm.all_reduce(act_bytes, ctx.tp_group, ctx.cluster, cal)
    cp_fwd = cp_bwd = 0.0
    if s.cp > 1 and block.has_attention:
        if s.cp_mode == "ulysses":
            cp_fwd = cp_bwd = comm.all_to_all(tokens * block.ulysses_elements_per_token // s.tp * eb, ctx.cp_group,
                                              ctx.cluster, cal)
        else:  # ring: cp-1 K/V block passes hidden behind the block attention they feed
            kv = ctx.seqs * (seq // s.cp) * block.ring_kv_elements_per_token // s.tp * eb
            step = comm.p2p(kv, ctx.cp_group.nodes > 1, ctx.cluster, cal)
            cp_fwd = max(0.0, (s.cp - 1) * step - attn_f * cal.overlap_efficiency)
            cp_bwd = max(0.0, 2 * (s.cp - 1) * step - attn_b * cal.overlap_efficiency)
    return _Work(tokens=tokens, gemm=gemm, experts=experts.routed_time(block, s, tokens, ctx),
                 attention=(attn_f, attn_b), elementwise=elem_f, tp=tp, cp=(cp_fwd, cp_bwd),
                 ep=experts.dispatch_time(block, s, tokens, ctx))


@lru_cache(maxsize=16384)
def block_time(block: Block, s: Strategy, ctx: BlockContext) -> BlockTime:
    """Time of `block` for one micro-batch of `ctx.seqs` sequences on one device of strategy `s`."""
    cal = ctx.cal
    seq = block.seq(ctx.seq_len)
    work = _work(block, _split_of(s), ctx)
    tokens = work.tokens
    (fwd_gemm, bwd_gemm), (expert_f, expert_b), (attn_f, attn_b) = work.gemm, work.experts, work.attention
    elem_f = work.elementwise
    forward = fwd_gemm + expert_f + attn_f + elem_f
    backward = bwd_gemm + expert_b + attn_b + 2 * elem_f
    m = ctx.model
    if (timed := measured_layer(block, s, ctx)) is not None:
        # one rank's share, attention included; an MoE layer's routed tokens as balanced as the profiler's
        # router spread them, the busiest rank's extra load (`expert_load`) priced on top
        extra_f, extra_b = experts.extra_load_time(block, s, tokens, ctx)
        measured = cal.measured
        assert measured is not None
        forward = measured.seconds(timed.forward, tokens, seq, m.name) + extra_f
        backward = measured.seconds(timed.backward, tokens, seq, m.name) + extra_b
    recompute = recompute_time(s.recompute, forward, attn_f, elem_f, ring=s.ring)
    if s.recompute != "none" and (with_rc := measured_layer(block, s, ctx, s.recompute)) is not None:
        measured_rc = cal.measured.seconds(with_rc.backward, tokens, seq, m.name)  # type: ignore[union-attr]
        recompute = max(0.0, measured_rc - (backward - extra_b))
    recompute += recompute_modules.modules_time(block, s, tokens, ctx)

    tp_fwd = tp_bwd = work.tp
    runtime: dict[str, tuple[float, float]] = {}
    if measured_block(block, ctx):
        runtime = measured_overheads(s, ctx)
    elif timed is not None and block.kind == "moe":  # its attention's machinery, as timed on the trunk layer
        runtime = {dim: t for dim, t in measured_overheads(s, ctx).items() if dim in ATTENTION_MACHINERY}
    if "tp" in runtime:
        tp_fwd, tp_bwd = runtime["tp"]

    # Context parallelism.
    cp_fwd, cp_bwd = work.cp
    if s.cp > 1 and block.has_attention and "cp" in runtime:
        cp_fwd, cp_bwd = runtime["cp"]
    # attn_kept re-runs the Ulysses all-to-alls around the kept core (queries, keys and values for its
    # backward; its output for the recomputed projection), not the ring's K/V passes, which feed the core;
    # gemm_kept re-runs the Ulysses all-to-alls with the core (it does not run with ring attention).
    repeats_cp = s.recompute == "full" or \
        (s.recompute in ("attn_kept", "gemm_kept") and s.cp_mode == "ulysses")
    cp_recompute = cp_fwd if repeats_cp else 0.0

    # Expert parallelism: dispatch and combine, nothing overlapped (as the runtime ran them where the profile
    # timed them) unless the plan overlaps them with another micro-batch (`ctx.ep_hidden`); repeated by full
    # recompute.
    ep_fwd = ep_bwd = work.ep
    if timed is not None and (ep_timed := measured_dispatch(block, s, ctx)) is not None:
        ep_fwd, ep_bwd = ep_timed
    ep_fwd, ep_bwd = ep_fwd * (1 - ctx.ep_hidden), ep_bwd * (1 - ctx.ep_hidden)
    ep_recompute = ep_fwd if s.recompute in REPEATS_FORWARD else 0.0

    # ZeRO-3 gathers parameters before forward and backward and reduce-scatters gradients each micro-batch;
    # ZeRO-2 reduce-scatters gradients each micro-batch. Prefetching hides them behind the block's compute.
    # An MoE layer's routed experts sync over the expert data-parallel group.
    zero_fwd = zero_bwd = 0.0
    if "zero3" in runtime:
        zero_fwd, zero_bwd = runtime["zero3"]
    elif s.zero >= 2:
        for held, group in experts.held_params(block, s, ctx):
            if group.size > 1 and held > 0:
                window = experts.expert_sync_window(block, s, ctx, group, ep_fwd)
                f, b = zero_sync_time(held, s.zero, forward + window, backward + recompute + (
                    2 if s.recompute in REPEATS_FORWARD else 1) * window, ctx, group)
                zero_fwd, zero_bwd = zero_fwd + f, zero_bwd + b

    tp_recompute = tp_fwd if s.recompute in REPEATS_FORWARD else 0.0
    host_fwd, host_bwd = _host_link_time(block, s, ctx, forward, backward + recompute)
    return BlockTime(
        forward=forward, backward=backward, recompute=recompute,
        tp_comm=tp_fwd + tp_bwd + tp_recompute, cp_comm=cp_fwd + cp_bwd + cp_recompute,
        zero_comm=zero_fwd + zero_bwd, forward_comm=tp_fwd + cp_fwd + zero_fwd + ep_fwd + host_fwd,
        ep_comm=ep_fwd + ep_bwd + ep_recompute, host_comm=host_fwd + host_bwd,
    )


def _host_link_time(block: Block, s: Strategy, ctx: BlockContext, forward: float, backward: float
                    ) -> tuple[float, float]:
    """(forward, backward) seconds of `block`'s exposed host-link copies under `s` (cost/offload.py)."""
    if s.swap == 0 and s.offload == "none":
        return 0.0, 0.0
    states = [model_state_bytes(held, group.size, s.zero, ctx.prec, offload=True)
              for held, group in experts.held_params(block, s, ctx)]
    grads = sum(model_state_bytes(held, group.size, s.zero, ctx.prec)[1]
                for held, group in experts.held_params(block, s, ctx))
    swapped = offload.swapped_activation(block_activation_bytes(block, s, ctx), s)
    return offload.link_time(swapped, grads, forward, backward, s, ctx.cluster, ctx.prec,
                             paged=sum(w for w, _, _ in states))


def zero_sync_time(params: float, zero: int, forward: float, backward: float, ctx: BlockContext,
                   group: GroupShape | None = None) -> tuple[float, float]:
    """(forward, backward) seconds that ZeRO-2/3's per-micro-batch collectives of `params` parameters add to
    a layer whose passes compute for `forward` and `backward` seconds: ZeRO-3 gathers the weights before
    each pass, both reduce-scatter the gradients after backward. Prefetching runs each collective beside the
    compute of a neighbouring layer of the same size (comm.overlapped, with its contention), and each
    collective costs the runtime's fixed per-collective overhead. Over `group` (default: the data group);
    under HSDP the reduce-scatter runs in the shard group (`ctx.dp_group`) and the gradient shard is then
    all-reduced over the replicas."""
    cal, group = ctx.cal, group or ctx.dp_group
    rs = comm.reduce_scatter(params * ctx.prec.reduce_bytes, group, ctx.cluster, cal)
    if group == ctx.dp_group:
        rs += hsdp_all_reduce(params, ctx)
    gather = comm.all_gather(params * ctx.prec.param, group, ctx.cluster, cal) if zero == 3 else 0.0
    fixed = cal.fsdp_collective_overhead_s
    fwd = comm.overlapped(gather, forward, cal.overlap_contention) + (fixed if zero == 3 else 0.0)
    bwd = comm.overlapped(gather + rs, backward, cal.overlap_contention) + fixed * (2 if zero == 3 else 1)
    return fwd, bwd


def hsdp_all_reduce(params: float, ctx: BlockContext) -> float:
    """Seconds to all-reduce the gradient shard of `params` parameters (1/shard of them) over the HSDP
    replicas, as FSDP's HYBRID_SHARD does after each reduce-scatter (0 without replicas)."""
    if ctx.replica_group.size <= 1:
        return 0.0
    shard = params / max(ctx.dp_group.size, 1)
    return comm.all_reduce(shard * ctx.prec.reduce_bytes, ctx.replica_group, ctx.cluster, ctx.cal)


def runtime_kinds(s: Strategy, dp_size: int) -> list[tuple[str, str, int]]:
    """(dimension, profiled strategy kind, group size) of each parallel dimension of `s` whose runtime
    machinery a profile times: tensor ("tp": kind tp or tp_sp), Ulysses ("cp") and ZeRO-3 ("zero3") over
    the `dp_size` ranks that share the weights."""
    out = []
    if s.tp > 1:
        out.append(("tp", "tp_sp" if s.sp else "tp", s.tp))
    if s.cp > 1 and s.cp_mode == "ulysses":
        out.append(("cp", "cp", s.cp))
    if s.zero == 3 and dp_size > 1:
        out.append(("zero3", "zero3", dp_size))
    return out


def measured_dispatch(block: Block, s: Strategy, ctx: BlockContext) -> tuple[float, float] | None:
    """(forward, backward) seconds the runtime's expert parallelism adds to MoE layer `block` under `s`
    (count exchange, token all-to-alls, reordering, waiting for the ep group's slowest rank) where the profile
    timed it: "ep" over s.ep ranks of one node for this layer, without tensor or expert tensor parallelism or
    LSH-MoE; the timed wall time less the measured compute of the layer's ep shard. None elsewhere: the
    exchange is then priced from the collectives (`experts.dispatch_time`)."""
    measured, m = ctx.cal.measured, ctx.model
    if (measured is None or block.kind != "moe" or s.ep < 2 or s.tp > 1 or s.expert_tp > 1
            or s.moe_comm == "lsh" or ctx.ep_group.nodes > 1):
        return None
    found = measured.strategy_profile(m.name, "ep", s.ep)
    local = measured.block(m.name, 1, "none", m.shape_of(block), s.ep)
    if found is None or found[0].shape != m.shape_of(block) or local is None:
        return None
    tokens = ctx.seqs * ctx.seq_len / s.cp
    timed = measured.strategy(m.name, "ep", s.ep, tokens, ctx.seq_len)
    assert timed is not None
    compute = [measured.seconds(c, tokens, ctx.seq_len, m.name) for c in (local.forward, local.backward)]
    return max(0.0, timed[0] - compute[0]), max(0.0, timed[1] - compute[1])


def measured_overheads(s: Strategy, ctx: BlockContext, part: str = "block") -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds that the runtime's tensor ("tp"), Ulysses ("cp") and ZeRO-3 ("zero3")
    machinery adds to a block (or to the "embedding" or "head"), where the profile timed it under that
    strategy: the measured wall time less the measured compute of the same shard (communication,
    DTensor/FSDP overhead and contention for the cores, as they were). Missing where not timed."""
    measured = ctx.cal.measured
    if measured is None:
        return {}
    m, seq_len = ctx.model, ctx.seq_len
    tokens = ctx.seqs * seq_len / s.cp  # this device's tokens outside attention
    out = {}
    for dim, kind, group in runtime_kinds(s, ctx.dp_group.size):
        shard_tp = s.tp if dim == "tp" else 1
        lookup = ctx.seqs * seq_len if dim == "cp" else tokens  # a cp timing is keyed by the whole sequences
        timed = measured.strategy(m.name, kind, group, lookup, seq_len, part)
        local = measured.block(m.name, shard_tp) if part == "block" else measured.edge(m.name, part, shard_tp)
        if timed is None or local is None:
            continue
        compute = [measured.seconds(c, tokens, seq_len, m.name) for c in (local.forward, local.backward)]
        out[dim] = (max(0.0, timed[0] - compute[0]), max(0.0, timed[1] - compute[1]))
    return out


def block_activation_bytes(block: Block, s: Strategy, ctx: BlockContext, recompute: str | None = None) -> float:
    """Bytes `block` keeps for backward for one micro-batch on one device (Korthikanti's terms), less what the
    plan's recompute modules drop under the strategy's own recompute (`recompute` None)."""
    tokens = ctx.seqs * block.seq(ctx.seq_len) / s.cp
    dropped = recompute_modules.dropped_bytes(block, s, tokens, ctx) if recompute is None else 0.0
    return _kept_activation_bytes(block, s, ctx, recompute, tokens) - dropped


def _kept_activation_bytes(block: Block, s: Strategy, ctx: BlockContext, recompute: str | None, tokens: float
                           ) -> float:
    """Bytes `block` keeps for backward under `recompute` (the strategy's when None): measured, or analytic."""
    eb = ctx.prec.activation
    measured = measured_layer(block, s, ctx, recompute or s.recompute)
    if measured is not None and not s.sp:  # in the profile's dtype: scaled to the plan's (masks aside)
        per_element = eb / ctx.cal.measured.element_bytes  # type: ignore[union-attr]
        return (tokens * measured.activation_bytes_per_token * per_element
                + experts.extra_load_activation_bytes(block, s, tokens, ctx, recompute or s.recompute))
    on_gpu = ctx.cal.memory.block_activation(block.kind, s.tp, recompute or s.recompute, eb) \
        if ctx.cal.memory is not None and not s.sp and block.kind != "moe" else None
    if on_gpu is not None:  # Galvatron's memory profile (cost/measured_memory.py)
        return tokens * on_gpu
    a = block.activation_bytes(recompute or s.recompute, ring=s.ring)  # type: ignore[arg-type]
    replicated_div = s.tp if s.sp else 1
    scale = eb / 2  # the formulas count 16-bit activations
    per_token = ((a.replicated * scale + a.replicated_masks) / replicated_div
                 + (a.sharded * scale + a.sharded_fp32) / s.tp + a.whole * scale
                 + (a.quadratic_per_seq_token * scale + a.sharded_quadratic_masks) * block.keys(ctx.seq_len) / s.tp)
    return tokens * per_token + experts.routed_activation_bytes(block, s, tokens, ctx, recompute or s.recompute)
