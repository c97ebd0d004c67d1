"""Apply one layer strategy to a model chunk with PyTorch's own parallelism, one small function each.

Order (as torchtitan): tensor/sequence parallel (DTensor `parallelize_module`), then activation
recomputation (`checkpoint_wrapper`), then data parallel: DDP-style `replicate` for ZeRO-0, FSDP2
`fully_shard` for ZeRO-1/2/3 (parameters resharded after forward only for ZeRO-3).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._composable.replicate import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plait.plan import Strategy
from plait.runtime.ulysses import heads_to_seq, seq_to_heads


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    """Megatron tensor parallelism on every block (q/k/v and MLP-in column-wise, out and MLP-down
    row-wise), vocabulary-parallel embedding and LM head; with `sp` norms and residuals run sequence-
    sharded and the hidden state between blocks is split along the sequence."""
    seq = Shard(1) if sp else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        tied = model.output is not None and model.tok_embeddings is not None and \
            model.output.weight is model.tok_embeddings.weight
        parallelize_module(model, tp_mesh, top)
        if tied:  # both became Shard(0) DTensors: share one parameter again
            model.output.weight = model.tok_embeddings.weight
    first = True
    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if hasattr(block.feed_forward, "w3"):
            plan["feed_forward.w3"] = ColwiseParallel()
        if sp:
            plan |= {
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
            if first and model.tok_embeddings is not None:  # the embedding hands over the full sequence
                plan[""] = PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None),
                                              use_local_output=True)
        first = False
        parallelize_module(block, tp_mesh, plan)


_GEMM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _keep_gemm_outputs(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Selective recomputation: keep the outputs of the block's GEMMs and recompute the rest, i.e. the
    attention core (Korthikanti et al.'s selective recompute) and the cheap elementwise work around it.
    (Keeping elementwise outputs instead trips over in-place ops such as RMSNorm's `add_`.)"""
    return CheckpointPolicy.MUST_SAVE if op in _GEMM_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str) -> None:
    """Recompute each block's activations in backward (`full`) or only its attention core (`selective`)."""
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            model.layers[name] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        else:
            model.layers[name] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                context_fn=partial(create_selective_checkpoint_contexts, _keep_gemm_outputs))


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, zero: int, tensor_parallel: bool) -> bool:
    """Data parallelism over `dp_mesh`: gradients all-reduced (ZeRO-0) or sharded with FSDP2 (ZeRO-1/2/3;
    only ZeRO-3 frees the gathered parameters after forward). Returns True when the caller must all-reduce
    gradients itself (`sync_gradients`): composable `replicate` mis-scales DTensor gradients under TP and
    takes no 2-D (dp x cp) mesh."""
    if dp_mesh.size() == 1:
        return False
    if zero == 0:
        if tensor_parallel:
            return True
        replicate(model, device_mesh=dp_mesh)
        return False
    reshard = zero == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    return False


def sync_gradients(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average gradients over the ranks that share the weights (the local shards of DTensor gradients)."""
    size = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():  # one all-reduce per dtype over a flat buffer
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def apply_cp(model: nn.Module, cp_group: dist.ProcessGroup, sequence_slice: tuple[int, int]) -> None:
    """Ulysses context parallelism: this rank keeps one chunk of every sequence after the embedding, and
    each attention core swaps it for the whole sequence of a head group (plait.runtime.ulysses)."""
    model.sequence_slice = sequence_slice
    swap = (partial(seq_to_heads, group=cp_group), partial(heads_to_seq, group=cp_group))
    for block in model.layers.values():
        block.attention.context_parallel = swap


def parallelize_chunk(model: nn.Module, strategy: Strategy, mesh: DeviceMesh, weight_mesh: DeviceMesh,
                      sequence_slice: tuple[int, int] | None) -> bool:
    """Apply `strategy` to a model chunk on its stage mesh (dims dp, cp, tp); `weight_mesh` holds the ranks
    that share its weights. True if gradients need `sync_gradients` after backward."""
    if strategy.cp > 1 and sequence_slice is not None:
        apply_cp(model, mesh["cp"].get_group(), sequence_slice)
    if strategy.tp > 1:
        apply_tp(model, mesh["tp"], strategy.sp)
    apply_ac(model, strategy.recompute)
    return apply_dp(model, weight_mesh, strategy.zero, strategy.tp > 1 or strategy.cp > 1)
