"""Time and activation memory of one transformer block for one micro-batch on one device.

Each term has a name. Compute: the block's GEMMs (column/row split by tensor parallelism, tokens split by
data and context parallelism), the attention core (flash or eager), and memory-bound elementwise work
(norms, residual adds, dropout, activation functions, RoPE), whose replicated part is divided by the
tensor-parallel degree only under sequence parallelism. Communication: Megatron tensor-parallel
collectives (2 forward, 2 backward; repeated by full recompute), Ulysses all-to-alls or ring K/V passes for
context parallelism, and ZeRO-2/3 per-micro-batch gathers and reduce-scatters that overlap with compute.
With a profile, measured compute replaces the arithmetic, and what the runtime's tensor, Ulysses and ZeRO-3
machinery was measured to add to a block replaces that dimension's analytic communication
(`measured_overheads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.cost import comm
from plait.cost.calibration import Calibration
from plait.cost.comm import GroupShape
from plait.cost.compute import eager_attention_time, elementwise_time, flash_attention_time, gemm_time
from plait.cost.precision import PrecisionBytes
from plait.plan import Strategy
from plait.spec.cluster import Cluster
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
    forward_comm: float  # the part of tp/cp/zero communication that lies in the forward pass

    @property
    def forward_total(self) -> float:
        return self.forward + self.forward_comm

    @property
    def backward_total(self) -> float:
        return self.backward + self.recompute + self.tp_comm + self.cp_comm + self.zero_comm - self.forward_comm

    @property
    def flops_time(self) -> float:
        return self.forward + self.backward + self.recompute


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
    dp_group: GroupShape  # ranks that share this block's weights (data and context parallel), every pipeline

    @staticmethod
    def for_ranks(model: ModelSpec, cluster: Cluster, cal: Calibration, prec: PrecisionBytes, seq_len: int,
                  seqs: int, s: Strategy, ranks: tuple[int, ...], dp_ranks: tuple[int, ...]) -> BlockContext:
        """The context of strategy `s` on a stage's `ranks` (Megatron order: tp fastest, then cp, then dp);
        `dp_ranks` are the ranks sharing its weights."""
        gpn = cluster.gpus_per_node
        tp_group = GroupShape.of(ranks[: s.tp], gpn) if s.tp > 1 else comm.SINGLE
        cp_group = GroupShape.of(ranks[: s.tp * s.cp: s.tp], gpn) if s.cp > 1 else comm.SINGLE
        dp_group = GroupShape.of(dp_ranks, gpn) if len(dp_ranks) > 1 else comm.SINGLE
        return BlockContext(model, cluster, cal, prec, seq_len, seqs, tp_group, cp_group, dp_group)


def _elementwise_bytes_per_token(model: ModelSpec, s: Strategy, eb: int) -> float:
    """Forward bytes moved per token by the block's memory-bound kernels on one device."""
    h = model.hidden
    # Two norms (read + write), two residual adds (read 2, write 1), each on the full hidden state.
    replicated = (2 * 2 * h + 2 * 3 * h) * eb
    if model.dropout:
        replicated += 2 * (2 * h * eb + h)  # dropout read+write and 1-byte mask, after attention and MLP
    if model.gated_mlp:
        sharded = 3 * model.ffn * eb  # SwiGLU reads gate and up, writes the product
    else:
        sharded = 2 * model.ffn * eb  # GeLU reads and writes
    if not model.learned_positions:
        sharded += 2 * (model.q_dim + model.kv_dim) * eb  # RoPE on q and k
    return replicated / (s.tp if s.sp else 1) + sharded / s.tp


