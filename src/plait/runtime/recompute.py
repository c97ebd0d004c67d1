"""Recompute everything in a block except its attention core (`recompute=attn_kept`, MEMO's layer plan).

MEMO (Zhao et al., SIGMOD 2025) keeps each layer's input and its FlashAttention output for backward and
recomputes the rest of the layer, so backward never runs the attention forward again. Here that is
PyTorch's selective activation checkpoint (`torch.utils.checkpoint.create_selective_checkpoint_contexts`,
as torchtitan's op-level SAC): checkpoint keeps the block's input, and the policy keeps the outputs of the
scaled-dot-product attention ops (the output and its log-sum-exp), so that in backward the GEMMs, norms,
activations and the Ulysses all-to-alls run again, and the attention's backward reads the kept output and
log-sum-exp with the recomputed queries, keys and values.

Swapping: checkpoint saves the block input through the saved-tensor hooks, which `plait.runtime.swap`
cuts token-wise; the kept attention outputs live in SAC's cache instead, which this module's cache passes
through the running block's swap (`plait.runtime.swap.active`): the same token-wise cut, host copy and
count, and the same rebuild when the recomputation reads them. (`contexts` builds the two dispatch modes that
`create_selective_checkpoint_contexts` returns, from torch.utils.checkpoint's private classes as of torch
2.13, around a cache of its own.) Attention that is not a fused kernel (ring attention, an eager core) is
recomputed like everything else: correct, but not kept; `plait.executable` refuses attn_kept with ring
attention.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    _CONSUMED,
    _RECOMPUTE,
    _VersionWrapper,
)

from plait.runtime import swap

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


class _Swapped:
    """A cache entry's tensor as the running block's swap packed it (host part and kept part)."""

    def __init__(self, packed: object) -> None:
        self.packed = packed


class _Entries(dict):
    """SAC's cache of one op (invocation index -> outputs): the outputs go through the running block's swap
    when stored (cut token-wise to host and counted) and come back whole when read."""

    def __setitem__(self, idx: int, entry: object) -> None:
        layer = swap.active()
        if layer is not None and entry is not _RECOMPUTE and entry is not _CONSUMED:
            entry = tree_map(lambda w: _pack(layer, w), entry)
        super().__setitem__(idx, entry)

    def get(self, idx: int, default: object = None) -> object:
        entry = super().get(idx, default)
        if entry is _RECOMPUTE or entry is _CONSUMED or entry is None:
            return entry
        return tree_map(_unpack, entry)


def _pack(layer: swap._LayerSwap, w: object) -> object:
    if not isinstance(w, _VersionWrapper) or not isinstance(w.val, torch.Tensor) or not w.val.numel():
        return w
    packed = layer.pack(w.val)
    return w if packed is w.val else _Swapped(packed)


def _unpack(w: object) -> object:
    return _VersionWrapper(swap._LayerSwap.unpack(w.packed)) if isinstance(w, _Swapped) else w


def contexts() -> tuple[_CachingTorchDispatchMode, _CachedTorchDispatchMode]:
    """checkpoint's `context_fn` for attn_kept: `create_selective_checkpoint_contexts(keep_attention)` whose
    cache swaps what it keeps as the block's saved tensors are swapped."""
    storage: dict = defaultdict(_Entries)
    return _CachingTorchDispatchMode(keep_attention, storage), _CachedTorchDispatchMode(None, storage)

