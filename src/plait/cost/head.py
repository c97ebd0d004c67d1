"""Time and memory of the embedding (first stage) and the LM head with its loss (last stage).

Both are vocabulary-parallel over the tensor-parallel group (Megatron's VocabParallelEmbedding and
parallel cross-entropy). A model's multi-token-prediction modules (`Block.mtp`, the last layers of its stack,
so on the last stage) each look the next tokens up in the embedding table and run their own pass through the
shared head and loss there: the last stage pays 1 + `mtp_layers` head passes and `mtp_layers` lookups, keeps
every pass's logits for backward, and holds a copy of the embedding table when the embedding is on another
stage. Seconds and bytes for one micro-batch on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cost import comm
from plait.cost.compute import elementwise_time, gemm_time
from plait.cost.layer import BlockContext, measured_overheads
from plait.plan import Strategy

LOGIT_BYTES = 4
"""Bytes per logit: the loss is computed on fp32 logits (Megatron casts before cross-entropy)."""
LOSS_PASSES = 4
"""Full passes over the fp32 logits by the cross-entropy forward and backward (max, exp-sum, softmax-grad
write, cast); each pass reads or writes every logit once."""


@dataclass(frozen=True)
class EdgeTime:
    """Seconds of the embedding or head for one micro-batch on one device."""

    forward: float
    backward: float
    tp_comm: float  # all passes


def head_time(s: Strategy, ctx: BlockContext) -> EdgeTime:
    """Final norm, vocabulary-parallel LM projection and cross-entropy, once for the trunk and once for each
    multi-token-prediction module (with its embedding lookup)."""
    one = _head_pass_time(s, ctx)
    n = ctx.model.mtp_layers
    if not n:
        return one
    lookup = _lookup_time(s, ctx)
    return EdgeTime(forward=(1 + n) * one.forward + n * lookup, backward=(1 + n) * one.backward + 2 * n * lookup,
                    tp_comm=(1 + n) * one.tp_comm + n * _lookup_comm(s, ctx))


def _head_pass_time(s: Strategy, ctx: BlockContext) -> EdgeTime:
    """One pass through the final norm, the LM projection and the cross-entropy."""
    m, gpu, cal, eb = ctx.model, ctx.cluster.gpu, ctx.cal, ctx.prec.activation
    peak = ctx.prec.peak_flops(gpu)
    tokens = ctx.seqs * ctx.seq_len // s.cp
    v = m.vocab // s.tp
    fwd = gemm_time(tokens, v, m.hidden, gpu, cal, peak, eb)
    bwd = gemm_time(tokens, m.hidden, v, gpu, cal, peak, eb) + gemm_time(m.hidden, v, tokens, gpu, cal, peak, eb)
    logits = tokens * v * LOGIT_BYTES
    loss = elementwise_time(LOSS_PASSES * logits, gpu, cal, kernels=4)
    norm = elementwise_time(2 * tokens * m.hidden * eb / (s.tp if s.sp else 1), gpu, cal)
    if cal.measured is not None and (measured := cal.measured.edge(m.name, "head", s.tp)) is not None:
        fwd, bwd = (cal.measured.seconds(c, tokens, ctx.seq_len, m.name)
                    for c in (measured.forward, measured.backward))
        loss = norm = 0.0
    # Gathering the hidden state (sp) and reducing input gradients, plus the loss's max/sum all-reduces.
    tp = 2 * comm.all_reduce(tokens * m.hidden * eb, ctx.tp_group, ctx.cluster, cal)
    tp += 2 * comm.all_reduce(tokens * 4, ctx.tp_group, ctx.cluster, cal)
    return _with_runtime(EdgeTime(forward=fwd + loss / 2 + norm, backward=bwd + loss / 2 + 2 * norm, tp_comm=tp),
                         s, ctx, "head")


def _with_runtime(t: EdgeTime, s: Strategy, ctx: BlockContext, part: str) -> EdgeTime:
    """`t` with what the profile measured the runtime's parallel machinery to add to this edge: the tensor-
    parallel part replaces the analytic collectives, the rest (ZeRO-3 gathers, context-parallel slicing)
    is added to forward and backward."""
    runtime = measured_overheads(s, ctx, part)
    if not runtime:
        return t
    tp = sum(runtime.pop("tp")) if "tp" in runtime else t.tp_comm
    return EdgeTime(forward=t.forward + sum(f for f, _ in runtime.values()),
                    backward=t.backward + sum(b for _, b in runtime.values()), tp_comm=tp)


def _lookup_time(s: Strategy, ctx: BlockContext) -> float:
    """Seconds of one vocabulary-parallel embedding lookup (memory-bound: read the rows, write the output)."""
    m = ctx.model
    tokens = ctx.seqs * ctx.seq_len // s.cp
    return elementwise_time(2 * tokens * m.hidden * ctx.prec.activation, ctx.cluster.gpu, ctx.cal, kernels=2)


def _lookup_comm(s: Strategy, ctx: BlockContext) -> float:
    """Seconds of the all-reduce over the tp group that completes a vocabulary-parallel lookup."""
    tokens = ctx.seqs * ctx.seq_len // s.cp
    return comm.all_reduce(tokens * ctx.model.hidden * ctx.prec.activation, ctx.tp_group, ctx.cluster, ctx.cal)


def embedding_time(s: Strategy, ctx: BlockContext) -> EdgeTime:
    """Vocabulary-parallel embedding lookup (memory-bound) and its all-reduce across the tp group."""
    m, cal = ctx.model, ctx.cal
    tokens = ctx.seqs * ctx.seq_len // s.cp
    lookup = _lookup_time(s, ctx)
    tp = _lookup_comm(s, ctx)
    if cal.measured is not None and (measured := cal.measured.edge(m.name, "embedding", s.tp)) is not None:
        return _with_runtime(EdgeTime(forward=cal.measured.seconds(measured.forward, tokens, ctx.seq_len, m.name),
                                      backward=cal.measured.seconds(measured.backward, tokens, ctx.seq_len, m.name),
                                      tp_comm=tp), s, ctx, "embedding")
    return EdgeTime(forward=lookup, backward=2 * lookup, tp_comm=tp)


def head_activation_bytes(s: Strategy, ctx: BlockContext) -> float:
    """Peak transient bytes of the loss for one micro-batch: fp32 logits and their gradient, of every head pass
    (a multi-token-prediction module's loss keeps its own until backward)."""
    tokens = ctx.seqs * ctx.seq_len / s.cp
    return (1 + ctx.model.mtp_layers) * 2 * tokens * (ctx.model.vocab / s.tp) * LOGIT_BYTES
