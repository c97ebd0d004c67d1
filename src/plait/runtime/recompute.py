"""Recompute everything in a block except its attention core (`recompute=attn_kept`, MEMO's layer plan).

MEMO (Zhao et al., SIGMOD 2025) keeps each layer's input and its FlashAttention output for backward and
recomputes the rest of the layer, so backward never runs the attention forward again. Here that is
PyTorch's selective activation checkpoint (`torch.utils.checkpoint.create_selective_checkpoint_contexts`,
as torchtitan's op-level SAC): checkpoint keeps the block's input, and the policy keeps the outputs of the
scaled-dot-product attention ops (the output and its log-sum-exp), so that in backward the GEMMs, norms,
activations and the Ulysses all-to-alls run again, and the attention's backward reads the kept output and
log-sum-exp with the recomputed queries, keys and values.

Swapping: checkpoint saves the block input through the saved-tensor hooks, which `plait.runtime.swap` cuts
token-wise; the kept attention outputs live in SAC's cache, whose storage is `plait.runtime.swap.cache_storage`
(as selective recomputation's): each kept tensor is cut by the running block's swap and counted by its meter
as it is stored, and joined again when the recomputation reads it. Attention that is not a fused kernel (ring
attention, an eager core) is recomputed like everything else: correct, but not kept; `plait.executable`
refuses attn_kept with ring attention.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plait.runtime.swap import cache_storage

KEPT_OPS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(torch.ops.aten, name)}
"""The fused attention kernels F.scaled_dot_product_attention dispatches to (CUDA flash, memory-efficient
and cuDNN; the CPU flash kernel): their outputs (attention output, log-sum-exp, the kernel's seeds) are
kept."""


def keep_attention(_ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """SAC policy of attn_kept: keep the attention kernels' outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def contexts() -> tuple:
    """checkpoint's `context_fn` for attn_kept: `create_selective_checkpoint_contexts(keep_attention)` with
    the cache the running block's swap cuts (`cache_storage`)."""
    caching, cached = create_selective_checkpoint_contexts(keep_attention)
    caching.storage = cached.storage = cache_storage()
    return caching, cached
