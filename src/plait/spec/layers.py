"""Layer kinds: what one layer of a model is, by shape alone.

A model is an ordered sequence of layers (`ModelSpec.stack`), each a `Block` of a named kind:

    decoder        causal self-attention + MLP (GPT, Llama, Mistral, Gemma-2; `window` > 0 for local layers)
    moe            causal self-attention + router + experts (+ shared experts), top-k routing
    encoder        bidirectional self-attention + MLP (T5's encoder, BERT)
    cross_decoder  causal self-attention + cross-attention to an encoder's output + MLP (T5's decoder)
    vision         bidirectional self-attention + MLP over image patches (ViT, CLIP, SigLIP towers)
    patch_embed    an image cut into patches and projected to the tower's width (+ class token, positions)
    projector      an MLP from the vision tower's width to the language model's (LLaVA)

Everything the cost model needs of a layer is derived here: its token-wise GEMMs, parameters, forward
FLOPs per token (the attention term depends on the sequence and the window), the bytes it keeps for
backward per token by recompute mode (Korthikanti et al. 2022, Table 2, generalised) and the elements its
collectives move. Counts are elements; sizes are in tokens; FLOPs count a multiply-add as 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Literal

from plait.cached_hash import cached_hash
from plait.errors import PlaitError

Kind = Literal["decoder", "moe", "encoder", "cross_decoder", "vision", "patch_embed", "projector"]
KINDS: tuple[str, ...] = ("decoder", "moe", "encoder", "cross_decoder", "vision", "patch_embed", "projector")
Recompute = Literal["none", "selective", "attn_kept", "gemm_kept", "full"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "attn_kept", "gemm_kept", "full")
"""Recompute modes: none; selective (Megatron-LM's, Korthikanti et al. 2022: only the attention core is recomputed,
from its queries, keys and values; ring attention is not);
attn_kept (MEMO, Zhao et al. SIGMOD 2025: everything but the attention core is recomputed, whose output and
log-sum-exp are kept with the layer input); gemm_kept (op-level selective checkpointing as torchtitan runs it:
the layer input and every GEMM output are kept, everything else is recomputed, the attention core included);
full (the whole layer is recomputed from its input)."""
Attention = Literal["flash", "eager", "triton"]
"""Attention kernel: "flash" (FlashAttention-2-class fused kernel, the default), "triton" (the Triton
FlashAttention of flash_attn_triton.py, e.g. llm-foundry's `attn_impl: triton`), "eager" (unfused)."""
FUSED_ATTENTION: tuple[str, ...] = ("flash", "triton")
"""Attention kernels that never write the score matrix (they keep a log-sum-exp per query and head)."""
Norm = Literal["layernorm", "rmsnorm"]

MASK_BYTES = 1
"""Bytes per element of a dropout mask (Megatron stores uint8 masks; Korthikanti Table 2)."""
LSE_BYTES = 4
"""Bytes per (token, head) of the fp32 log-sum-exp a flash-attention kernel saves for backward."""
RING_KEPT_FP32 = 4
"""Bytes per element of ring attention's saved output, accumulated and kept in fp32 (runtime/ring.py)."""
ROUTER_BYTES = 4
"""Bytes per (token, expert) of the fp32 router logits and probabilities an MoE layer keeps for backward."""
GATED_MLP_SAVED = 4
"""ffn-wide tensors a gated MLP (SwiGLU/GeGLU) keeps for backward: the gate and up projections, the activated
gate (the product's backward reads it) and the product (input of the down projection). Unfused, as plait's
runtime (models/llama.py, models/moe.py) and Galvatron 2.4.0 (core/runtime/tensor_parallel/transformer.py,
`swiglu`) run it; Galvatron's memory profile of llama-7b measures 301.3 MiB per 2048-token sequence at tp=1
(37.7 bytes per token per hidden unit), which this count gives within 0.4% and three tensors miss by 14%
(docs/benchmarks/galvatron-memory.md). Megatron's fused bias-SwiGLU recomputes the activation (three)."""
UNGATED_MLP_SAVED = 2
"""ffn-wide tensors a two-matrix MLP keeps for backward: the activation's input and output (Korthikanti
et al. 2022, Table 2: 8sbh + 8sbh at ffn = 4h)."""
"""Bytes per (token, expert) of the fp32 router logits and probabilities an MoE layer keeps for backward."""
MTP_KEPT = 5
"""Hidden-wide 16-bit tensors a multi-token-prediction module keeps per token outside its layer: the inputs of
its two norms (the next token's embedding, the previous hidden state), of its projection (both, 2 wide) and
of its final norm (Megatron-Core multi_token_prediction.py)."""
IMAGE_CHANNELS = 3
"""Input channels of an image (RGB)."""

ATTENTION_KINDS = ("decoder", "moe", "encoder", "cross_decoder", "vision")
"""Kinds with self-attention (heads, tensor and context parallelism over heads apply)."""


@dataclass(frozen=True)
class Gemm:
    """One token-wise linear layer: y[tokens, n] = x[tokens, k] @ W[k, n], `count` times (experts).

    `split` says how tensor parallelism divides it: "col" splits n (Megatron ColumnParallelLinear),
    "row" splits k (RowParallelLinear), "none" keeps it whole on every rank (a router, MLA's
    down-projections). `rows` says which tokens it runs on: "self" the layer's own,
    "memory" the encoder output a cross-attention reads, "routed" the layer's tokens times top-k (each
    token goes through k experts). `count` is how many such matrices exist (experts hold one each).
    """

    name: str
    k: int
    n: int
    split: Literal["col", "row", "none"]
    rows: Literal["self", "memory", "routed"] = "self"
    count: int = 1

    @property
    def params(self) -> int:
        return self.k * self.n * self.count

    def shard(self, tp: int) -> tuple[int, int]:
        """(k, n) of one rank's share when tensor parallelism of degree `tp` splits it as `split` says."""
        if self.split == "none":
            return self.k, self.n
        return (self.k, self.n // tp) if self.split == "col" else (self.k // tp, self.n)


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes saved for backward by one layer, per token, at 16-bit activations.

    `replicated` is stored whole on every tensor-parallel rank unless sequence parallelism shards it;
    `sharded` is divided by the tensor-parallel degree; `quadratic_per_seq_token` is multiplied by the
    number of keys each query sees (the s^2 attention scores of eager attention) and divided by the TP
    degree; `masks` are 1-byte dropout masks that stay 1 byte whatever the activation dtype.
    """

    replicated: float
    sharded: float
    quadratic_per_seq_token: float
    replicated_masks: float
    sharded_quadratic_masks: float
    sharded_fp32: float = 0.0
    """Bytes divided by the tensor-parallel degree that are fp32 whatever the activation dtype (ring
    attention's kept output and log-sum-exp under attn_kept)."""
    whole: float = 0.0
    """Bytes stored whole on every tensor-parallel rank even under sequence parallelism (a row-parallel
    GEMM's partial sums, kept by gemm_kept before their reduce)."""


@dataclass(frozen=True)
class Gating:
    """How a moe layer's router weighs the experts it picks (the runtime's `plait.models.moe.MoE`; the cost
    model prices every kind alike). Defaults: Mixtral's and Qwen3-MoE's softmax over the experts, the top k
    renormalised to sum to 1."""

    score: Literal["softmax", "sigmoid"] = "softmax"  # router logits -> each expert's score (DeepSeek-V3: sigmoid)
    normalized: bool = True  # the picked experts' scores renormalised to sum to 1 (config.json's norm_topk_prob)
    scale: float = 1.0  # factor on the picked experts' weights (DeepSeek's routed_scaling_factor)
    choice_bias: bool = False  # a per-expert bias added to the scores for picking only (DeepSeek-V3's
    # e_score_correction_bias), a buffer the checkpoint holds
    group_score: Literal["max", "top2"] = "max"  # a router group's score: its best expert's (DeepSeek-V2) or the
    # sum of its best two (DeepSeek-V3)
    shared_gate: bool = False  # the shared experts' output times sigmoid(a hidden -> 1 projection) (Qwen2-MoE)
    router_bias: bool = False  # the router's projection has a bias (GPT-OSS)

    def __post_init__(self) -> None:
        if self.score not in ("softmax", "sigmoid") or self.group_score not in ("max", "top2") or self.scale <= 0:
            raise PlaitError(f"router gating: score must be softmax or sigmoid, group_score max or top2 and scale "
                             f"positive (got {self.score!r}, {self.group_score!r}, {self.scale})")


DEEPSEEK_V3_GATING = Gating(score="sigmoid", scale=2.5, choice_bias=True, group_score="top2")
"""DeepSeek-V3's router (its config.json: scoring_func sigmoid, topk_method noaux_tc, norm_topk_prob,
routed_scaling_factor 2.5)."""

SWIGLU_ALPHA = 1.702
"""The factor in GPT-OSS's clamped SwiGLU, gate * sigmoid(alpha gate) (config.json's swiglu_alpha;
`Block.swiglu_limit`)."""


@cached_hash
@dataclass(frozen=True)
class Block:
    """Shape of one layer. Widths in elements; `tokens` and `memory_tokens` per sample (0: the run's
    sequence length); `window` in tokens (0: every earlier token)."""

    kind: Kind = "decoder"
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0  # 0 = same as heads
    head_dim: int = 0  # 0 = hidden // heads
    ffn: int = 0  # MLP width (dense layers; shared experts' total width in moe layers); 0 = 4 * hidden
    gated_mlp: bool = False  # SwiGLU/GeGLU: three matrices (gate, up, down)
    norm: Norm = "layernorm"
    norms: int = 2  # hidden-size norms in the layer (Gemma-2 has 4; a cross decoder 3)
    bias: bool = True  # biases on every linear (GPT, CLIP) or not (Llama, T5)
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    dropout: bool = True
    attention: Attention = "flash"
    rope: bool = False  # rotary positions applied to q and k inside the layer
    window: int = 0
    tokens: int = 0
    memory_tokens: int = 0
    experts: int = 0  # routed experts (moe)
    top_k: int = 0  # experts per token (moe)
    expert_ffn: int = 0  # one routed expert's MLP width (moe)
    # Group-limited routing (DeepSeek-V2/V3's n_group, topk_group): the experts fall in expert_groups equal
    # groups of consecutive experts and a token takes its top_k from the group_top_k groups it scores highest;
    # 0 = no groups.
    expert_groups: int = 0
    group_top_k: int = 0
    in_dim: int = 0  # input width of patch_embed (channels x patch^2) and projector (the tower's hidden)
    # Multi-head latent attention (DeepSeek-V2/V3), on when kv_lora > 0: queries (through a q_lora-wide
    # latent when q_lora > 0) and keys/values from a kv_lora-wide latent; each query/key head has head_dim
    # plain dims and rope_head_dim rotary dims (the rotary key shared by the heads), each value head
    # v_head_dim dims.
    q_lora: int = 0
    kv_lora: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0  # 0 = head_dim
    # A multi-token-prediction module (DeepSeek-V3, Megatron's --mtp-num-layers) around this layer: the next
    # token's embedding and the previous depth's hidden state, each normed, concatenated and projected from
    # 2 x hidden down to hidden (`mtp_proj`), then this layer and a final norm (`norms` counts the three extra
    # norms); its logits come from the model's shared head (`plait.cost.head`).
    mtp: bool = field(default=False, repr=False)  # out of repr: models without it keep their fingerprints
    # Query and key heads each RMS-normed over head_dim before RoPE (Qwen3's q_norm, k_norm).
    qk_norm: bool = field(default=False, repr=False)
    gating: Gating = field(default=Gating(), repr=False)  # how a moe layer's router weighs its experts
    # Attention sinks (GPT-OSS): a learned logit per query head in every softmax's denominator, as one more key
    # each query sees whose value is zero.
    sinks: bool = field(default=False, repr=False)
    # GPT-OSS's clamped SwiGLU on the layer's gated MLPs when > 0: the gate clamped to <= limit, the up
    # projection to [-limit, limit], out = gate * sigmoid(1.702 gate) * (up + 1) (config.json's swiglu_limit).
    swiglu_limit: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlaitError(f"layer kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}")
        if self.has_attention:
            if not self.kv_heads:
                object.__setattr__(self, "kv_heads", self.heads)
            if not self.head_dim:
                if self.heads <= 0 or self.hidden % self.heads:
                    raise PlaitError(f"{self.kind} layer: hidden={self.hidden} is not divisible by heads="
                                     f"{self.heads}; pick heads that divide hidden or give head_dim explicitly")
                object.__setattr__(self, "head_dim", self.hidden // self.heads)
            for f in ("heads", "kv_heads", "head_dim"):
                if getattr(self, f) <= 0:
                    raise PlaitError(f"{self.kind} layer: {f} must be a positive integer, got {getattr(self, f)}")
            if self.heads % self.kv_heads:
                raise PlaitError(f"{self.kind} layer: heads={self.heads} is not a multiple of kv_heads="
                                 f"{self.kv_heads}; grouped-query attention needs kv_heads to divide heads")
            if not self.v_head_dim:
                object.__setattr__(self, "v_head_dim", self.head_dim)
        if min(self.q_lora, self.kv_lora, self.rope_head_dim) < 0 or (self.q_lora or self.rope_head_dim) \
                and not self.kv_lora:
            raise PlaitError(f"{self.kind} layer: latent attention needs kv_lora > 0 (with q_lora, rope_head_dim >= 0)")
        if not self.ffn and self.kind not in ("patch_embed", "moe"):
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.hidden <= 0:
            raise PlaitError(f"{self.kind} layer: hidden must be a positive integer, got {self.hidden}")
        if self.kind == "moe" and (self.experts <= 0 or not 0 < self.top_k <= self.experts or self.expert_ffn <= 0):
            raise PlaitError(f"moe layer: needs experts > 0, 0 < top_k <= experts and expert_ffn > 0 (got experts="
                             f"{self.experts}, top_k={self.top_k}, expert_ffn={self.expert_ffn})")
        if self.expert_groups or self.group_top_k:
            self._check_expert_groups()
        if self.sinks and not self.has_attention or self.swiglu_limit < 0 or self.swiglu_limit and not self.gated_mlp:
            raise PlaitError(f"{self.kind} layer: attention sinks need attention, and swiglu_limit (>= 0) a gated MLP "
                             f"(got sinks={self.sinks}, swiglu_limit={self.swiglu_limit}, gated_mlp={self.gated_mlp})")
        if self.gating != Gating() and self.kind != "moe":
            raise PlaitError(f"{self.kind} layer: router gating is set, but only moe layers have a router")
        if self.kind in ("patch_embed", "projector") and self.in_dim <= 0:
            raise PlaitError(f"{self.kind} layer: in_dim (input width) must be a positive integer")
        for f in ("window", "tokens", "memory_tokens"):
            if getattr(self, f) < 0:
                raise PlaitError(f"{self.kind} layer: {f} must be >= 0, got {getattr(self, f)}")

    def _check_expert_groups(self) -> None:
        g, t = self.expert_groups, self.group_top_k
        if self.kind != "moe" or g <= 0 or self.experts % g or not 0 < t <= g \
                or self.top_k > t * (self.experts // g):
            raise PlaitError(f"{self.kind} layer: group-limited routing needs a moe layer whose expert_groups "
                             f"divide its experts and 0 < group_top_k <= expert_groups with top_k experts in "
                             f"group_top_k groups (got experts={self.experts}, top_k={self.top_k}, "
                             f"expert_groups={g}, group_top_k={t})")

    # ---- shape -----------------------------------------------------------------------------
    @property
    def grouped_routing(self) -> bool:
        """Whether router groups limit a token's experts (more than one group, fewer of them picked than all)."""
        return self.expert_groups > 1 and self.group_top_k < self.expert_groups

    @property
    def has_attention(self) -> bool:
        return self.kind in ATTENTION_KINDS

    @property
    def causal(self) -> bool:
        return self.kind in ("decoder", "moe", "cross_decoder")

    @property
    def latent(self) -> bool:
        """Whether the attention is multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora > 0

    @property
    def qk_head_dim(self) -> int:
        """Dims per query/key head (plain and rotary)."""
        return self.head_dim + self.rope_head_dim

    @property
    def q_dim(self) -> int:
        """Width of the queries (heads x query head dims)."""
        return self.heads * self.qk_head_dim

    @property
    def k_dim(self) -> int:
        """Width of the keys (kv_heads x key head dims)."""
        return self.kv_heads * self.qk_head_dim

    @property
    def v_dim(self) -> int:
        """Width of the values (kv_heads x value head dims)."""
        return self.kv_heads * self.v_head_dim

    @property
    def o_dim(self) -> int:
        """Width of the attention output into its projection (heads x value head dims)."""
        return self.heads * self.v_head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and values together, halved (kv_heads x head_dim without latent attention)."""
        return (self.k_dim + self.v_dim) // 2

    def seq(self, seq_len: int) -> int:
        """Tokens per sample this layer runs on, for a run of `seq_len` tokens per sequence."""
        return self.tokens or seq_len

    def memory_seq(self, seq_len: int) -> int:
        """Encoder tokens per sample a cross-attention reads."""
        return self.memory_tokens or seq_len

    def keys(self, seq_len: int) -> int:
        """Keys each query attends to as counted for FLOPs (the full s x s matrix, as Megatron counts,
        capped by a sliding window)."""
        s = self.seq(seq_len)
        return min(s, self.window) if self.window else s

    @cached_property
    def gemms(self) -> tuple[Gemm, ...]:
        """The linear layers of the layer, in execution order (a multi-token-prediction module's projection
        first, replicated on every tensor-parallel rank)."""
        own = self._layer_gemms()
        return (Gemm("mtp_proj", 2 * self.hidden, self.hidden, "none"), *own) if self.mtp else own

    def _layer_gemms(self) -> tuple[Gemm, ...]:
        h = self.hidden
        if self.kind == "patch_embed":
            return (Gemm("patch", self.in_dim, h, "col"),)
        if self.kind == "projector":
            return (Gemm("proj_up", self.in_dim, self.ffn, "col"), Gemm("proj_down", self.ffn, h, "row"))
        if self.latent:  # down-projections replicated on every tensor-parallel rank, up-projections split
            q = [Gemm("q_down", h, self.q_lora, "none"), Gemm("q_up", self.q_lora, self.q_dim, "col")] \
                if self.q_lora else [Gemm("q", h, self.q_dim, "col")]
            out: list[Gemm] = [*q, Gemm("kv_down", h, self.kv_lora + self.rope_head_dim, "none"),
                               Gemm("kv_up", self.kv_lora, self.heads * (self.head_dim + self.v_head_dim), "col"),
                               Gemm("attn_out", self.o_dim, h, "row")]
        else:
            out = [Gemm("qkv", h, self.q_dim + self.k_dim + self.v_dim, "col"), Gemm("attn_out", self.o_dim, h, "row")]
        if self.kind == "cross_decoder":
            out += [Gemm("cross_q", h, self.q_dim, "col"), Gemm("cross_kv", h, 2 * self.kv_dim, "col", rows="memory"),
                    Gemm("cross_out", self.q_dim, h, "row")]
        up = 2 if self.gated_mlp else 1
        if self.kind == "moe":
            out.append(Gemm("router", h, self.experts, "none"))
            out += [Gemm("expert_up", h, up * self.expert_ffn, "col", rows="routed", count=self.experts),
                    Gemm("expert_down", self.expert_ffn, h, "row", rows="routed", count=self.experts)]
            if self.ffn:  # shared experts, always active
                out += [Gemm("shared_up", h, up * self.ffn, "col"), Gemm("shared_down", self.ffn, h, "row")]
            return tuple(out)
        return (*out, Gemm("mlp_up", h, up * self.ffn, "col"), Gemm("mlp_down", self.ffn, h, "row"))

    # ---- parameters -----------------------------------------------------------------------
    @cached_property
    def params(self) -> int:
        """Parameters of the layer (weights, biases, norms; every expert)."""
        weights = sum(g.params for g in self.gemms)
        norm_params = (2 if self.norm == "layernorm" else 1) * (self.hidden * self.norms + self.q_lora + self.kv_lora
                                                                + 2 * self.head_dim * self.qk_norm)
        if self.kind == "patch_embed":  # patch projection (+ bias), position table (class token aside), norms
            return weights + self.hidden * self.bias + self.seq(0) * self.hidden + norm_params
        biases = 0
        for g in self.gemms:
            if g.name in ("qkv", "cross_q", "cross_kv", "q", "q_up", "kv_up"):
                biases += g.n * g.count * (self.bias or self.qkv_bias)
            elif g.name in ("attn_out", "cross_out"):
                biases += g.n * g.count * (self.bias or self.out_bias)
            elif g.split != "none":
                biases += g.n * g.count * (self.bias or self.mlp_bias)
        router = self.hidden * self.gating.shared_gate + self.experts * self.gating.router_bias
        return weights + norm_params + biases + router + self.heads * self.sinks

    @cached_property
    def active_params(self) -> int:
        """Parameters one token goes through (a moe layer's top-k experts, not all of them)."""
        if self.kind != "moe":
            return self.params
        bias = self.bias or self.mlp_bias
        routed = sum(g.params + g.n * g.count * bias for g in self.gemms if g.rows == "routed")
        return self.params - routed * (self.experts - self.top_k) // self.experts

    # ---- FLOPs ----------------------------------------------------------------------------
    def gemm_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of the layer's linear layers per token of its own (cross-attention's K/V
        projections of the encoder output counted per decoder token)."""
        s = self.seq(seq_len)
        total = 0.0
        for g in self.gemms:
            rows = {"self": 1.0, "memory": self.memory_seq(seq_len) / s, "routed": self.top_k / self.experts
                    if self.experts else 0.0}[g.rows]
            total += 2 * g.k * g.n * g.count * rows
        return total

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of the attention cores (QK^T and AV) over the keys each query sees."""
        if not self.has_attention:
            return 0.0
        per_key = 2 * (self.q_dim + self.o_dim)  # QK^T over query/key dims, AV over value dims
        flops = self.keys(seq_len) * per_key
        if self.kind == "cross_decoder":
            flops += self.memory_seq(seq_len) * per_key
        return flops

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of the layer."""
        return self.gemm_flops_per_token(seq_len) + self.attention_flops_per_token(seq_len)

    # ---- activations ----------------------------------------------------------------------
    def activation_bytes(self, recompute: Recompute, ring: bool = False) -> ActivationBytes:
        """Bytes saved for backward per token of the layer, 16-bit activations (see ActivationBytes); `ring`:
        under ring context parallelism (attn_kept saves differently there; selective keeps its log-sum-exp).

        With eager attention, dropout, LayerNorm and a 4h GeLU MLP a decoder layer reproduces Korthikanti
        et al. 2022, Table 2: s*b*h*(34 + 5*a*s/h) with no parallelism, s*b*h*(10 + 24/t + 5*a*s/(h*t))
        with tensor parallelism, and 2*s*b*h under full recomputation. A multi-token-prediction module adds
        what its recompute leaves outside the layer (`MTP_KEPT` hidden-wide tensors).
        """
        kept = self._layer_activation_bytes(recompute, ring)
        return replace(kept, replicated=kept.replicated + 2 * MTP_KEPT * self.hidden) if self.mtp else kept

    def _layer_activation_bytes(self, recompute: Recompute, ring: bool) -> ActivationBytes:
        h = self.hidden
        if recompute == "full" or (recompute == "attn_kept" and not self.has_attention):
            # only the layer input survives (sharded by sequence parallelism)
            return ActivationBytes(2 * (self.in_dim if self.kind == "projector" else h), 0, 0, 0, 0)
        if recompute == "attn_kept":
            return self._ring_kept_bytes() if ring else self._attention_kept_bytes()
        if self.kind == "patch_embed":  # the patch pixels into the projection
            return ActivationBytes(2 * self.in_dim, 0, 0, 0, 0)
        if recompute == "gemm_kept":
            return self._gemm_kept_bytes()
        if self.kind == "projector":  # input, hidden pre- and post-activation
            return ActivationBytes(2 * self.in_dim, 2 * 2 * self.ffn, 0, 0, 0)
        drop_masks = 2 * h * MASK_BYTES if self.dropout else 0  # after attention and after the MLP
        replicated = 2 * h + 2 * h + 2 * h + 2 * h  # norm1 in, qkv in, norm2 in, MLP in
        q_k = 2 * self.q_dim + 2 * self.k_dim
        v = 2 * self.v_dim
        proj_in = 2 * self.o_dim
        if self.latent:  # the latents into the up-projections (and their norms)
            replicated += 2 * 2 * (self.q_lora + self.kv_lora)
        mlp_width = GATED_MLP_SAVED if self.gated_mlp else UNGATED_MLP_SAVED
        mlp = mlp_width * 2 * self.ffn  # a moe layer's ffn is its shared experts' width
        sharded = q_k + v + proj_in + mlp
        if self.kind == "moe":  # router probabilities; the routed experts' activations: routed_activation_bytes
            replicated += ROUTER_BYTES * self.experts
        if self.kind == "cross_decoder":  # norm + query in, scores' q and output, encoder K/V per token
            replicated += 2 * h + 2 * h
            sharded += 2 * self.q_dim + 2 * self.q_dim + 2 * 2 * self.kv_dim
            if self.dropout:
                drop_masks += h * MASK_BYTES
        quadratic = 0.0
        quad_masks = 0.0
        heads = self.heads * (2 if self.kind == "cross_decoder" else 1)
        if self.attention == "eager" and recompute == "none":
            quadratic = 2 * heads  # softmax output, per token per score column
            if self.dropout:
                quadratic += 2 * heads  # attention-dropout output
                quad_masks = heads * MASK_BYTES
        elif self.attention in FUSED_ATTENTION and (recompute == "none" or ring):
            sharded += LSE_BYTES * heads  # selective runs a local core again (ring attention keeps its own)
        return ActivationBytes(replicated, sharded, quadratic, drop_masks, quad_masks)

    def _attention_kept_bytes(self) -> ActivationBytes:
        """Bytes per token under `attn_kept` (MEMO): the layer input (replicated, sharded by sequence
        parallelism) and what each attention core's backward reads that the recomputed layer cannot give it
        back without running the core again: its output (o_dim wide, split over tp heads) and, for a fused
        kernel, its fp32 log-sum-exp per head (LSE_BYTES); an eager core keeps its softmax (and dropout)
        output per score column instead. Queries, keys and values are recomputed from the input."""
        cores = 2 if self.kind == "cross_decoder" else 1
        sharded = cores * 2 * self.o_dim
        quadratic = quad_masks = 0.0
        if self.attention in FUSED_ATTENTION:
            sharded += cores * LSE_BYTES * self.heads
        else:
            quadratic = cores * (2 + (2 if self.dropout else 0)) * self.heads
            quad_masks = cores * self.heads * MASK_BYTES if self.dropout else 0.0
        return ActivationBytes(2 * self.hidden, sharded, quadratic, 0, quad_masks)

    def _ring_kept_bytes(self) -> ActivationBytes:
        """Bytes per token under `attn_kept` with ring context parallelism: ring attention runs outside the
        recomputed region as its own autograd function (plait.runtime.ring, plait.runtime.recompute), which
        keeps its local queries and its keys and values (every query head's, GQA's repeated ones; 16-bit)
        and its fp32 output and log-sum-exp (RING_KEPT_FP32, LSE_BYTES per head), with the layer input."""
        cores = 2 if self.kind == "cross_decoder" else 1
        wide = self.heads * self.head_dim  # k and v as ring attention gets them: one per query head
        return ActivationBytes(2 * self.hidden, cores * 3 * 2 * wide, 0, 0, 0,
                               sharded_fp32=cores * (RING_KEPT_FP32 * wide + LSE_BYTES * self.heads))

    def _gemm_kept_bytes(self) -> ActivationBytes:
        """Bytes per token under `gemm_kept` (op-level selective checkpointing, `runtime/parallelize.py`): the
        layer input (for the recompute) and the output of each of its own GEMMs: column-parallel outputs
        sharded by tp, replicated ones (a router, latent down-projections) like the input, row-parallel ones
        whole on every rank (partial sums before their reduce). Everything else (norms, rotary, the attention
        core, activations, dropout) is recomputed. Routed experts: `routed_activation_bytes`."""
        replicated, sharded, whole = 2 * (self.in_dim if self.kind == "projector" else self.hidden), 0, 0
        for g in self.gemms:
            if g.rows == "routed":
                continue
            if g.split == "col":
                sharded += 2 * g.n
            elif g.split == "row":
                whole += 2 * g.n
            else:
                replicated += 2 * g.n
        return ActivationBytes(replicated, sharded, 0, 0, 0, whole=whole)

    def routed_activation_bytes(self, recompute: Recompute = "none") -> tuple[int, int]:
        """(input, hidden) bytes a routed expert keeps for backward per (token, expert) pair, 16-bit: the
        token's hidden state into the expert, and its MLP activations (GATED_MLP_SAVED, UNGATED_MLP_SAVED).
        Under gemm_kept the expert GEMMs' outputs instead: the up projection(s) (hidden, split by etp) and the
        down projection's partial sums (counted as input: whole on every etp rank)."""
        if self.kind != "moe":
            return 0, 0
        if recompute == "gemm_kept":
            up = next(g for g in self.gemms if g.name == "expert_up")
            return 2 * self.hidden, 2 * up.n
        return 2 * self.hidden, (GATED_MLP_SAVED if self.gated_mlp else UNGATED_MLP_SAVED) * 2 * self.expert_ffn

    # ---- communication volumes (elements per token) ---------------------------------------
    @property
    def tp_comm_elements_per_token(self) -> int:
        """Elements per token of each tensor-parallel collective (one per residual sublayer and pass)."""
        return self.hidden

    @property
    def ulysses_elements_per_token(self) -> int:
        """Elements per token that Ulysses all-to-alls move per forward (q, k, v in; output back)."""
        return self.q_dim + self.k_dim + self.v_dim + self.o_dim

    @property
    def ring_kv_elements_per_token(self) -> int:
        """Elements per token of the K and V blocks that ring attention passes around."""
        return self.k_dim + self.v_dim

    def tp_divides(self, tp: int) -> str | None:
        """Why tensor parallelism of degree `tp` cannot split this layer (None when it can)."""
        if self.has_attention and (self.heads % tp or self.kv_heads % tp):
            return f"tp={tp} does not divide heads={self.heads} and kv_heads={self.kv_heads}"
        for g in self.gemms:
            width = g.n if g.split == "col" else g.k
            if g.split != "none" and width % tp:
                return f"tp={tp} does not divide the {g.name} width {width}"
        return None

    def with_(self, **changes: object) -> Block:
        return replace(self, **changes)  # type: ignore[arg-type]

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of the layer's shape (every field; the router groups, the multi-token-prediction flag,
        the q/k norms, the router's gating, attention sinks and the SwiGLU limit only where set, so layers without
        them keep the names earlier profiles gave them): a profile names the layers it measured by it."""
        unset = tuple(f for f in OPTIONAL_FIELDS if getattr(self, f) == BLOCK_DEFAULTS[f])
        return fields_hash(self, 12, skip=unset)


OPTIONAL_FIELDS = ("expert_groups", "group_top_k", "mtp", "qk_norm", "gating", "sinks", "swiglu_limit")
"""Block fields added after layers were first named (`Block.fingerprint`): hashed only where set."""
BLOCK_DEFAULTS = {f.name: f.default for f in fields(Block)}
OUT_OF_REPR = tuple(f.name for f in fields(Block) if not f.repr)
"""Block fields a layer's repr leaves out (so a model's fingerprint, which hashes the layers' reprs, adds
them where set: `ModelSpec.fingerprint`)."""


def fields_hash(obj: object, length: int, skip: tuple[str, ...] = ()) -> str:
    """The first `length` hex digits of the SHA-256 of a dataclass's fields (but `skip`), sorted by name."""
    import hashlib

    named = fields(obj)  # type: ignore[arg-type]
    shape = sorted((f.name, getattr(obj, f.name)) for f in named if f.name not in skip)
    return hashlib.sha256(repr(shape).encode()).hexdigest()[:length]
