"""The transformer shared by every family, and Llama on top of it (torchtitan style).

Shapes: B batch, T sequence, H hidden, V vocabulary, D head_dim. Names are fixed so that the runtime can
parallelise any family alike:

    tok_embeddings [V, H] -> (pos_embeddings [max_seq_len, H], GPT only)
    layers["0".."L-1"]: attention_norm, attention (wq, wk, wv, wo), ffn_norm, feed_forward (w1, w2[, w3])
        (+ cross_attention_norm, cross_attention in T5's decoder layers; see plait.models.t5 and .vision)
    norm -> output [H -> V]

Any of `tok_embeddings`, `norm`, `output` may be set to None and entries of `layers` deleted, as pipeline
stages do: without `tok_embeddings` the input is already the state the layers carry ([B, T, H] for
decoder-only models; `embed` makes it, `readout` turns the last one into the head's [B, T, H]; a stage that
drops the embedding should drop `pos_embeddings` too); without `norm`/`output` the forward returns the
carried state.

RoPE follows Hugging Face's "rotate_half" convention (the two halves of each head are the pairs, not
interleaved neighbours as in Meta's original code): HF's conversion script permutes q/k weights into that
layout, so weights from HF Llama checkpoints load unchanged. Its base and scaling come from config.json
(linear, Llama 3.1's "llama3" and YaRN scaling applied; `SCALED_ROPE`). Qwen3's per-head q/k norms
(`Block.qk_norm`) run on the projected heads before RoPE.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from plait.models.dropped import Dropped
from plait.models.recomputed import recomputed
from plait.spec.layers import SWIGLU_ALPHA, Block
from plait.spec.model import ModelSpec


def rope_cache(head_dim: int, max_seq_len: int, theta: float = 10000.0, device: torch.device | str | None = None,
               scaling: tuple[tuple[str, float | str], ...] = ()) -> Tensor:
    """cos/sin of every (position, channel): float32 [max_seq_len, 2, D]; [:, 0] = cos, [:, 1] = sin; the
    frequencies scaled as `scaling` (config.json's rope_scaling pairs) says (`scaled_frequencies`)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    table = dict(scaling)
    inv_freq = scaled_frequencies(inv_freq, table, theta, max_seq_len)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # HF layout: channel i and i + D/2 share a frequency
    return torch.stack([angles.cos(), angles.sin()], dim=1) * yarn_attention_factor(table, max_seq_len)


SCALED_ROPE = ("linear", "llama3", "yarn")
"""RoPE scalings the runtime applies (Hugging Face's rope_type); others leave the frequencies as they are."""


def rope_kind(scaling: dict[str, float | str]) -> object:
    """The kind of a config's RoPE scaling (Hugging Face's rope_type, or transformers 4's older `type`)."""
    return scaling.get("rope_type", scaling.get("type"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (its Eq. 21; 1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(scaling: dict[str, float | str], max_seq_len: int) -> float:
    """YaRN's stretch: `factor`, else max_position_embeddings over original_max_position_embeddings."""
    if scaling.get("factor"):
        return float(scaling["factor"])
    return max_seq_len / float(scaling.get("original_max_position_embeddings") or max_seq_len)


def yarn_attention_factor(scaling: dict[str, float | str], max_seq_len: int) -> float:
    """The factor YaRN puts on RoPE's cos and sin (so on the rotated channels' scores twice): attention_factor,
    else mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are given, else mscale(factor), as
    Hugging Face's `_compute_yarn_parameters`; 1 for other scalings."""
    if rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor"):
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_seq_len)
    mscale, all_dims = float(scaling.get("mscale") or 0), float(scaling.get("mscale_all_dim") or 0)
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims) if mscale and all_dims else yarn_mscale(factor)


def yarn_score_scale(scaling: dict[str, float | str], max_seq_len: int) -> float:
    """Factor on every attention score that DeepSeek's latent attention takes from YaRN's mscale_all_dim,
    mscale(factor, mscale_all_dim)^2 (Hugging Face's `yarn_apply_mscale`); 1 without it."""
    all_dims = float(scaling.get("mscale_all_dim") or 0)
    if rope_kind(scaling) != "yarn" or not all_dims:
        return 1.0
    return yarn_mscale(_yarn_factor(scaling, max_seq_len), all_dims) ** 2


def _yarn_frequencies(inv_freq: Tensor, scaling: dict[str, float | str], theta: float, max_seq_len: int) -> Tensor:
    """YaRN's inverse frequencies: the high ones kept, the low ones divided by the stretch, a linear ramp between
    the dimensions that turn beta_fast and beta_slow times over the original context (ends rounded outwards
    unless `truncate` is off)."""
    dim = 2 * inv_freq.shape[0]
    factor = _yarn_factor(scaling, max_seq_len)
    original = float(scaling.get("original_max_position_embeddings") or max_seq_len)

    def turning_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turning_dim(float(scaling.get("beta_fast") or 32)), turning_dim(float(scaling.get("beta_slow") or 1))
    if float(scaling.get("truncate", 1.0)):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def scaled_frequencies(inv_freq: Tensor, scaling: dict[str, float | str], theta: float = 10000.0,
                       max_seq_len: int = 0) -> Tensor:
    """RoPE's inverse frequencies under a config's scaling: "linear" divides them by `factor`; "llama3" (Llama
    3.1's) divides the low ones (wavelengths beyond original_max_position_embeddings / low_freq_factor) by
    `factor`, keeps the high ones (below original / high_freq_factor) and blends in between, as Hugging Face's
    `_compute_llama3_parameters`; "yarn" as `_yarn_frequencies` (with the RoPE base `theta` and the config's
    `max_seq_len`); none (or another kind) leaves them."""
    kind = rope_kind(scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, scaling, theta, max_seq_len)
    if kind != "llama3":
        return inv_freq
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, blended, scaled)


def causal_mask(q_index: Tensor, k_index: Tensor, window: int = 0) -> Tensor:
    """Which keys each query may see: none later than itself and, with a sliding `window` (tokens; 0: every
    earlier one), only the `window` ending at itself (Mistral's and Hugging Face's convention). Bool
    [Tq, Tk] from the queries' and keys' places in the sequence ([Tq], [Tk])."""
    back = q_index[:, None] - k_index[None, :]
    return (back >= 0) & (back < window) if window else back >= 0


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension (halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate x [B, T, heads, D] by freqs [>=T, 2, D] (HF: x * cos + rotate_half(x) * sin)."""
    freqs = freqs[: x.shape[1]].to(x.dtype)
    cos, sin = freqs[:, 0, None, :], freqs[:, 1, None, :]  # [T, 1, D], broadcast over B and heads
    return x * cos + rotate_half(x) * sin


def rope_theta(spec: ModelSpec) -> float:
    """The spec's rope_theta if it has one, else Llama 3's 500000 for 128k vocabularies, else 10000."""
    theta = getattr(spec, "rope_theta", None)
    return float(theta) if theta else (500000.0 if spec.vocab >= 128000 else 10000.0)


def rope_dims(spec: ModelSpec) -> int:
    """Channels RoPE rotates in each query/key head: a latent-attention model's rotary dims
    (`plait.models.mla`), else the whole head."""
    return next((b.rope_head_dim for b in spec.stack if b.latent), spec.head_dim)


def copy_full_(param: Tensor, full: Tensor) -> None:
    """Copy a full (unsharded) tensor into `param`, which may be a DTensor (TP/FSDP2): each rank keeps its
    own shard, sliced locally without communication."""
    with torch.no_grad():
        if hasattr(param, "device_mesh"):  # DTensor
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(full.to_local())
        else:
            param.copy_(full)


RESIDUAL_OUTPUTS = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.experts.w2",
                    "feed_forward.shared.w2.weight")
"""Weights whose output is added to the residual stream (initialised with a smaller std)."""


class Attention(nn.Module):
    """Grouped-query self-attention, causal or bidirectional: x [B, T, H] -> [B, T, H]. Heads are inferred
    from the projection widths (`view(B, T, -1, D)`), so tensor parallelism can hand it a rank's local
    heads. `spec` is a ModelSpec or a layer's Block (the same width fields); its `window` (tokens; 0: global)
    limits each causal query to a sliding window of keys."""

    def __init__(self, spec: ModelSpec | Block, dropout: float = 0.0, causal: bool = True,
                 make_norm: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        self._core_settings(spec, dropout, causal)
        qkv_bias, out_bias = spec.bias or spec.qkv_bias, spec.bias or spec.out_bias
        self.wq = nn.Linear(spec.hidden, spec.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(spec.q_dim, spec.hidden, bias=out_bias)
        self.q_norm: nn.Module | None = None  # per-head norms of queries and keys (Qwen3; `Block.qk_norm`)
        self.k_norm: nn.Module | None = None
        if getattr(spec, "qk_norm", False):
            assert make_norm is not None, "q/k norms need the family's norm"
            self.q_norm, self.k_norm = make_norm(spec.head_dim), make_norm(spec.head_dim)

    def _core_settings(self, spec: ModelSpec | Block, dropout: float, causal: bool) -> None:
        """The attention core's head width, dropout, direction, sliding window and sinks (from `spec`)."""
        self.head_dim = spec.head_dim
        self.dropout = dropout
        self.causal = causal
        self.window = spec.window if causal else 0
        # a logit per query head in every softmax's denominator (GPT-OSS; `Block.sinks`), or None
        self.sinks = nn.Parameter(torch.zeros(spec.heads)) if getattr(spec, "sinks", False) else None

    column_parallel: tuple[str, ...] = ("wq", "wk", "wv")
    """The projections tensor parallelism splits by heads (column-wise; the output projection row-wise)."""

    recompute_core: bool = False
    """Set by the runtime for selective recomputation (Megatron-LM's): the attention core keeps only its
    queries, keys and values and runs again in backward (`plait.models.recomputed`). Ring attention, its own
    autograd function with K/V passes, is left as it is."""

    drop_heads: bool = False
    """Set by the runtime for Megatron-LM's `mla_up_proj` recompute (latent attention): the core's queries,
    keys and values are not kept for backward, which makes them again from the `sources` that stay kept (the
    up-projections and rotations run again, `plait.models.dropped`)."""

    tp_mesh: object | None = None
    """Set by the runtime under tensor parallelism (a 1-D DeviceMesh): weights applied whole to each rank's
    own heads (q/k norms, latent attention's shared rotary key) have their gradients summed over it
    (`summed_in_backward`)."""

    context_parallel: object | None = None
    """Set by the runtime for context parallelism: a `plait.runtime.ulysses.Ulysses` (sequence chunk -> head
    group, and back, over `degree` ranks, around the attention core) or a `plait.runtime.ring.RingContext`
    (the chunk stays; ring attention over the group)."""

    def forward(self, x: Tensor, freqs: Tensor | None = None, attend: Callable | None = None) -> Tensor:
        """x [B, T, H], freqs [>=T, 2, D] (RoPE) or None (no rotation) -> [B, T, H]. `attend(q, k, v)` over
        [B, heads, T, D] replaces the attention core (document masks of packed sequences, ring attention); it
        takes `window=` in sliding-window layers and `sinks=` in layers with attention sinks."""
        return self.attend_to(x, x, freqs, attend)

    def attend_to(self, x: Tensor, memory: Tensor, freqs: Tensor | None = None, attend: Callable | None = None
                  ) -> Tensor:
        """Queries from x [B, T, H], keys and values from memory [B, T, H] (x itself for self-attention)."""
        b, t, _ = x.shape
        sources = self.sources(x, memory)
        q, k, v = self.heads(sources, freqs)
        cp = self.context_parallel
        core = self._core(attend or (cp.attend if cp is not None else None))
        inputs = (q, k, v) if self.sinks is None else (q, k, v, self.head_sinks())
        recompute = self.recompute_core and (cp is None or cp.splits_heads)
        dropped = Dropped((q, k, v), lambda *kept: self.heads(kept, freqs), keep=sources) \
            if self.drop_heads and torch.is_grad_enabled() else nullcontext()  # q, k, v made again from sources
        with dropped:
            out = recomputed(core, *inputs) if recompute else core(*inputs)
        out = out.transpose(1, 2)
        if cp is not None:
            out = cp.to_sequence(out)
        return self.wo(out.reshape(b, t, -1))

    def sources(self, x: Tensor, memory: Tensor) -> tuple[Tensor, ...]:
        """What the heads are projected from (`heads`): here the attention's inputs, x and memory."""
        return x, memory

    def heads(self, sources: tuple[Tensor, ...], freqs: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The attention core's queries, keys and values [B, heads, T, D] from `sources`: projected, under
        context parallelism exchanged to this rank's heads (Ulysses), rotated, keys and values repeated for
        grouped queries."""
        q, k, v = self.project(*sources)
        if (cp := self.context_parallel) is not None:  # Ulysses: whole sequence, some heads; ring: the chunk
            if cp.splits_heads and k.shape[2] % cp.degree:  # fewer kv heads than ranks: share them out as query
                rep = q.shape[2] // k.shape[2]               # heads (as GQA reads)
                k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            q, k, v = cp.to_heads(q), cp.to_heads(k), cp.to_heads(v)
            freqs = cp.rope(freqs) if freqs is not None else None
        if freqs is not None:
            q, k = self.rotate(q, freqs), self.rotate(k, freqs)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, heads, T, D]
        if (rep := q.shape[1] // k.shape[1]) > 1:  # GQA: query head j reads kv head j // rep (as HF)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return q, k, v

    def project(self, x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries from x [B, T, H], keys and values from memory [B, T', H]: [B, T(' ), heads, D] each."""
        b, t, _ = x.shape
        m = memory.shape[1]
        q, k = self.wq(x).view(b, t, -1, self.head_dim), self.wk(memory).view(b, m, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.head_norm(self.q_norm, q), self.head_norm(self.k_norm, k)
        return q, k, self.wv(memory).view(b, m, -1, self.head_dim)

    def head_norm(self, norm: nn.Module, x: Tensor) -> Tensor:
        """x [B, T, heads, D] RMS-normed over D by `norm` (an nn.RMSNorm), its weight's gradient summed over
        the tensor-parallel group when the heads are split."""
        weight = norm.weight if self.tp_mesh is None else summed_in_backward(norm.weight, self.tp_mesh)
        return F.rms_norm(x, norm.normalized_shape, weight, norm.eps)

    def rotate(self, x: Tensor, freqs: Tensor) -> Tensor:
        """Queries or keys [B, T, heads, D] with their rotary positions applied (every channel here)."""
        return apply_rope(x, freqs)

    def head_sinks(self) -> Tensor:
        """The sinks of the query heads this rank's core computes [heads here]: its tensor-parallel share of
        them (the gradient of the whole vector summed over the tp group) and of that, under Ulysses, its
        context-parallel head group's (ring attention keeps every head)."""
        sinks = self.sinks
        if (mesh := self.tp_mesh) is not None:
            sinks = summed_in_backward(sinks, mesh).chunk(mesh.size())[mesh.get_local_rank()]
        if (cp := self.context_parallel) is not None and cp.splits_heads:
            sinks = sinks.chunk(cp.degree)[cp.rank]
        return sinks

    def _core(self, attend: Callable | None) -> Callable[..., Tensor]:
        """The attention core, q, k, v [B, heads, T, D] (and the heads' sinks [heads] where the layer has them)
        -> [B, heads, T, D]: `attend` (told the layer's window and sinks) or causal/bidirectional SDPA with the
        layer's window and dropout."""
        if attend is not None:  # a windowed layer tells the core its window, a layer with sinks its sinks
            def told(q: Tensor, k: Tensor, v: Tensor, *sinks: Tensor) -> Tensor:
                return attend(q, k, v, **({"window": self.window} if self.window else {}),
                              **({"sinks": sinks[0]} if sinks else {}))
            return told
        p = self.dropout if self.training else 0.0

        def sdpa(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
            place = torch.arange(q.shape[2], device=q.device)
            mask = causal_mask(place, place, self.window) if self.window else None
            if sinks is not None:
                return sdpa_with_sinks(q, k, v, sinks, mask, self.causal, p)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                  is_causal=self.causal and mask is None)
        return sdpa


def sdpa_with_sinks(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None, causal: bool,
                    dropout: float = 0.0) -> Tensor:
    """Attention whose softmax also counts a sink per head (GPT-OSS): q, k, v [B, heads, T, D], sinks [heads]
    (logits), mask [T, T] (bool, True: seen; None: causal or all as `causal` says) -> [B, heads, T, D].

    The sink is one more key that every query sees, with value 0, so SDPA's kernels run it: queries gain a
    channel of ones, keys a zero channel and the sink key sink / scale there (its score is the sink itself),
    all padded with zero channels to a multiple of 8, and the output drops them."""
    b, h, t, d = q.shape
    pad = 8 - d % 8
    scale = d ** -0.5
    q = torch.cat([q, q.new_ones(b, h, t, 1), q.new_zeros(b, h, t, pad - 1)], dim=-1)
    sink_key = F.pad(torch.cat([k.new_zeros(h, d), (sinks / scale).to(k.dtype)[:, None]], dim=-1), (0, pad - 1))
    k = torch.cat([F.pad(k, (0, pad)), sink_key[:, None].expand(b, h, 1, d + pad)], dim=2)
    v = F.pad(v, (0, pad, 0, 1))
    place = torch.arange(t, device=q.device)
    seen = mask if mask is not None else causal_mask(place, place) if causal else q.new_ones(t, t, dtype=torch.bool)
    seen = torch.cat([seen, seen.new_ones(t, 1)], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, dropout_p=dropout, scale=scale)
    return out[..., :d]


def summed_in_backward(x: Tensor, mesh: object) -> Tensor:
    """`x` (whole on every rank of `mesh`) in forward; in backward its gradient summed over the mesh, each
    rank's being the share of its own heads (Megatron's copy-to-tensor-parallel-region)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def swiglu(gate: Tensor, up: Tensor, limit: float = 0.0) -> Tensor:
    """SwiGLU's gated product silu(gate) * up; with a `limit` > 0, GPT-OSS's clamped form (`Block.swiglu_limit`):
    gate clamped to <= limit, up to [-limit, limit], gate * sigmoid(1.702 gate) * (up + 1)."""
    if not limit:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(SWIGLU_ALPHA * gate) * (up + 1)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x), [B, T, H] -> [B, T, H]; w1 gate, w3 up, w2 down (GPT-OSS's clamped
    SwiGLU where the layer sets a limit)."""

    def __init__(self, spec: ModelSpec | Block) -> None:
        super().__init__()
        bias = spec.bias or spec.mlp_bias
        self.limit = float(getattr(spec, "swiglu_limit", 0.0))
        self.w1 = nn.Linear(spec.hidden, spec.ffn, bias=bias)
        self.w3 = nn.Linear(spec.hidden, spec.ffn, bias=bias)
        self.w2 = nn.Linear(spec.ffn, spec.hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attention(norm(x))), then + drop(feed_forward(norm(.))). [B, T, H]."""

    drop_norms: bool = False
    """Set by the runtime for Megatron-LM's `layernorm` recompute: the norms' outputs (the attention's and the
    MLP's inputs) are not kept for backward, which runs the norms again (`plait.models.dropped`)."""

    recompute_mlp: bool = False
    """Set by the runtime for Megatron-LM's `mlp` recompute (dense MLPs): the MLP keeps only its input and
    runs again in backward (with `drop_norms` it keeps the block's residual input and runs the norm again)."""

    gathered: frozenset[str] = frozenset()
    """Set by the runtime under sequence parallelism: the modules whose input tensor parallelism gathers from
    the sequence shards ("attention", "feed_forward", ...). The block gathers it itself and keeps only the
    shard for backward, which gathers it again (`through`)."""

    def __init__(self, attention_norm: nn.Module, attention: Attention, ffn_norm: nn.Module,
                 feed_forward: nn.Module, dropout: float = 0.0) -> None:
        super().__init__()
        self.attention_norm, self.attention = attention_norm, attention
        self.ffn_norm, self.feed_forward = ffn_norm, feed_forward
        self.dropout = dropout

    def forward(self, x: Tensor, freqs: Tensor | None = None, attend: Callable | None = None) -> Tensor:
        more = (freqs,) if attend is None else (freqs, attend)  # tensor parallelism lays out exactly (x, freqs)
        h = x + self._drop(self.through(self.attention_norm, "attention", x, *more))
        return h + self._drop(self.through(self.ffn_norm, "feed_forward", h))

    def through(self, norm: nn.Module, name: str, x: Tensor, *more: object) -> Tensor:
        """The block's module `name` applied to norm(x) (and `more`), keeping for backward what the runtime's
        recompute settings say (`drop_norms`, `recompute_mlp`) and, where sequence parallelism gathers the
        module's input (`gathered`), its shard only, gathered again in backward as Megatron-LM's does."""
        module = getattr(self, name)
        if not torch.is_grad_enabled():
            return module(norm(x), *more)
        if self.recompute_mlp and name == "feed_forward":
            if self.drop_norms:  # the norm runs again with the MLP, from the block's own (kept) stream
                return checkpoint(lambda y: module(norm(y)), x, use_reentrant=False)
            return checkpoint(module, norm(x), use_reentrant=False)
        if self.drop_norms:  # the norm keeps only its input (its statistics go too, as Megatron's), and what
            # the module keeps of its output is made again from that input
            a = checkpoint(self._module_input, norm, name, x, use_reentrant=False)
            with Dropped(a, lambda y: self._module_input(norm, name, y), keep=(x,)):
                return module(a, *more)
        if name in self.gathered:
            shard = self._low(norm(x))
            with Dropped(a := self._gather(shard), self._gather, keep=(shard,)):
                return module(a, *more)
        return module(norm(x), *more)

    def _module_input(self, norm: nn.Module, name: str, x: Tensor) -> Tensor:
        """norm(x) as module `name` keeps it: in autocast's dtype and, where sequence parallelism gathers the
        module's input, gathered (`gathered`)."""
        a = self._low(norm(x))
        return self._gather(a) if name in self.gathered else a

    @staticmethod
    def _low(a: Tensor) -> Tensor:
        """`a` in autocast's dtype when autocast runs (cast once, as a bf16 model holds it, not once per
        projection: the projections' input gradients then add up in that dtype)."""
        device = a.device.type
        if torch.is_autocast_enabled(device) and a.dtype != (low := torch.get_autocast_dtype(device)):
            return a.to(low)
        return a

    @staticmethod
    def _gather(shard: Tensor) -> Tensor:
        """A sequence-parallel shard (a DTensor split along the sequence) gathered whole on every rank."""
        from torch.distributed.tensor import Replicate

        return shard.redistribute(placements=[Replicate()])  # type: ignore[attr-defined]

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x


class Transformer(nn.Module):
    """Embedding -> blocks -> norm -> LM head; tokens [B, T] -> float logits [B, T, V].

    `make_norm` and `make_ffn` give the family's norm and MLP; `make_layer(i, block)`, when given, builds
    layer i of `spec.stack` instead of the trunk's decoder block (which takes the block's attention window).
    Positions: a learned table (`pos_embeddings`) when spec.learned_positions, else RoPE from the
    non-persistent `freqs_cis` buffer.
    """

    def __init__(self, spec: ModelSpec, make_norm: Callable[[], nn.Module],
                 make_ffn: Callable[[], nn.Module] | None, dropout: float = 0.0,
                 make_layer: Callable[[int, Block], nn.Module] | None = None) -> None:
        super().__init__()
        self.spec, self.n_layers = spec, spec.layers
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(spec.max_seq_len, spec.hidden) if spec.learned_positions else None)
        if make_layer is None:  # a decoder-only stack of the trunk's layer
            assert make_ffn is not None

            def make_layer(i: int, block: Block) -> nn.Module:
                attention = Attention(spec, dropout)
                attention.window = block.window  # the trunk's layer, local or global
                return TransformerBlock(make_norm(), attention, make_norm(), make_ffn(), dropout)
        self.layers = nn.ModuleDict({str(i): make_layer(i, block) for i, block in enumerate(spec.stack)})
        self.norm: nn.Module | None = make_norm()
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.mtp_embeddings: nn.Embedding | None = None  # the last stage's copy of the table, for MTP modules
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.freqs_cis: Tensor | None
        self.register_buffer("freqs_cis", None if spec.learned_positions else self._rope(), persistent=False)

    def _rope(self, device: torch.device | str | None = None) -> Tensor:
        return rope_cache(rope_dims(self.spec), self.spec.max_seq_len, rope_theta(self.spec), device,
                          self.spec.rope_scaling)

    sequence_slice: tuple[int, int] | None = None
    """Set by the runtime for context parallelism: the [start, end) token positions this rank keeps after
    the embedding (the rest of the model sees only its chunk of every sequence)."""

    relayouts: dict[str, Callable[[Tensor], Tensor]] | None = None
    """Set by the runtime where consecutive layers (or stages) split the hidden state differently: a
    function applied to the hidden state before each named layer."""

    @property
    def head_modules(self) -> list[nn.Module]:
        """The modules that go with the head (the last layers' strategy): the final norm, the LM projection
        and the multi-token-prediction modules' copy of the embedding table, those this chunk has."""
        return [m for m in (self.norm, self.output, self.mtp_embeddings) if m is not None]

    @property
    def holds_mtp(self) -> bool:
        """Whether this model (chunk) runs multi-token-prediction modules (`plait.models.mtp`): its forward
        then takes the micro-batch's targets as `next_tokens` and returns every depth's logits."""
        return self.output is not None and any(int(name) >= self.spec.trunk_layers for name in self.layers)

    def forward(self, tokens: Tensor, positions: Tensor | None = None, attend: Callable | None = None,
                next_tokens: Tensor | None = None) -> Tensor:
        """tokens [B, T] (or hidden [B, T, H] without tok_embeddings) -> logits float [B, T, V] (or hidden);
        with multi-token-prediction modules (`holds_mtp`), given `next_tokens` [B, T] (the targets), the
        trunk's and every module's logits, [1 + D, B, T, V] (`plait.models.mtp`).

        Packed variable-length batches give `positions` [T] (each token's place in its own document: the
        RoPE angle or learned position of every token the attention core sees) and `attend`, the attention
        core that keeps documents apart (see `Attention.forward`)."""
        h = tokens
        freqs = self.freqs_cis if positions is None or self.freqs_cis is None else self.freqs_cis[positions]
        if self.tok_embeddings is not None:
            h = self.embed(tokens, positions)
            if self.sequence_slice is not None:
                h = h[:, self.sequence_slice[0]: self.sequence_slice[1]]
        modules = []
        for name, layer in self.layers.items():
            if int(name) >= self.spec.trunk_layers:
                modules.append(layer)
                continue
            if self.relayouts and name in self.relayouts:
                h = self.relayouts[name](h)
            h = layer(h, freqs) if attend is None else layer(h, freqs, attend)
        if self.output is None:
            return h
        h = self.readout(h)
        if self.norm is not None:
            h = self.norm(h)
        logits = self.output(h).float()
        if not modules:
            return logits
        if next_tokens is None:
            raise ValueError("a model with multi-token-prediction modules needs next_tokens (the targets)")
        table = self.mtp_embeddings if self.mtp_embeddings is not None else self.tok_embeddings
        outputs = [logits]
        for k, module in enumerate(modules):  # depth k + 1 reads the token k + 1 ahead: next_tokens[i + k]
            h = module(h, freqs, embedded=table(next_tokens.roll(-k, dims=1) if k else next_tokens))
            outputs.append(self.output(h).float())
        return torch.stack(outputs)

    def embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """tokens [B, T] -> the state the first layer reads: hidden [B, T, H] (+ learned positions)."""
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            where = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
            h = h + self.pos_embeddings(where)
        return h

    def readout(self, h: Tensor) -> Tensor:
        """The state the last layer hands over -> the hidden [B, T, H] the head reads (the same here)."""
        return h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init: N(0, 0.02) weights, N(0, 0.02/sqrt(2L)) for wo and w2, zero biases (and MoE
        routers' choice biases), unit norms.

        Every parameter draws from its own CPU generator seeded by (seed, its name), so the result is
        bitwise the same whatever the device count, the global RNG state, the layers deleted by pipeline
        stages, or wrappers (checkpointing, torch.compile) around modules. Works on sharded DTensors and
        after `to_empty()` from the meta device (recomputes `freqs_cis`).
        """
        resid_std = 0.02 / math.sqrt(2 * self.n_layers)
        for name, param in self.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            if (name == "output.weight" and self.spec.tied_embeddings) or name == "mtp_embeddings.weight":
                name = "tok_embeddings.weight"  # the table's copy on a stage without the embedding
            if name.endswith("bias"):
                full = torch.zeros(param.shape)
            elif "norm" in name.split(".")[-2]:
                full = torch.ones(param.shape)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                std = resid_std if name.endswith(RESIDUAL_OUTPUTS) else 0.02
                full = torch.empty(param.shape).normal_(0.0, std, generator=gen)
            copy_full_(param, full.to(param.dtype))
        for name, buffer in self.named_buffers():
            if name.endswith("choice_bias"):  # a MoE router's bias on the choice: none to begin with
                buffer.zero_()
        if self.freqs_cis is not None:
            self.freqs_cis = self._rope(self.freqs_cis.device)


class Llama(Transformer):
    """Llama: RMSNorm, SwiGLU MLP, RoPE, no biases by default, untied head unless the spec ties it; the `moe`
    layers of a mixed stack get a mixture of experts (`plait.models.moe.MoE`) as their feed-forward, layers
    with latent attention (DeepSeek-V2/V3) `plait.models.mla.LatentAttention`."""

    def __init__(self, spec: ModelSpec, dropout: float = 0.0) -> None:
        eps = float(getattr(spec, "norm_eps", None) or 1e-5)

        def norm(width: int = spec.hidden) -> nn.Module:
            return nn.RMSNorm(width, eps=eps)

        scale = yarn_score_scale(dict(spec.rope_scaling), spec.max_seq_len)  # latent attention's scores

        def make_layer(i: int, block: Block) -> TransformerBlock:
            from plait.models.mla import LatentAttention
            from plait.models.moe import MoE
            from plait.models.mtp import MTPLayer

            ffn = MoE(block) if block.kind == "moe" else FeedForward(block)
            attention = LatentAttention(block, norm, dropout, scale) if block.latent else \
                Attention(block, dropout, make_norm=norm)
            layer = TransformerBlock(norm(), attention, norm(), ffn, dropout)
            return MTPLayer(layer, norm, block.hidden) if block.mtp else layer

        super().__init__(spec, norm, lambda: FeedForward(spec), dropout, None if spec.uniform else make_layer)