@lru_cache(maxsize=16384)
def block_time(s: Strategy, ctx: BlockContext) -> BlockTime:
    """Time of one block for one micro-batch of `ctx.seqs` sequences on one device of strategy `s`."""
    m, gpu, cal, eb = ctx.model, ctx.cluster.gpu, ctx.cal, ctx.prec.activation
    peak = ctx.prec.peak_flops(gpu)
    tokens = ctx.seqs * ctx.seq_len // s.cp  # tokens this device holds outside attention

    # GEMMs: forward [tokens, k] @ [k, n]; backward computes dgrad and wgrad of the same size.
    fwd_gemm = bwd_gemm = 0.0
    for g in m.gemms:
        k, n = (g.k, g.n // s.tp) if g.split == "col" else (g.k // s.tp, g.n)
        fwd_gemm += gemm_time(tokens, n, k, gpu, cal, peak, eb)
        bwd_gemm += gemm_time(tokens, k, n, gpu, cal, peak, eb) + gemm_time(k, n, tokens, gpu, cal, peak, eb)

    # Attention core: Ulysses gives each device all tokens of heads/(tp*cp) heads; ring gives it a 1/cp
    # slice of queries against all keys: the same work either way.
    heads = m.heads // s.tp
    if m.attention == "flash":
        attn_f, attn_b = flash_attention_time(ctx.seqs * heads, ctx.seq_len // s.cp, ctx.seq_len, m.head_dim,
                                              True, cal, peak)
    else:
        attn_f, attn_b = eager_attention_time(ctx.seqs * heads // s.cp, ctx.seq_len, m.head_dim, m.dropout,
                                              gpu, cal, peak, eb)

    elem_f = elementwise_time(tokens * _elementwise_bytes_per_token(m, s, eb), gpu, cal, kernels=8)
    forward = fwd_gemm + attn_f + elem_f
    backward = bwd_gemm + attn_b + 2 * elem_f
    if cal.measured is not None and (measured := cal.measured.block(m.name, s.tp)) is not None:
        # one rank's share, attention included
        forward = cal.measured.seconds(measured.forward, tokens, ctx.seq_len, m.name)
        backward = cal.measured.seconds(measured.backward, tokens, ctx.seq_len, m.name)
    recompute = {"none": 0.0, "selective": attn_f, "full": forward}[s.recompute]
    if s.recompute != "none" and cal.measured is not None and \
            (with_rc := cal.measured.block(m.name, s.tp, s.recompute)) is not None:
        recompute = max(0.0, cal.measured.seconds(with_rc.backward, tokens, ctx.seq_len, m.name) - backward)

    # Tensor parallelism: per pass two all-reduces (or, with sp, an all-gather and a reduce-scatter of the
    # same total traffic) of the full hidden state of the device's tokens.
    act_bytes = tokens * m.tp_comm_elements_per_token * eb
    tp_fwd = tp_bwd = 2 * comm.all_reduce(act_bytes, ctx.tp_group, ctx.cluster, cal)
    runtime = measured_overheads(s, ctx)
    if "tp" in runtime:
        tp_fwd, tp_bwd = runtime["tp"]

    # Context parallelism.
    cp_fwd = cp_bwd = 0.0
    if s.cp > 1:
        if "cp" in runtime:
            cp_fwd, cp_bwd = runtime["cp"]
        elif s.cp_mode == "ulysses":
            a2a = comm.all_to_all(tokens * m.ulysses_elements_per_token // s.tp * eb, ctx.cp_group, ctx.cluster, cal)
            cp_fwd, cp_bwd = a2a, a2a
        else:  # ring: cp-1 K/V block passes hidden behind the block attention they feed
            kv = ctx.seqs * (ctx.seq_len // s.cp) * m.ring_kv_elements_per_token // s.tp * eb
            cross = ctx.cp_group.nodes > 1
            step = comm.p2p(kv, cross, ctx.cluster, cal)
            cp_fwd = max(0.0, (s.cp - 1) * step - attn_f * cal.overlap_efficiency)
            cp_bwd = max(0.0, 2 * (s.cp - 1) * step - attn_b * cal.overlap_efficiency)
    cp_recompute = cp_fwd if s.recompute == "full" else 0.0

    # ZeRO-3 gathers parameters before forward and backward and reduce-scatters gradients each micro-batch;
    # ZeRO-2 reduce-scatters gradients each micro-batch. Prefetching hides them behind the block's compute.
    zero_fwd = zero_bwd = 0.0
    params = m.block_params // s.tp
    if "zero3" in runtime:
        zero_fwd, zero_bwd = runtime["zero3"]
    elif ctx.dp_group.size > 1 and s.zero >= 2:
        rs = comm.reduce_scatter(params * ctx.prec.grad, ctx.dp_group, ctx.cluster, cal)
        gather = comm.all_gather(params * ctx.prec.param, ctx.dp_group, ctx.cluster, cal) if s.zero == 3 else 0.0
        zero_fwd = max(0.0, gather - forward * cal.overlap_efficiency)
        zero_bwd = max(0.0, gather + rs - (backward + recompute) * cal.overlap_efficiency)

    tp_recompute = tp_fwd if s.recompute == "full" else 0.0
    return BlockTime(
        forward=forward, backward=backward, recompute=recompute,
        tp_comm=tp_fwd + tp_bwd + tp_recompute, cp_comm=cp_fwd + cp_bwd + cp_recompute,
        zero_comm=zero_fwd + zero_bwd, forward_comm=tp_fwd + cp_fwd + zero_fwd,
    )


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


MEASURED_ACTIVATION_BYTES = 4
"""Bytes per element of the activations a profile counts (`plait profile` measures fp32 blocks)."""


def block_activation_bytes(s: Strategy, ctx: BlockContext, recompute: str | None = None) -> float:
    """Bytes one block keeps for backward for one micro-batch on one device (Korthikanti's terms)."""
    m, eb = ctx.model, ctx.prec.activation
    tokens = ctx.seqs * ctx.seq_len / s.cp
    measured = ctx.cal.measured.block(m.name, s.tp, recompute or s.recompute) if ctx.cal.measured else None
    if measured is not None and not s.sp:  # measured in fp32: 16-bit keeps half (masks aside)
        return tokens * measured.activation_bytes_per_token * eb / MEASURED_ACTIVATION_BYTES
    a = m.activation_bytes(recompute or s.recompute)  # type: ignore[arg-type]
    replicated_div = s.tp if s.sp else 1
    scale = eb / 2  # the formulas count 16-bit activations
    per_token = ((a.replicated * scale + a.replicated_masks) / replicated_div
                 + a.sharded * scale / s.tp
                 + (a.quadratic_per_seq_token * scale + a.sharded_quadratic_masks) * ctx.seq_len / s.tp)
    return tokens * per_token
