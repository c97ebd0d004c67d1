"""ModelSpec: what a decoder-only transformer costs, per layer.

A model is an embedding, `layers` identical transformer blocks and a head (final norm + LM projection).
Everything the cost model needs is derived here from the shape alone: parameter counts, the GEMMs of a
block (so compute efficiency can depend on matrix size), forward FLOPs per token (the attention term grows
with sequence length), activation bytes per token by recompute mode (Korthikanti et al. 2022, Table 2,
generalised to GQA, SwiGLU and flash attention), and communication volumes per parallel dimension.

Sources of a ModelSpec: presets (`PRESETS`), a Hugging Face `config.json`, or an inline spec such as
`llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256`. `load_model` accepts all three.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Literal

from plait.cached_hash import cached_hash
from plait.errors import PlaitError
from plait.spec import stacks
from plait.spec.layers import (
    BLOCK_DEFAULTS,
    DEEPSEEK_V3_GATING,
    LSE_BYTES,
    MASK_BYTES,
    OUT_OF_REPR,
    ActivationBytes,
    Attention,
    Block,
    Gating,
    Gemm,
    Recompute,
    fields_hash,
)

__all__ = ["LSE_BYTES", "MASK_BYTES", "PRESETS", "ActivationBytes", "Attention", "Block", "Gemm", "ModelSpec",
           "Recompute", "load_model", "parse_inline"]

Family = Literal["gpt", "llama", "t5", "llava"]


NUMERICS = ("rope_theta", "norm_eps", "rope_scaling")
"""ModelSpec fields that change the runtime's numbers but not its cost; at their defaults they leave the
fingerprint as it was before they existed."""


@cached_hash
@dataclass(frozen=True)
class ModelSpec:
    """A transformer: an embedding, an ordered stack of layers of named kinds, and a head.

    The scalar fields describe the trunk (the language model: its embedding, head and default layer).
    `stack` lists every layer (`plait.spec.layers.Block`): `mixed` when the layers differ, else `layers`
    copies of the trunk's decoder layer (`block`), which is what the presets of decoder-only models are. Counts are elements;
    sizes are in tokens.
    """

    name: str
    family: Family
    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int = 0  # 0 = same as heads (multi-head attention)
    ffn: int = 0  # 0 = 4 * hidden
    head_dim: int = 0  # 0 = hidden // heads
    max_seq_len: int = 2048
    gated_mlp: bool = False  # SwiGLU: three matrices (gate, up, down)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True  # biases on every linear (GPT) or not (Llama)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama's attention_bias adds the output projection too)
    out_bias: bool = False  # bias on the attention output projection (Llama's attention_bias)
    mlp_bias: bool = False  # biases on the MLP linears (Llama's mlp_bias)
    dropout: bool = True  # Megatron GPT trains with dropout (its masks cost activation memory)
    tied_embeddings: bool = True
    learned_positions: bool = True  # GPT: learned position table; Llama: RoPE (no parameters)
    attention: Attention = "flash"
    window: int = 0  # sliding-window attention of the default layer, tokens (0: global; Mistral: 4096)
    mixed: tuple[Block, ...] = ()  # every layer in order when they differ; () = `layers` copies of `block`
    # Numerics that cost nothing (the runtime's, from config.json): RoPE's base (0: 500000 for vocabularies of
    # 128k and more, else 10000) and the norms' epsilon (0: 1e-5).
    rope_theta: float = field(default=0.0, repr=False)
    norm_eps: float = field(default=0.0, repr=False)
    rope_scaling: tuple[tuple[str, float | str], ...] = field(default=(), repr=False)  # config.json's
    # rope_scaling (rope_parameters) entries but rope_theta, sorted; () = none

    def __post_init__(self) -> None:
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if not self.head_dim:
            if self.heads <= 0 or self.hidden % self.heads:
                raise PlaitError(
                    f"model {self.name!r}: hidden={self.hidden} is not divisible by heads={self.heads}; "
                    "pick heads that divide hidden or give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.mixed:
            object.__setattr__(self, "layers", len(self.mixed))
        for f in ("layers", "hidden", "heads", "vocab", "kv_heads", "ffn", "head_dim", "max_seq_len"):
            if getattr(self, f) <= 0:
                raise PlaitError(f"model {self.name!r}: {f} must be a positive integer, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise PlaitError(
                f"model {self.name!r}: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; "
                "grouped-query attention needs kv_heads to divide heads"
            )

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of the architecture (every field but the name): plans and checkpoints record it, so
        one made for another model is refused even when the layer counts agree."""
        numerics = tuple(f for f in NUMERICS if not getattr(self, f))  # at their defaults: as before they were
        plain = fields_hash(self, 16, skip=("name", *numerics))
        # layer fields out of the layers' repr, where set (models without them keep their fingerprints)
        extras = sorted({(f, repr(getattr(b, f))) for b in self.stack for f in OUT_OF_REPR
                         if f != "mtp" and getattr(b, f) != BLOCK_DEFAULTS[f]})  # mtp: as mtp_layers
        if not self.mtp_layers and not extras:
            return plain
        import hashlib

        mtp = f" mtp {self.mtp_layers}" if self.mtp_layers else ""
        more = f" {extras}" if extras else ""
        return hashlib.sha256(f"{plain}{mtp}{more}".encode()).hexdigest()[:16]

    # ---- layers -------------------------------------------------------------------------------
    @cached_property
    def block(self) -> Block:
        """The trunk's default layer: a decoder layer of the scalar fields' shape."""
        return Block(kind="decoder", hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                     head_dim=self.head_dim, ffn=self.ffn, gated_mlp=self.gated_mlp, norm=self.norm, bias=self.bias,
                     qkv_bias=self.qkv_bias, out_bias=self.out_bias, mlp_bias=self.mlp_bias, dropout=self.dropout,
                     attention=self.attention, rope=not self.learned_positions, window=self.window)

    @cached_property
    def stack(self) -> tuple[Block, ...]:
        """Every layer in model order."""
        return self.mixed or (self.block,) * self.layers

    @cached_property
    def uniform(self) -> bool:
        """Whether every layer is the trunk's default layer (a plain decoder-only stack)."""
        return all(b == self.block for b in self.stack)

    def shape_of(self, block: Block) -> str:
        """The name a profile gives `block`'s measurements: "" for the trunk layer (`block`), else its
        fingerprint (`Block.fingerprint`)."""
        return "" if block == self.block else block.fingerprint

    @property
    def distinct_blocks(self) -> tuple[Block, ...]:
        """Each different layer once, in order of first appearance."""
        return tuple(b for b, _ in self.block_counts)

    @cached_property
    def mtp_layers(self) -> int:
        """Multi-token-prediction modules at the end of the stack (`Block.mtp`), each a further pass through
        the head and its loss on the last stage."""
        return sum(b.mtp for b in self.stack)

    @property
    def trunk_layers(self) -> int:
        """Layers before the multi-token-prediction modules (all of them without any)."""
        return self.layers - self.mtp_layers

    @property
    def shares_table(self) -> bool:
        """Whether the embedding table is read again after the last layer: by a tied head, or by
        multi-token-prediction modules looking up the tokens ahead (a copy on the last pipeline stage)."""
        return self.tied_embeddings or self.mtp_layers > 0

    @cached_property
    def has_experts(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return any(b.kind == "moe" for b in self.distinct_blocks)

    def kind_counts(self) -> dict[str, int]:
        """Layers of each kind, in order of first appearance."""
        out: dict[str, int] = {}
        for b in self.stack:
            out[b.kind] = out.get(b.kind, 0) + 1
        return out

    # ---- the trunk's default layer (uniform models; per-layer costs use `stack`) --------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection (heads x head_dim)."""
        return self.block.q_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projections (kv_heads x head_dim)."""
        return self.block.kv_dim

    @property
    def gemms(self) -> tuple[Gemm, ...]:
        """The linear layers of the default layer, in execution order."""
        return self.block.gemms

    @property
    def block_params(self) -> int:
        """Parameters of the default layer (weights, biases, norms)."""
        return self.block.params

    @property
    def block_gemm_flops_per_token(self) -> float:
        """Forward FLOPs per token of the default layer's linear layers (2 per multiply-add)."""
        return self.block.gemm_flops_per_token(self.max_seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of the default layer's attention core (QK^T and AV), counted over the
        full s x s score matrix as Megatron's published FLOP counts do (capped by a sliding window)."""
        return self.block.attention_flops_per_token(seq_len)

    def block_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of the default layer."""
        return self.block.flops_per_token(seq_len)

    def activation_bytes(self, recompute: Recompute, ring: bool = False) -> ActivationBytes:
        """Bytes the default layer saves for backward per token, 16-bit activations (Block.activation_bytes)."""
        return self.block.activation_bytes(recompute, ring)

    @property
    def tp_comm_elements_per_token(self) -> int:
        """Elements per token of each tensor-parallel collective (4 per block per pass: 2 fwd, 2 bwd)."""
        return self.hidden

    @property
    def ulysses_elements_per_token(self) -> int:
        """Elements per token that Ulysses all-to-alls move per forward (q, k, v in; output back)."""
        return self.block.ulysses_elements_per_token

    @property
    def ring_kv_elements_per_token(self) -> int:
        """Elements per token of the K and V blocks that ring attention passes around."""
        return self.block.ring_kv_elements_per_token

    @property
    def pp_elements_per_token(self) -> int:
        """Elements per token sent between pipeline stages of the trunk (the hidden state)."""
        return self.hidden

    def carried_elements(self, layer: int, seq_len: int) -> float:
        """Elements per sample that arrive at layer `layer` from the layer before it (from the embedding at
        layer 0): what a pipeline boundary or a re-layout there moves, as the runtime carries it
        (`plait.models`). An encoder-decoder carries the encoder's and the decoder's states side by side
        (2 x seq_len x hidden). Up to the projector a vision model carries the image (the pixels into the
        patch embedding, then the tower's tokens) and the embeddings of the text tokens after the image;
        the projector hands the text model all seq_len positions."""
        if self.family == "t5":
            return float(2 * seq_len * self.hidden)
        first = self.stack[0]
        text = (seq_len - self.image_tokens) * self.hidden  # the text embeddings a vision tower carries along
        if layer == 0:
            if first.kind == "patch_embed":
                return float(stacks.image_patches(first) * first.in_dim + text)
            return float(first.seq(seq_len) * self.hidden)
        prev = self.stack[layer - 1]
        if prev.kind in ("patch_embed", "vision"):
            return float(prev.seq(seq_len) * prev.hidden + text)
        if prev.kind == "projector":
            return float(seq_len * prev.hidden)
        return float(prev.seq(seq_len) * prev.hidden)

    @cached_property
    def image_tokens(self) -> int:
        """Positions of every sequence an image takes (a vision model's projector outputs; 0 without)."""
        return next((b.seq(0) for b in self.stack if b.kind == "projector"), 0)

    # ---- parameters -------------------------------------------------------------------------
    @cached_property
    def embedding_params(self) -> int:
        """Token embedding (+ learned position table)."""
        return self.vocab * self.hidden + (self.max_seq_len * self.hidden if self.learned_positions else 0)

    @cached_property
    def head_params(self) -> int:
        """Final norm (T5: the encoder's and the decoder's) + LM projection (0 extra weights when tied)."""
        norm_params = (2 if self.norm == "layernorm" else 1) * self.hidden * (2 if self.family == "t5" else 1)
        return norm_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @cached_property
    def params(self) -> int:
        """All parameters."""
        return self.embedding_params + sum(b.params * n for b, n in self.block_counts) + self.head_params

    @cached_property
    def active_params(self) -> int:
        """Parameters one token goes through (top-k experts of moe layers)."""
        return self.embedding_params + sum(b.active_params * n for b, n in self.block_counts) + self.head_params

    @cached_property
    def block_counts(self) -> tuple[tuple[Block, int], ...]:
        """(layer, how many times it occurs) of each distinct layer, in order of first appearance."""
        counts: dict[Block, int] = {}
        for b in self.stack:
            counts[b] = counts.get(b, 0) + 1
        return tuple(counts.items())

    # ---- FLOPs --------------------------------------------------------------------------------
    @cached_property
    def head_flops_per_token(self) -> int:
        """Forward FLOPs per token of the LM projection."""
        return 2 * self.hidden * self.vocab

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the sequence without recomputation (forward + 2x for backward).

        For GPT shapes this is Megatron's 72*l*h^2*(1 + s/(6h) + V/(12lh)) per token. Layers that run on
        other tokens (a vision tower's patches) count per sequence, spread over its `seq_len` tokens; moe
        layers count their active experts (as Megatron does), and each multi-token-prediction module its layer,
        projection and head pass (as Megatron's num_floating_point_operations does).
        """
        per_sample = sum(b.flops_per_token(seq_len) * b.seq(seq_len) * n for b, n in self.block_counts)
        return 3 * (per_sample / seq_len + self.head_flops_per_token * (1 + self.mtp_layers))

    def with_(self, **changes: object) -> ModelSpec:
        """A copy with some fields changed; kv_heads, ffn and head_dim that were derived from the old
        shape are derived again from the new one unless given."""
        derived = {
            "kv_heads": self.kv_heads == self.heads,
            "head_dim": self.head_dim * self.heads == self.hidden,
            "ffn": self.ffn == 4 * self.hidden and not self.gated_mlp,
        }
        for name, was_derived in derived.items():
            if was_derived and name not in changes:
                changes[name] = 0
        if self.gated_mlp and "ffn" not in changes and "hidden" in changes:
            changes["ffn"] = llama_ffn(int(changes["hidden"]))  # type: ignore[call-overload]
        return replace(self, **changes)  # type: ignore[arg-type]


def llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's default SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023)."""
    ffn = int(2 * 4 * hidden / 3)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelSpec:
    return ModelSpec(name=name, family="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                     max_seq_len=seq)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq: int) -> ModelSpec:
    return ModelSpec(name=name, family="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn=ffn, vocab=vocab, max_seq_len=seq, gated_mlp=True, norm="rmsnorm", bias=False,
                     dropout=False, tied_embeddings=False, learned_positions=False)


def _gemma2(name: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int,
            window: int) -> ModelSpec:
    """Gemma 2: GeGLU, four norms per layer, tied embeddings, local and global layers alternating."""
    base = replace(_llama(name, layers, hidden, heads, kv_heads, ffn, vocab, 8192), head_dim=head_dim,
                   tied_embeddings=True)
    return replace(base, mixed=stacks.windowed(base.block.with_(norms=4), layers, window, global_every=2))


def _moe(name: str, dense: ModelSpec, attention: dict[str, int] | None = None, **moe: int | Gating) -> ModelSpec:
    """`dense` with MoE layers (see `stacks.moe_layers`); `attention` changes every layer's attention shape
    (latent attention's q_lora, kv_lora, rope_head_dim, v_head_dim; qk_norm)."""
    block = dense.block.with_(**attention) if attention else dense.block
    return replace(dense, name=name, mixed=stacks.moe_layers(block, dense.layers, **moe))


def _deepseek_v3(name: str = "deepseek-v3", heads: int = 128, vocab: int = 129280, experts: int = 256,
                 dense_first: int = 3, expert_groups: int = 8, group_top_k: int = 4, mtp: int = 0,
                 gating: Gating = DEEPSEEK_V3_GATING) -> ModelSpec:
    """DeepSeek-V3 (671B, 37B active; its config.json): multi-head latent attention, 3 dense layers, then
    256 routed experts (top 8, from the best 4 of 8 groups: n_group, topk_group) and one shared expert per layer;
    `mtp` multi-token-prediction modules after them (its config's num_nextn_predict_layers: 1; frameworks train
    it when asked, Megatron with --mtp-num-layers). Kimi K2 is the same shape with other head, vocabulary,
    expert and dense-layer counts, no expert groups and its own routed scale."""
    base = replace(_llama(name, 61, 7168, heads, heads, 18432, vocab, 4096), head_dim=128)
    model = _moe(name, base, attention={"q_lora": 1536, "kv_lora": 512, "rope_head_dim": 64, "v_head_dim": 128},
                 experts=experts, top_k=8, expert_ffn=2048, shared_ffn=2048, dense_first=dense_first,
                 expert_groups=expert_groups, group_top_k=group_top_k, gating=gating)
    return replace(model, mixed=stacks.with_mtp(model.stack, mtp)) if mtp else model


def _qwen3_moe(name: str, layers: int, hidden: int, heads: int, kv_heads: int, experts: int, top_k: int,
               expert_ffn: int) -> ModelSpec:
    """Qwen3 MoE (config.json): 128-dim heads with q/k norms, every layer MoE, no shared experts, untied
    embeddings."""
    base = replace(_llama(name, layers, hidden, heads, kv_heads, 6144, 151936, 40960), head_dim=128)
    return _moe(name, base, attention={"qk_norm": True}, experts=experts, top_k=top_k, expert_ffn=expert_ffn)


def _gpt_oss(name: str, layers: int, experts: int, hidden: int = 2880, heads: int = 64, kv_heads: int = 8,
             head_dim: int = 64, vocab: int = 201088, seq: int = 131072, window: int = 128, top_k: int = 4,
             rope: bool = True) -> ModelSpec:
    """GPT-OSS (config.json): 64 heads of 64 dims with biases and attention sinks, sliding-window (128) and full
    attention alternating, every layer MoE with a biased router and biased experts of width 2880 (clamped
    SwiGLU, swiglu_limit 7), top 4; RoPE base 150000 stretched 32 times by YaRN (`rope`)."""
    base = replace(_llama(name, layers, hidden, heads, kv_heads, hidden, vocab, seq), head_dim=head_dim,
                   qkv_bias=True, out_bias=True, mlp_bias=True, norm_eps=1e-5)
    if rope:
        base = replace(base, rope_theta=150000.0, rope_scaling=(
            ("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0), ("original_max_position_embeddings", 4096.0),
            ("rope_type", "yarn"), ("truncate", 0.0)))
    block = base.block.with_(sinks=True, swiglu_limit=GPT_OSS_SWIGLU_LIMIT)
    moe = stacks.moe_layers(block, layers, experts, top_k, hidden, gating=Gating(router_bias=True))
    local = stacks.windowed(block, layers, window, local=tuple(i % 2 == 0 for i in range(layers)))
    return replace(base, mixed=tuple(m.with_(window=w.window) for m, w in zip(moe, local, strict=True)))


GPT_OSS_SWIGLU_LIMIT = 7.0
"""GPT-OSS's config.json swiglu_limit."""


def _t5(name: str, encoder_layers: int, decoder_layers: int, hidden: int, heads: int, head_dim: int, ffn: int,
        vocab: int, gated: bool = False, tied: bool = True, seq: int = 512) -> ModelSpec:
    """T5 (Raffel et al. 2020): RMS norms, no biases, ReLU MLP (gated GeLU in v1.1), relative position
    biases (a few thousand parameters, not counted), one embedding shared by encoder and decoder."""
    base = ModelSpec(name=name, family="t5", layers=encoder_layers + decoder_layers, hidden=hidden, heads=heads,
                     head_dim=head_dim, ffn=ffn, vocab=vocab, max_seq_len=seq, gated_mlp=gated, norm="rmsnorm",
                     bias=False, dropout=True, tied_embeddings=tied, learned_positions=False)
    return replace(base, mixed=stacks.encoder_decoder(base.block, encoder_layers, decoder_layers))


def _with_vision(name: str, text: ModelSpec, tower: str) -> ModelSpec:
    """LLaVA: a vision tower and projector in front of the language model `text`."""
    vision = stacks.vision_stack(stacks.VISION_TOWERS[tower], text.hidden)
    return replace(text, name=name, family="llava", mixed=vision + text.stack)


PRESETS: dict[str, ModelSpec] = {
    # GPT-3 shapes (Brown et al. 2020, Table 2.1) with Megatron's padded vocabulary of 51200.
    "gpt3-1.3b": _gpt("gpt3-1.3b", 24, 2048, 16),
    "gpt3-2.7b": _gpt("gpt3-2.7b", 32, 2560, 32),
    "gpt3-6.7b": _gpt("gpt3-6.7b", 32, 4096, 32),
    "gpt3-13b": _gpt("gpt3-13b", 40, 5120, 40),
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96),
    # Llama 2 (Touvron et al. 2023) and Llama 3 / 3.1 (Dubey et al. 2024) as in their config.json files.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # Models of several layer kinds (their config.json files): sliding-window attention on every layer
    # (Mistral 7B v0.1) or on every other one (Gemma 2 9B); a first dense layer before MoE layers
    # (DeepSeekMoE 16B); an encoder-decoder (T5 11B); a CLIP ViT-L/14-336 tower with LLaVA's projector
    # in front of Llama 3 8B (LLaVA-NeXT 8B).
    "mistral-7b": replace(_llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768), window=4096),
    "gemma2-9b": _gemma2("gemma2-9b", 42, 3584, 16, 8, 256, 14336, 256000, window=4096),
    "deepseek-moe-16b": _moe("deepseek-moe-16b", _llama("deepseek-moe-16b", 28, 2048, 16, 16, 10944, 102400, 4096),
                             experts=64, top_k=6, expert_ffn=1408, shared_ffn=2 * 1408, dense_first=1),
    "t5-11b": _t5("t5-11b", 24, 24, 1024, 128, 128, 65536, 32128),
    # Mixture-of-experts models (their config.json files).
    "mixtral-8x7b": _moe("mixtral-8x7b", _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768),
                         experts=8, top_k=2, expert_ffn=14336),
    "mixtral-8x22b": _moe("mixtral-8x22b", _llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 65536),
                          experts=8, top_k=2, expert_ffn=16384),
    "qwen3-30b-a3b": _qwen3_moe("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 8, 768),
    "qwen3-235b-a22b": _qwen3_moe("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 8, 1536),
    "deepseek-v3": _deepseek_v3(),
    "deepseek-v3-mtp": _deepseek_v3("deepseek-v3-mtp", mtp=1),  # with its multi-token-prediction module
    # Kimi K2 (moonshotai/Kimi-K2-Base config.json): DeepSeek-V3's layer with 64 heads, 384 routed experts and
    # one dense layer first.
    "kimi-k2": _deepseek_v3("kimi-k2", heads=64, vocab=163840, experts=384, dense_first=1, expert_groups=0,
                            group_top_k=0, gating=replace(DEEPSEEK_V3_GATING, scale=2.827)),
    "gpt-oss-20b": _gpt_oss("gpt-oss-20b", 24, 32),
    "gpt-oss-120b": _gpt_oss("gpt-oss-120b", 36, 128),
    "llava-llama3-8b": _with_vision("llava-llama3-8b", _llama("llava-llama3-8b", 32, 4096, 32, 8, 14336, 128256,
                                                              8192), "clip-l14-336"),
    # Tiny models for tests and CPU runs.
    "tiny-gpt": _gpt("tiny-gpt", 4, 128, 4, vocab=512, seq=256),
    "tiny-llama": _llama("tiny-llama", 4, 128, 4, 2, 384, 512, 256),
    "tiny-t5": _t5("tiny-t5", 2, 2, 64, 4, 0, 256, 512, seq=256),
    "tiny-llava": _with_vision("tiny-llava", _llama("tiny-llava", 2, 128, 4, 2, 384, 512, 256), "tiny-vit"),
    "tiny-moe": _moe("tiny-moe", _llama("tiny-moe", 4, 64, 4, 2, 192, 512, 256), experts=8, top_k=2, expert_ffn=64,
                     shared_ffn=64, dense_first=1),
    "tiny-deepseek": _moe("tiny-deepseek", replace(_llama("tiny-deepseek", 4, 64, 4, 4, 192, 512, 256), head_dim=16),
                          attention={"q_lora": 32, "kv_lora": 16, "rope_head_dim": 8, "v_head_dim": 16}, experts=8,
                          top_k=2, expert_ffn=64, shared_ffn=64, dense_first=1, expert_groups=4, group_top_k=2,
                          gating=DEEPSEEK_V3_GATING),
    "tiny-gpt-oss": _gpt_oss("tiny-gpt-oss", 4, 8, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=512, seq=256,
                             window=16, top_k=2, rope=False),
}

_INLINE_KEYS = {
    "layers": "layers", "hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads", "ffn": "ffn",
    "vocab": "vocab", "seq": "max_seq_len", "max_seq_len": "max_seq_len", "head_dim": "head_dim",
    "attention": "attention", "dropout": "dropout", "tied": "tied_embeddings",
}
_STACK_KEYS = ("window", "global_every", "experts", "top_k", "expert_ffn", "shared_ffn", "dense_first", "moe_every",
               "expert_groups", "group_top_k", "encoder_layers", "decoder_layers", "gated", "vision", "mtp",
               "q_lora", "kv_lora", "rope_head_dim", "v_head_dim", "qk_norm")
"""Inline keys that shape a mixed stack: sliding windows (every layer, or all but every global_every-th),
MoE layers (after dense_first dense ones, every moe_every-th; experts picked from the group_top_k best of
expert_groups groups when given), T5's encoder and decoder layer counts, a vision tower by name
(`plait.spec.stacks.VISION_TOWERS`), multi-token-prediction modules after the last layer (mtp), latent
attention on every layer (kv_lora, with q_lora, rope_head_dim and v_head_dim; head_dim is then each query/key
head's plain dims), Qwen3's per-head q/k norms on every layer (qk_norm=true)."""
_LATENT_KEYS = ("q_lora", "kv_lora", "rope_head_dim", "v_head_dim")
_FAMILIES = ("gpt", "llama", "t5")
_INLINE_EXAMPLES = {
    "gpt": "gpt:layers=32,hidden=4096,heads=32,vocab=32000",
    "llama": "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256",
    "t5": "t5:encoder_layers=24,decoder_layers=24,hidden=1024,heads=128,head_dim=128,ffn=65536,vocab=32128",
}


def _inline_value(text: str, key: str, raw: str) -> object:
    if key == "attention":
        if raw not in ("flash", "eager", "triton"):
            raise PlaitError(f"inline model {text!r}: attention must be flash, triton or eager, got {raw!r}")
        return raw
    if key == "vision":
        if raw not in stacks.VISION_TOWERS:
            raise PlaitError(f"inline model {text!r}: unknown vision tower {raw!r}; use one of "
                             f"{', '.join(stacks.VISION_TOWERS)}")
        return raw
    if key in ("dropout", "tied", "gated", "qk_norm"):
        if raw.lower() not in ("0", "1", "true", "false"):
            raise PlaitError(f"inline model {text!r}: {key} must be true or false, got {raw!r}")
        return raw.lower() in ("1", "true")
    try:
        return int(raw)
    except ValueError:
        raise PlaitError(f"inline model {text!r}: {key} must be an integer, got {raw!r}") from None


def parse_inline(text: str) -> ModelSpec:
    """Parse `gpt:layers=..,hidden=..,heads=..,vocab=..`, `llama:...,kv_heads=..,ffn=..` or
    `t5:encoder_layers=..,decoder_layers=..,...`; `_STACK_KEYS` make mixed stacks, e.g.
    `llama:...,window=4096,global_every=2` (Gemma-2's alternation) or `llama:...,experts=64,top_k=6,
    expert_ffn=1408,dense_first=1`."""
    family, _, body = text.partition(":")
    if family not in _FAMILIES:
        raise PlaitError(f"inline model {text!r} must start with 'gpt:', 'llama:' or 't5:'")
    values: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or (key not in _INLINE_KEYS and key not in _STACK_KEYS):
            raise PlaitError(f"inline model {text!r}: cannot read {item!r}; use key=value with keys "
                             + ", ".join(sorted([*_INLINE_KEYS, *_STACK_KEYS])))
        if key in values or _INLINE_KEYS.get(key, key) in values:
            raise PlaitError(f"inline model {text!r} gives {key} twice; give each key once")
        values[_INLINE_KEYS.get(key, key)] = _inline_value(text, key, raw.strip())
    if family == "t5":
        values.setdefault("layers", int(values.get("encoder_layers", 0)) + int(values.get("decoder_layers", 0)))
    missing = [k for k in ("layers", "hidden", "heads", "vocab") if not values.get(k)]
    if family == "t5":
        missing = [k for k in ("encoder_layers", "decoder_layers") if not values.get(k)] + \
            [k for k in missing if k != "layers"]
    if missing:
        raise PlaitError(f"inline model {text!r} lacks {', '.join(missing)}; give e.g. {_INLINE_EXAMPLES[family]}")
    shape = {k: values.pop(k) for k in _STACK_KEYS if k in values}
    if family == "gpt":
        model = ModelSpec(name=text, family="gpt", **values)  # type: ignore[arg-type]
    elif family == "t5":
        model = _t5(text, int(shape.pop("encoder_layers")), int(shape.pop("decoder_layers")),  # type: ignore[call-overload]
                    int(values["hidden"]), int(values["heads"]), int(values.get("head_dim", 0)),  # type: ignore[call-overload]
                    int(values.get("ffn", 0)) or 4 * int(values["hidden"]), int(values["vocab"]),  # type: ignore[call-overload]
                    gated=bool(shape.pop("gated", False)), tied=bool(values.get("tied_embeddings", True)),
                    seq=int(values.get("max_seq_len", 512)))  # type: ignore[call-overload]
    else:
        base = {"max_seq_len": 4096, **values}
        hidden = base.pop("hidden")
        model = replace(_llama(text, base.pop("layers"), hidden, base.pop("heads"),  # type: ignore[arg-type]
                               base.pop("kv_heads", 0), base.pop("ffn", 0) or llama_ffn(hidden),  # type: ignore[arg-type]
                               base.pop("vocab"), base.pop("max_seq_len")), **base)  # type: ignore[arg-type]
    return _shape_stack(text, model, shape)


def _shape_stack(text: str, model: ModelSpec, shape: dict[str, object]) -> ModelSpec:
    """`model` with the mixed-stack keys of an inline spec applied (see `_STACK_KEYS`)."""
    stack = model.stack
    if "window" in shape:
        window = int(shape.pop("window"))  # type: ignore[call-overload]
        every = int(shape.pop("global_every", 0))  # type: ignore[call-overload]
        stack = tuple(b.with_(window=window if not (every and (i + 1) % every == 0) else 0)
                      if b.has_attention else b for i, b in enumerate(stack))
    moe_keys = ("experts", "top_k", "expert_ffn", "shared_ffn", "dense_first", "moe_every", "expert_groups",
                "group_top_k")
    if any(k in shape for k in moe_keys):
        if model.family == "t5":
            raise PlaitError(f"inline model {text!r}: MoE keys apply to gpt and llama stacks only")
        missing = [k for k in ("experts", "top_k", "expert_ffn") if k not in shape]
        if missing:
            raise PlaitError(f"inline model {text!r}: MoE layers need {', '.join(missing)} too; give e.g. "
                             "experts=64,top_k=6,expert_ffn=1408")
        moe = {k: int(shape.pop(k)) for k in moe_keys if k in shape}  # type: ignore[call-overload]
        moe["every"] = moe.pop("moe_every", 1)
        mixed = stacks.moe_layers(model.block, model.layers, **moe)
        stack = tuple(m if m.kind == "moe" else b for m, b in zip(mixed, stack, strict=True))
    if any(k in shape for k in _LATENT_KEYS):
        if model.family != "llama":
            raise PlaitError(f"inline model {text!r}: latent attention keys apply to llama stacks")
        if "kv_lora" not in shape:
            raise PlaitError(f"inline model {text!r}: latent attention needs kv_lora too; give e.g. "
                             "q_lora=1536,kv_lora=512,rope_head_dim=64,v_head_dim=128")
        latent = {k: int(shape.pop(k)) for k in _LATENT_KEYS if k in shape}  # type: ignore[call-overload]
        stack = tuple(b.with_(**latent) for b in stack)
    if shape.pop("qk_norm", False):
        if model.family != "llama" or any(b.latent for b in stack):
            raise PlaitError(f"inline model {text!r}: qk_norm (Qwen3's q/k norms) applies to llama stacks without "
                             "latent attention")
        stack = tuple(b.with_(qk_norm=True) for b in stack)
    if "mtp" in shape:
        if model.family == "t5":
            raise PlaitError(f"inline model {text!r}: mtp (multi-token prediction) applies to gpt and llama stacks")
        stack = stacks.with_mtp(stack, int(shape.pop("mtp")))  # type: ignore[call-overload]
    if "vision" in shape:
        stack = stacks.vision_stack(stacks.VISION_TOWERS[str(shape.pop("vision"))], model.hidden) + stack
        model = replace(model, family="llava")
    if shape:
        raise PlaitError(f"inline model {text!r}: {', '.join(shape)} needs "
                         + ("window" if "global_every" in shape else "encoder_layers and decoder_layers (t5:)"))
    return replace(model, mixed=stack) if stack != model.stack else model


def from_hf_config(config: dict, name: str = "hf") -> ModelSpec:
    """ModelSpec from a Hugging Face `config.json` (`plait.spec.hf_config`)."""
    from plait.spec.hf_config import from_hf_config as read

    return read(config, name)


def load_model(ref: str) -> ModelSpec:
    """A ModelSpec from a preset name, a path to a Hugging Face config.json, or an inline spec."""
    if ref in PRESETS:
        return PRESETS[ref]
    if ref.startswith(tuple(f"{f}:" for f in _FAMILIES)):
        return parse_inline(ref)
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise PlaitError(f"model config {str(path)!r} does not exist; give a preset name "
                             "(see `plait models`), a config.json path or an inline spec")
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlaitError(f"cannot read {str(path)!r} as JSON ({exc}); give a Hugging Face config.json")
        if not isinstance(config, dict):
            raise PlaitError(f"{str(path)!r} is not a JSON object; give a Hugging Face config.json")
        return from_hf_config(config, name=path.parent.name or path.stem)
    raise PlaitError(
        f"unknown model {ref!r}; use a preset ({', '.join(PRESETS)}), a config.json path, "
        "or an inline spec such as llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256"
    )


def field_names() -> list[str]:
    """Field names of ModelSpec (for tables)."""
    return [f.name for f in fields(ModelSpec)]
