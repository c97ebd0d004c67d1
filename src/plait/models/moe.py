"""Mixture-of-experts feed-forward of a `moe` layer (`plait.spec.layers.Block`): a top-k router,
dropless routing to SwiGLU experts (GPT-OSS's: with biases and its clamped SwiGLU), and optional shared
experts that every token goes through.

Shapes: B sequences, T tokens per sequence (this rank's part of them), H hidden, E routed experts, F one
expert's width, k experts per token, N = B*T tokens, A = N*k (token, expert) assignments.

Routing (`Block.gating`): scores p = softmax(router(x)) in fp32 (sigmoid for DeepSeek-V3; the router has a
bias for GPT-OSS, whose softmax over the top k logits is this softmax renormalised over them); each token goes
to the k experts of highest score (plus a per-expert bias, `choice_bias`, for the choice only: DeepSeek-V3's
e_score_correction_bias, a buffer the runtime moves towards balance after each step) with weights p
renormalised over those k (Mixtral, Qwen3-MoE, DeepSeek-V3) or as they are (Qwen2-MoE, DeepSeek-V2), times
`scale` (DeepSeek's routed_scaling_factor). No token is dropped. With router groups (`Block.expert_groups`,
`group_top_k`) the experts fall in G equal groups of consecutive experts, each scored by its best expert
(DeepSeek-V2) or its best two (DeepSeek-V3), and a token's k experts come from its `group_top_k` best groups
only. Qwen2-MoE gates its shared experts' output by sigmoid(x w_g).

Load balancing: the Switch/GShard auxiliary loss per sequence s, E/k * sum_i f_si * P_si, with f_si = the
share of s's assignments that went to expert i (times k: 1 when balanced) and P_si = the mean router
probability of expert i over s's tokens (sigmoid scores normalised to sum to 1 per token, as Megatron-LM's);
averaged over the sequences of the batch. Its value does not depend on how the batch is cut into
micro-batches or ranks. In packed rows of documents (`documents`, the variable-length runtime) every document
is a sequence: f and P are taken over its own tokens, padding counts in none. Its gradient enters the
backward at the block (as Megatron's MoEAuxLossAutoScaler does), so pipeline stages need not carry it to the
head; the reported loss stays the language-model loss.

LSH-MoE (`plait.runtime.lsh`) plugs in as `compressor`: the pairs bound for each expert become bucket
centroids before the exchange, and each pair takes its centroid's output after it.

Expert parallelism (`plait.runtime.experts`) plugs in as `exchange`: it sends each assignment to the rank
holding its expert and returns the outputs; `sequence_group` sums the per-sequence expert counts over the
ranks that split each sequence (sequence or context parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.dropped import Dropped
from plait.models.llama import FeedForward, summed_in_backward, swiglu
from plait.models.recomputed import recomputed
from plait.spec.layers import Block

AUX_LOSS_COEF = 0.01
"""Weight of the load-balancing loss beside the language-model loss (Switch Transformer's alpha)."""
BIAS_UPDATE_RATE = 1e-3
"""Step of the choice bias's update after each training step (DeepSeek-V3's gamma; Megatron-LM's
moe_router_bias_update_rate), `plait.runtime.experts.update_choice_biases`."""


class Exchange(Protocol):
    """Moves assignments sorted by expert to the ranks holding their experts and the outputs back."""

    def scatter(self, tokens: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, object]:
        """tokens [A, H] sorted by expert, counts [E] -> (this rank's experts' tokens [A', H] sorted by local
        expert, their counts [E_local], a handle for `gather`)."""

    def gather(self, outputs: Tensor, handle: object) -> Tensor:
        """The experts' outputs [A', H] -> the outputs of this rank's assignments [A, H], in `scatter`'s order."""


class Clustered(Protocol):
    """Pairs compressed into centroids (`plait.runtime.lsh.Clusters`)."""

    centroids: Tensor  # [C, H] sorted by expert
    counts: Tensor  # [E] centroids per expert

    def expand(self, outputs: Tensor) -> Tensor:
        """The experts' outputs of the centroids [C, H] -> those of the pairs [A, H]."""


class Compressor(Protocol):
    """Replaces the pairs bound for the experts by fewer centroids before the exchange (LSH-MoE)."""

    def compress(self, tokens: Tensor, counts: Tensor) -> Clustered:
        """Pairs [A, H] sorted by expert with `counts` [E] -> their centroids and how to expand outputs."""


def _expert(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, biases: tuple[Tensor, Tensor, Tensor] | None,
            limit: float, drop_act: bool = False) -> Tensor:
    """One expert: w2 swiglu(w1 x, w3 x) (+ biases b1, b3 [F], b2 [H]); x [n, H], w1/w3 [F, H], w2 [H, F] -> [n, H].
    With `drop_act` (Megatron-LM's `moe_act` recompute) backward keeps the first GEMMs' outputs only and runs
    the activation again, for its own gradient and for the down GEMM's input (`plait.models.dropped`)."""
    b1, b3, b2 = biases if biases is not None else (None, None, None)
    gate = x @ w1.t() if b1 is None else torch.addmm(b1, x, w1.t())
    up = x @ w3.t() if b3 is None else torch.addmm(b3, x, w3.t())
    if drop_act and torch.is_grad_enabled():
        activation = partial(swiglu, limit=limit)
        act = recomputed(activation, gate, up)
        with Dropped(act, activation, keep=(gate, up)):
            out = act @ w2.t()
    else:
        out = swiglu(gate, up, limit) @ w2.t()
    return out if b2 is None else out + b2


def _local(param: Tensor) -> Tensor:
    """This rank's shard of a parameter (the tensor itself unless it is a DTensor)."""
    return param.to_local() if hasattr(param, "to_local") else param


class Experts(nn.Module):
    """E SwiGLU experts stored as stacked weights: w1 (gate) and w3 (up) [E, F, H], w2 (down) [E, H, F], and
    with biases (GPT-OSS) w1_bias, w3_bias [E, F] and w2_bias [E, H]; GPT-OSS's clamped SwiGLU where `limit`
    > 0. Under expert parallelism they are DTensors sharded along the expert dimension, and under expert tensor
    parallelism also along F (each rank's outputs are then partial sums, `plait.runtime.experts`)."""

    rows: int = 0
    """Rows the experts computed (a recomputed forward again) since the runtime last read and reset it
    (`plait.runtime.experts.expert_load`)."""

    drop_act: bool = False
    """Set by the runtime for Megatron-LM's `moe_act` recompute: backward keeps the experts' first GEMM outputs,
    not their activation, and runs it again (`_expert`)."""

    width_mesh: object | None = None
    """Set by the runtime under expert tensor parallelism (the 1-D etp DeviceMesh): each rank's outputs are
    partial sums over it, so each adds 1/etp of the down bias, whose gradient is summed over it."""

    def __init__(self, experts: int, hidden: int, ffn: int, bias: bool = False, limit: float = 0.0) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w1_bias: nn.Parameter | None = None
        self.w3_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.w1_bias = nn.Parameter(torch.zeros(experts, ffn))
            self.w3_bias = nn.Parameter(torch.zeros(experts, ffn))
            self.w2_bias = nn.Parameter(torch.zeros(experts, hidden))

    tally: tuple[Tensor, Tensor] | None = None
    """Set by the MoE block before a forward whose choices count (`MoE.choice_counts`): (the block's choices
    per expert, the step's total), added as the weights' gradient is computed; cleared by the forward."""

    def forward(self, tokens: Tensor, counts: Tensor) -> Tensor:
        """tokens [n, H] sorted by (local) expert, counts [E_local] -> outputs [n, H] in the same order. Every
        expert runs, on no rows if it got none, so every rank's backward has the same collectives."""
        down = _local(self.w2)
        if self.tally is not None:
            down, self.tally = _CountedInBackward.apply(down, *self.tally), None
        w1, w3, w2 = _local(self.w1).unbind(0), _local(self.w3).unbind(0), down.unbind(0)
        biases = None if self.w2_bias is None else list(zip(*self._biases(), strict=True))
        self.rows += tokens.shape[0]
        parts = tokens.split(counts.tolist())
        return torch.cat([_expert(x, w1[e], w3[e], w2[e], None if biases is None else biases[e], self.limit,
                                  self.drop_act) for e, x in enumerate(parts)])

    def _biases(self) -> tuple[tuple[Tensor, ...], ...]:
        """This rank's experts' biases, each unbound by expert; the down bias split over `width_mesh`."""
        b2 = _local(self.w2_bias)
        if (mesh := self.width_mesh) is not None:
            b2 = summed_in_backward(b2, mesh) / mesh.size()
        return _local(self.w1_bias).unbind(0), _local(self.w3_bias).unbind(0), b2.unbind(0)


@dataclass(frozen=True)
class Documents:
    """The documents of a packed row, for the balancing loss: `ids` [N] the document number of each of this
    rank's tokens (`count` or more: padding, in no document), `count` the row's documents (the same on every
    rank of `sequence_group`)."""

    ids: Tensor
    count: int


class _AuxGradient(torch.autograd.Function):
    """Identity on the block's output whose backward also starts the auxiliary loss's backward with `scale`."""

    @staticmethod
    def forward(ctx, out: Tensor, aux: Tensor, scale: float) -> Tensor:  # noqa: ANN001
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # noqa: ANN001
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _CountedInBackward(torch.autograd.Function):
    """Identity on an expert weight whose backward adds the forward's choice counts to `total`: it runs once per
    forward whose weight gradients are computed (not for a pipeline stage's shape probe, whose backward asks for
    input gradients only, nor twice for a recomputed forward)."""

    @staticmethod
    def forward(ctx, weight: Tensor, counts: Tensor, total: Tensor) -> Tensor:  # noqa: ANN001
        ctx.counts, ctx.total = counts, total
        return weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        ctx.total += ctx.counts.to(ctx.total.dtype)
        return grad, None, None


class MoE(nn.Module):
    """Router + routed experts (+ shared experts): x [B, T, H] -> [B, T, H]. Module names: router,
    experts (w1, w2, w3; their biases), shared (w1, w2, w3; absent when the block's ffn is 0), shared_gate
    (Qwen2-MoE); the buffer choice_bias (DeepSeek-V3)."""

    exchange: Exchange | None = None
    """Set by the runtime for expert parallelism (None: every expert is on this rank)."""
    compressor: Compressor | None = None
    """Set by the runtime for LSH-MoE (`moe_comm=lsh`): only centroids reach the experts (None: every pair)."""
    sequence_group: dist.ProcessGroup | None = None
    """Set by the runtime: the ranks that hold parts of the same sequences (None: whole sequences here)."""
    documents: Documents | None = None
    """Set by the variable-length runtime: the packed row's documents, each its own sequence in the balancing
    loss (None: every row of the batch is one sequence)."""
    choice_counts: Tensor | None = None
    """Set by the runtime ([E] zeros, float64) to count this step's (token, expert) choices for the choice
    bias's update (`plait.runtime.experts.update_choice_biases`), each forward's as its experts' weight
    gradients are computed (`_CountedInBackward`); None: not counted."""
    aux_scale: float = AUX_LOSS_COEF
    """Gradient weight of this rank's auxiliary loss, per sequence it holds (the runtime folds in
    micro-batches and context-parallel averaging); with `documents`, of its sum over the row's documents."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.top_k = block.top_k
        self.groups = block.expert_groups if block.grouped_routing else 0
        self.group_top_k = block.group_top_k
        self.gating = block.gating
        self.router = nn.Linear(block.hidden, block.experts, bias=block.gating.router_bias)
        self.choice_bias: Tensor | None
        self.register_buffer("choice_bias", torch.zeros(block.experts) if block.gating.choice_bias else None)
        self.experts = Experts(block.experts, block.hidden, block.expert_ffn, block.bias or block.mlp_bias,
                               block.swiglu_limit)
        self.shared = FeedForward(block) if block.ffn else None
        self.shared_gate = nn.Linear(block.hidden, 1, bias=False) if block.ffn and block.gating.shared_gate \
            else None

    @property
    def n_experts(self) -> int:
        return self.router.out_features

    @property
    def dense_modules(self) -> list[nn.Module]:
        """The modules every token of this rank goes through (router, shared experts and their gate)."""
        return [m for m in (self.router, self.shared_gate, self.shared) if m is not None]

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, H] -> (router probabilities fp32 [N, E] (for the balancing loss), chosen experts [N, k],
        their weights [N, k])."""
        logits = self.router(x).float()
        sigmoid = self.gating.score == "sigmoid"
        scores = logits.sigmoid() if sigmoid else F.softmax(logits, dim=-1)
        choice = scores if self.choice_bias is None else scores + self.choice_bias.float()
        chosen = self._limited(choice).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.gating.normalized:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
        probs = scores / scores.sum(dim=-1, keepdim=True) if sigmoid else scores
        return probs, chosen, weights * self.gating.scale

    def _limited(self, scores: Tensor) -> Tensor:
        """scores [N, E] with the experts outside each token's `group_top_k` best groups (scored by their best
        expert, or best two: `Gating.group_score`) set to 0, so top-k picks inside those groups; `scores`
        itself without router groups."""
        if not self.groups:
            return scores
        grouped = scores.view(scores.shape[0], self.groups, -1)  # [N, G, E/G]
        rank = grouped.amax(dim=-1) if self.gating.group_score == "max" else grouped.topk(2, dim=-1).values.sum(-1)
        best = rank.topk(self.group_top_k, dim=-1).indices  # [N, group_top_k]
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter(1, best, True)
        return (grouped * keep.unsqueeze(-1)).view_as(scores)

    def routed(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """The weighted sum of each token's chosen experts: x [N, H], chosen/weights [N, k] -> [N, H]."""
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # assignments grouped by expert
        source = order // self.top_k  # the token of each sorted assignment
        counts = torch.bincount(flat, minlength=self.n_experts)
        if self.choice_counts is not None and self.training and torch.is_grad_enabled():
            self.experts.tally = (self._real_counts(chosen, counts), self.choice_counts)
        tokens = x.index_select(0, source)
        clusters = None if self.compressor is None else self.compressor.compress(tokens, counts)
        if clusters is not None:
            tokens, counts = clusters.centroids, clusters.counts
        if self.exchange is None:
            out = self.experts(tokens, counts)
        else:
            mine, local_counts, handle = self.exchange.scatter(tokens, counts)
            out = self.exchange.gather(self.experts(mine, local_counts), handle)
        if clusters is not None:
            out = clusters.expand(out)
        scaled = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add(0, source, scaled.to(x.dtype))  # summed in x's dtype (autocast:
        # the residual stream's fp32, not the experts' bf16)

    def _real_counts(self, chosen: Tensor, counts: Tensor) -> Tensor:
        """The choices per expert [E] of this rank's tokens that belong to a document: `counts` (of every
        token), or in packed rows (`documents`) those of their tokens but the padding."""
        if self.documents is None:
            return counts
        real = self.documents.ids < self.documents.count
        return torch.bincount(chosen[real].flatten(), minlength=self.n_experts)

    def aux_loss(self, probs: Tensor, chosen: Tensor, batch: int) -> Tensor:
        """This rank's part of the balancing loss summed over its `batch` sequences (probs [N, E], chosen
        [N, k]; sequences in rows of T tokens). Counts are summed over `sequence_group`, so the parts of a
        sequence's ranks add up to its loss."""
        e = self.n_experts
        counts = F.one_hot(chosen, e).sum(dim=1).view(batch, -1, e).sum(dim=1).float()  # [B, E]
        seq = probs.shape[0] // batch
        if self.sequence_group is not None:
            dist.all_reduce(counts, group=self.sequence_group)
            seq *= dist.get_world_size(self.sequence_group)
        prob_sums = probs.view(batch, -1, e).sum(dim=1)  # [B, E]
        return (counts * prob_sums).sum() * e / (self.top_k * seq * seq)

    def document_aux_loss(self, probs: Tensor, chosen: Tensor, docs: Documents) -> Tensor:
        """This rank's part of the balancing loss summed over the packed row's documents (probs [N, E],
        chosen [N, k]): each document's E/k * sum_i f_di * P_di over its own tokens, padding left out. Counts
        (and from them each document's tokens: its assignments / k) are summed over `sequence_group`."""
        e, d = self.n_experts, docs.count
        rows = docs.ids.clamp(max=d)  # padding -> row d, dropped
        picked = F.one_hot(chosen, e).sum(dim=1).float()  # [N, E]
        counts = torch.zeros(d + 1, e).index_add(0, rows, picked)[:d]  # [D, E]
        if self.sequence_group is not None:
            dist.all_reduce(counts, group=self.sequence_group)
        tokens = counts.sum(dim=1) / self.top_k  # [D]
        prob_sums = torch.zeros(d + 1, e, dtype=probs.dtype).index_add(0, rows, probs)[:d]  # [D, E]
        return ((counts * prob_sums).sum(dim=1) / tokens.square()).sum() * e / self.top_k

    def forward(self, x: Tensor) -> Tensor:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        probs, chosen, weights = self.route(flat)
        out = self.routed(flat, chosen, weights)
        if self.shared is not None:
            shared = self.shared(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        if self.training and torch.is_grad_enabled():
            if self.documents is None:
                out = _AuxGradient.apply(out, self.aux_loss(probs, chosen, b), self.aux_scale / b)
            else:
                aux = self.document_aux_loss(probs, chosen, self.documents)
                out = _AuxGradient.apply(out, aux, self.aux_scale)
        return out.view(b, t, h)
