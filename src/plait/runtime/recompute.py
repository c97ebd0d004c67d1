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
as it is stored, and joined again when the recomputation reads it. An eager attention core is recomputed like
everything else: correct, but not kept.

Ring attention (plait.runtime.ring) is its own autograd function, not a fused kernel: under attn_kept it runs
outside the recomputed region (`RingKeep`). In forward it saves its local queries, keys, values, fp32 output
and log-sum-exp under the running block's swap hooks (`plait.runtime.swap.running_hooks`) instead of
checkpoint's, so they are kept (or cut token-wise, as without recomputation); recomputation does not run it
(nor its K/V passes) but hands the recomputed output projection the kept output, read from the function's
saved tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import _pop_mode_temporarily
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plait.runtime.swap import cache_storage, running_hooks

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


class RingKeep:
    """One checkpointed block call's ring attention calls under attn_kept: the autograd nodes of forward's
    calls, in order, which recomputation (`replaying`) reads their outputs back from."""

    def __init__(self) -> None:
        self.nodes: list[tuple[torch.autograd.graph.Node, torch.dtype]] = []
        self.replaying = False
        self.next = 0

    def run(self, apply: object, dtype: torch.dtype) -> torch.Tensor:
        """Forward: `apply()` (the ring function) with its saved tensors under the block's swap hooks, kept;
        recomputation: the output the matching forward call returned, from its node's saved tensors."""
        # outside the SAC mode (the innermost dispatch mode here), which matches every op recomputation runs
        # with one of forward's: neither run counts the ring's ops
        with _pop_mode_temporarily():
            if self.replaying:
                node, out_dtype = self.nodes[self.next]
                self.next += 1
                # saved (q, k, v, out, lse): out in fp32, cast as the function returned it; requiring grad as
                # the original did, so that the recomputed layer saves the same tensors
                return node.saved_tensors[3].to(out_dtype).detach().requires_grad_(True)
            with running_hooks():
                out = apply()  # type: ignore[operator]
        self.nodes.append((out.grad_fn, out.dtype))
        return out


_KEEPING: list[RingKeep] = []
"""The RingKeep of the checkpointed block running forward or recomputing (innermost last)."""


def ring_keep() -> RingKeep | None:
    """The running attn_kept block's RingKeep, or None outside attn_kept (ring attention then runs as usual)."""
    return _KEEPING[-1] if _KEEPING else None


@contextmanager
def _keeping(keep: RingKeep, replaying: bool, mode: object) -> Iterator[None]:
    """`mode` (an SAC dispatch mode) with `keep` running: recording (forward) or replaying (recomputation)."""
    with mode:  # type: ignore[attr-defined]
        keep.replaying, keep.next = replaying, 0
        _KEEPING.append(keep)
        try:
            yield
        finally:
            _KEEPING.remove(keep)


def contexts() -> tuple:
    """checkpoint's `context_fn` for attn_kept: `create_selective_checkpoint_contexts(keep_attention)` with
    the cache the running block's swap cuts (`cache_storage`), and ring attention kept (`RingKeep`)."""
    caching, cached = create_selective_checkpoint_contexts(keep_attention)
    caching.storage = cached.storage = cache_storage()
    keep = RingKeep()
    return _keeping(keep, False, caching), _keeping(keep, True, cached)
