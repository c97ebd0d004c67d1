"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents.

Shapes: B batch, T sequence, H hidden, N heads, Dn plain (no-rope) dims, Dr rotary dims, Dv value dims.

    queries  x -> wq_a [H -> q_lora] -> q_norm -> wq_b [q_lora -> N (Dn + Dr)]
             (wq [H -> N (Dn + Dr)] without a query latent)
    keys     x -> wkv_a [H -> kv_lora + Dr]: the latent -> kv_norm -> wkv_b [kv_lora -> N (Dn + Dv)]
             gives each head's plain key part and its value; wkv_a's last Dr channels are one rotary key
             that every head shares
    output   wo [N Dv -> H]

Each query/key head is its Dn plain channels followed by its Dr rotated ones; the core scales the scores by
1 / sqrt(Dn + Dr) (Hugging Face's DeepseekV3Attention and Megatron-LM's MLASelfAttention), times YaRN's
mscale(factor, mscale_all_dim)^2 under YaRN scaling (`score_scale`, applied to the queries). RoPE follows
plait's rotate_half layout (`plait.models.llama`); DeepSeek's checkpoints interleave the rotary channels, which
`plait.models.hf_weights` permutes on loading. Tensor parallelism splits the up-projections (wq_b or wq,
wkv_b) column-wise by heads and wo row-wise; the down-projections and the latent norms stay whole on every
rank, as Megatron-LM's do (`plait.runtime.parallelize.layer_tp_plan`), and
the shared rotary key's gradient is summed over the group (`tp_mesh`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from plait.models.llama import Attention, apply_rope, summed_in_backward
from plait.spec.layers import Block


class LatentAttention(Attention):
    """Causal multi-head latent attention: x [B, T, H] -> [B, T, H] (the block's `q_lora`, `kv_lora`,
    `head_dim` plain and `rope_head_dim` rotary dims per query/key head, `v_head_dim` per value head);
    `make_norm(width)` builds the latents' norms. Heads are inferred from the up-projections' widths, so
    tensor parallelism can hand it a rank's local heads."""

    def __init__(self, block: Block, make_norm: Callable[[int], nn.Module], dropout: float = 0.0,
                 score_scale: float = 1.0) -> None:
        nn.Module.__init__(self)
        self.score_scale = score_scale  # on every score (YaRN's mscale_all_dim folded in), through the queries
        self._core_settings(block, dropout, causal=True)
        self.head_dim = block.qk_head_dim  # the width the core sees per query/key head
        self.nope, self.rope_dim, self.v_dim = block.head_dim, block.rope_head_dim, block.v_head_dim
        self.kv_lora = block.kv_lora
        up_bias, out_bias = block.bias or block.qkv_bias, block.bias or block.out_bias
        if block.q_lora:
            self.wq_a = nn.Linear(block.hidden, block.q_lora, bias=False)
            self.q_norm = make_norm(block.q_lora)
            self.wq_b = nn.Linear(block.q_lora, block.heads * block.qk_head_dim, bias=up_bias)
        else:
            self.wq = nn.Linear(block.hidden, block.heads * block.qk_head_dim, bias=up_bias)
        self.wkv_a = nn.Linear(block.hidden, block.kv_lora + block.rope_head_dim, bias=False)
        self.kv_norm = make_norm(block.kv_lora)
        self.wkv_b = nn.Linear(block.kv_lora, block.heads * (block.head_dim + block.v_head_dim), bias=up_bias)
        self.wo = nn.Linear(block.heads * block.v_head_dim, block.hidden, bias=out_bias)

    @property
    def column_parallel(self) -> tuple[str, ...]:  # type: ignore[override]
        """The up-projections, which tensor parallelism splits by heads (column-wise)."""
        return ("wq_b" if hasattr(self, "wq_b") else "wq", "wkv_b")

    def sources(self, x: Tensor, memory: Tensor) -> tuple[Tensor, ...]:
        """The down-projections of x [B, T, H] (self-attention only: `memory` is x): the queries' latent
        [B, T, q_lora] (without one, the queries themselves), the keys' and values' latent [B, T, kv_lora]
        and the shared rotary key [B, T, Dr]; the up-projections (`project`) read them."""
        q = self.wq_a(x) if hasattr(self, "wq_b") else self.wq(x)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora, self.rope_dim], dim=-1)
        return q, latent, k_rope

    def project(self, q: Tensor, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values from the `sources`: [B, T, N, Dn + Dr] twice (the shared rotary key
        repeated for every head) and [B, T, N, Dv]."""
        b, t, _ = latent.shape
        if hasattr(self, "wq_b"):
            q = self.wq_b(self.q_norm(q))
        q = q.view(b, t, -1, self.head_dim)
        if self.score_scale != 1.0:
            q = q * self.score_scale
        if self.tp_mesh is not None:
            k_rope = summed_in_backward(k_rope, self.tp_mesh)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, t, -1, self.nope + self.v_dim)
        k_plain, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_plain, k_rope[:, :, None, :].expand(b, t, k_plain.shape[2], self.rope_dim)], dim=-1)
        return q, k, v

    def rotate(self, x: Tensor, freqs: Tensor) -> Tensor:
        """Queries or keys [B, T, N, Dn + Dr] with their last Dr channels rotated (`freqs` of Dr channels)."""
        if not self.rope_dim:
            return x
        plain, rotary = x.split([self.nope, self.rope_dim], dim=-1)
        return torch.cat([plain, apply_rope(rotary, freqs)], dim=-1)
