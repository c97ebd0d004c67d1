"""Apply one layer strategy to a model chunk with PyTorch's own parallelism, one small function each.

Order (as torchtitan): tensor/sequence parallel (DTensor `parallelize_module`), then activation
recomputation (`checkpoint_wrapper`), then data parallel: DDP-style `replicate` for ZeRO-0, FSDP2
`fully_shard` for ZeRO-1/2/3 (parameters resharded after forward only for ZeRO-3). A chunk whose layers
use different strategies gets each strategy on its own layers, with re-layouts in between.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._composable.replicate import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plait.models.llama import Attention
from plait.models.mla import LatentAttention
from plait.models.moe import MoE
from plait.plan import Strategy
from plait.runtime import recompute
from plait.runtime.experts import Sync, apply_ep, expert_params
from plait.cost.offload import PAGED
from plait.runtime.placement import Chunk
from plait.runtime.relayout import Relayout
from plait.runtime.ring import RingContext
from plait.runtime.swap import apply_swap, cache_storage
from plait.runtime.zero import paging, shard_unit
from plait.runtime.ulysses import Ulysses


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sp: bool, layers: list[str], embedding: bool, head: bool
             ) -> None:
    """Megatron tensor parallelism on the named blocks (q/k/v and MLP-in column-wise, out and MLP-down
    row-wise) and, when they belong to this strategy, the vocabulary-parallel embedding and LM head; with
    `sp` norms and residuals run sequence-sharded and the hidden state between blocks is split along the
    sequence."""
    seq = Shard(1) if sp else Replicate()
    top: dict[str, object] = {}
    if embedding and model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if head and model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if head and model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        tied = model.output is not None and model.tok_embeddings is not None and \
            model.output.weight is model.tok_embeddings.weight
        parallelize_module(model, tp_mesh, top)
        if tied:  # both became Shard(0) DTensors: share one parameter again
            model.output.weight = model.tok_embeddings.weight
    for i, name in enumerate(layers):
        plan = layer_tp_plan(model.layers[name], sp)
        if sp and i == 0 and embedding and model.tok_embeddings is not None:  # the embedding hands over the
            plan[""] = PrepareModuleInput(input_layouts=(Replicate(), None),  # full sequence
                                          desired_input_layouts=(Shard(1), None), use_local_output=True)
        parallelize_module(model.layers[name], tp_mesh, plan)
        if sp:  # the modules whose input is gathered: the block keeps the shard (TransformerBlock.through)
            model.layers[name].gathered = frozenset(k for k in (*ATTENTIONS, "feed_forward")
                                                    if _gathers(plan.get(k)))
        for attn in (a for a in ATTENTIONS if hasattr(model.layers[name], a)):  # weights read by local heads
            getattr(model.layers[name], attn).tp_mesh = tp_mesh


ATTENTIONS = ("attention", "cross_attention")
"""A layer's attention modules (wq, wk, wv, wo each); a cross-attention reads (queries, memory)."""


def layer_tp_plan(layer: nn.Module, sp: bool) -> dict[str, object]:
    """Megatron tensor parallelism of one layer, from the modules it has: q/k/v (latent attention's
    up-projections) and MLP-in column-wise, the attention output and MLP-down row-wise (reduce-scattered
    along the sequence with `sp`, whose norms then run sequence-sharded and whose attention and MLP inputs
    are gathered), a patch embedding's projection column-wise and gathered."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {}
    for attn in (a for a in ATTENTIONS if hasattr(layer, a)):
        plan |= {f"{attn}.{name}": ColwiseParallel() for name in getattr(layer, attn).column_parallel}
        plan[f"{attn}.wo"] = RowwiseParallel(output_layouts=seq)
    routed = isinstance(getattr(layer, "feed_forward", None), MoE)  # experts: plait.runtime.experts
    if (ffn := getattr(layer, "feed_forward", None)) is not None and not routed:
        plan |= {"feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if hasattr(ffn, "w3"):
            plan["feed_forward.w3"] = ColwiseParallel()
    if hasattr(layer, "proj"):
        plan["proj"] = ColwiseParallel(output_layouts=Replicate())
    if sp:
        plan |= {
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                            use_local_output=_latent(layer)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(
                Shard(1) if routed else Replicate(),), use_local_output=routed),  # MoE: this rank's tokens
        }
        if hasattr(layer, "cross_attention"):
            plan |= {"cross_attention_norm": SequenceParallel(), "cross_attention": PrepareModuleInput(
                input_layouts=(Shard(1), Shard(1)), desired_input_layouts=(Replicate(), Replicate()))}
        if getattr(layer, "output_norm", None) is not None:
            plan["output_norm"] = SequenceParallel(use_local_output=True)
    return plan


def _gathers(style: object) -> bool:
    """Whether a module's tensor-parallel `style` gathers its (first) input from the sequence shards."""
    return isinstance(style, PrepareModuleInput) and style.input_layouts[0] == Shard(1) and \
        style.desired_input_layouts[0] == Replicate()


def _latent(layer: nn.Module) -> bool:
    """Whether the layer's attention is latent (`plait.models.mla`): its down-projections and latent norms stay
    whole on every rank, so under sp it reads the gathered sequence as a plain tensor (each up-projection's
    column-parallel input then sums its input gradient over the tp group)."""
    return isinstance(getattr(layer, "attention", None), LatentAttention)


_GEMM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
"""The GEMM kernels whose outputs `gemm_kept` keeps (nn.Linear dispatches to mm or addmm, batched ones to
bmm)."""


def _keep_gemm_outputs(_ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """SAC policy of gemm_kept: keep the outputs of the block's GEMMs and recompute the rest (the attention
    core, the elementwise work around it and the forward's collectives), as priced
    (`Block._gemm_kept_bytes`, tests/test_activation_bytes.py). Keeping elementwise outputs instead trips over
    in-place ops such as RMSNorm's `add_`."""
    return CheckpointPolicy.MUST_SAVE if op in _GEMM_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _gemm_kept_contexts() -> tuple:
    """gemm_kept's forward and recompute modes, keeping the GEMM outputs in a cache that the running block's
    token-wise swap cuts (`plait.runtime.swap.cache_storage`)."""
    caching, cached = create_selective_checkpoint_contexts(_keep_gemm_outputs)
    caching.storage = cached.storage = cache_storage()
    return caching, cached


CONTEXTS = {"full": None, "attn_kept": recompute.contexts, "gemm_kept": _gemm_kept_contexts}
"""The checkpoint_wrapper context of each recompute mode that checkpoints whole blocks (None: plain)."""


def apply_ac(model: nn.Module, mode: str, layers: list[str]) -> None:
    """Recompute the named blocks' activations in backward (`full`), only their attention core
    (`selective`: Megatron-LM's, `plait.models.recomputed`), all but their attention core (`attn_kept`,
    plait.runtime.recompute), or all but their GEMMs (`gemm_kept`: op-level selective checkpointing)."""
    if mode == "none":
        return
    if mode == "selective":
        for name in layers:
            for module in model.layers[name].modules():
                if isinstance(module, Attention):
                    module.recompute_core = True
        return
    for name in layers:
        context = {"context_fn": CONTEXTS[mode]} if CONTEXTS[mode] is not None else {}
        model.layers[name] = checkpoint_wrapper(model.layers[name], checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                **context)


def apply_recompute_modules(model: nn.Module, modules: tuple[str, ...], layers: list[str]) -> None:
    """Megatron-LM's module-wise recompute (`Strategy.recompute_modules`, as `plait.cost.recompute_modules`
    prices it) on the named blocks: `layernorm` drops the norms' outputs, `moe_act` the experts' activation,
    `mla_up_proj` latent attention's queries, keys and values (`plait.models.dropped`); `mlp` recomputes
    dense MLPs from their input."""
    if not modules:
        return
    for name in layers:
        layer = model.layers[name]
        ffn = getattr(layer, "feed_forward", None)
        layer.drop_norms = "layernorm" in modules
        layer.recompute_mlp = "mlp" in modules and ffn is not None and not isinstance(ffn, MoE)
        if isinstance(ffn, MoE):
            ffn.experts.drop_act = "moe_act" in modules
        for attn in (getattr(layer, a) for a in ATTENTIONS if hasattr(layer, a)):
            attn.drop_heads = "mla_up_proj" in modules and isinstance(attn, LatentAttention)


def _fsdp_policy(offload: str, reduce_dtype: torch.dtype | None) -> dict:
    """shard_unit's keywords for a strategy's `offload` (`plait.runtime.zero.paging`; the optimizer states
    of "params" stay with the paged parameters, those of "optim" and "nvme" go to
    `plait.runtime.offload.HostAdamW`) and the plan's gradient reduce dtype."""
    return {"reduce_dtype": reduce_dtype, **paging(offload)}


def _sharded(dp_mesh: DeviceMesh, zero: int, offload: str) -> int:
    """The ZeRO stage FSDP2 units get over `dp_mesh` (0: none): the plan's, and on a single replica whose
    parameters are paged, ZeRO-3's per-unit gathers (FSDP2 over one rank pages each unit in for its passes)."""
    if dp_mesh.size() == 1:
        return 3 if offload in PAGED else 0
    return zero


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, zero: int, hand_sync: bool, offload: str = "none",
             reduce_dtype: torch.dtype | None = None) -> bool:
    """Data parallelism of a whole chunk over `dp_mesh`: gradients all-reduced (ZeRO-0) or sharded with
    FSDP2 (ZeRO-1/2/3; only ZeRO-3 frees the gathered parameters after forward; a 2-D mesh is HSDP).
    Returns True when the caller must all-reduce gradients itself (`sync_gradients`), which ZeRO-0 asks for
    with `hand_sync` or a `reduce_dtype`: composable `replicate` mis-scales DTensor gradients under TP,
    takes no 2-D (dp x cp) mesh, its reducer is not told about a pipeline schedule's several forwards before
    the backwards, and it reduces in the gradients' dtype. Paged parameters (`_sharded`) use FSDP2 also on
    one replica."""
    zero = _sharded(dp_mesh, zero, offload)
    if dp_mesh.size() == 1 and zero == 0:
        return False
    if zero == 0:
        if hand_sync or reduce_dtype is not None:
            return True
        replicate(model, device_mesh=dp_mesh)
        return False
    policy = _fsdp_policy(offload, reduce_dtype)
    for block in model.layers.values():
        shard_unit(block, dp_mesh, zero, **policy)
    shard_unit(model, dp_mesh, zero, **policy)
    return False


def apply_dp_segment(model: nn.Module, layers: list[str], edges: list[nn.Module], dp_mesh: DeviceMesh,
                     zero: int, offload: str = "none", reduce_dtype: torch.dtype | None = None) -> bool:
    """Data parallelism of some blocks (and the embedding or head modules `edges`) of a chunk whose layers
    use different strategies: FSDP2 per block and per edge module (ZeRO-1/2/3), or, for ZeRO-0,
    True: the caller all-reduces their gradients (`sync_gradients`)."""
    zero = _sharded(dp_mesh, zero, offload)
    if dp_mesh.size() == 1 and zero == 0:
        return False
    if zero == 0:
        return True
    policy = _fsdp_policy(offload, reduce_dtype)
    for name in layers:
        shard_unit(model.layers[name], dp_mesh, zero, **policy)
    for edge in edges:
        shard_unit(edge, dp_mesh, zero, **policy)
    return False


def sync_gradients(params: list[nn.Parameter], group: dist.ProcessGroup, weight: float | None = None,
                   reduce_dtype: torch.dtype | None = None) -> None:
    """Average gradients over the ranks that share the weights (the local shards of DTensor gradients), or,
    with `weight`, sum them after scaling this rank's by it (replicas that trained on unequal shares); on
    the wire in `reduce_dtype` (None: the gradients' own dtype)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_dtype.setdefault(local.dtype, []).append(local)
    for grads in by_dtype.values():  # one all-reduce per dtype over a flat buffer
        flat = _flatten_dense_tensors(grads)
        if weight is not None:
            flat.mul_(weight)
        wire = flat if reduce_dtype is None else flat.to(reduce_dtype)
        dist.all_reduce(wire, group=group)
        if wire is not flat:
            flat.copy_(wire)
        if weight is None:
            flat.div_(dist.get_world_size(group))
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def sync_whole_gradients(params: list[nn.Parameter], group: dist.ProcessGroup, weight: float) -> None:
    """Sum the whole gradients of parameters that the ranks of `group` shard differently (pipelines that
    split a layer differently), after scaling this rank's by `weight`; each rank keeps its own shard. A
    DTensor gradient is gathered whole over its mesh first and cut back to this rank's shard after."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        wholes = [whole_gradient(g) for g in grads]
        flat = _flatten_dense_tensors(wholes).mul_(weight)
        dist.all_reduce(flat, group=group)
        for g, summed in zip(grads, _unflatten_dense_tensors(flat, wholes)):
            set_whole_gradient(g, summed)


def whole_gradient(grad: torch.Tensor) -> torch.Tensor:
    """The whole gradient: a DTensor's gathered over its mesh (collective), a plain tensor itself."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def set_whole_gradient(grad: torch.Tensor, whole: torch.Tensor) -> None:
    """Overwrite `grad` (this rank's shard, for a DTensor) with its part of the whole gradient `whole`."""
    if isinstance(grad, DTensor):
        whole = distribute_tensor(whole, grad.device_mesh, grad.placements, src_data_rank=None).to_local()
        grad = grad.to_local()
    grad.copy_(whole)


def swap_gathers(s: Strategy) -> tuple[int, ...]:
    """The degrees that gather a block's sequence inside it, whose lengths a token-wise swap also cuts
    along: sequence parallelism's tp (after its all-gather), Ulysses' cp (the attention core's whole
    sequence); ring attention keeps the rank's chunk."""
    return tuple(d for d, on in ((s.tp, s.sp), (s.cp, s.cp_mode == "ulysses")) if on and d > 1)


def apply_cp(model: nn.Module, cp_group: dist.ProcessGroup, layers: list[str], mode: str = "ulysses",
             seq_len: int | None = None) -> None:
    """Context parallelism on the named blocks. Ulysses: each attention core swaps this rank's chunk of every
    sequence for the whole sequence of a head group (plait.runtime.ulysses); ring: the chunk stays and keys
    and values of `seq_len`-token sequences go around the group (plait.runtime.ring)."""
    if mode == "ring" and seq_len is None:
        raise ValueError("ring context parallelism needs the sequence length")
    cp = Ulysses(cp_group) if mode == "ulysses" else RingContext.contiguous(cp_group, seq_len)
    for name in layers:
        for attn in ATTENTIONS:
            if hasattr(model.layers[name], attn):
                getattr(model.layers[name], attn).context_parallel = cp


def parallelize_chunk(model: nn.Module, chunk: Chunk, seq_len: int, pipelined: bool,
                      grad_accumulation: int = 1, reduce_dtype: torch.dtype | None = None) -> list[Sync]:
    """Apply each segment's strategy to its layers of a model chunk (the embedding goes with the first
    segment, the head with the last), re-layout the hidden state where segments (or the previous stage)
    split it differently, and return the (parameters, group, weight) whose gradients need `sync_gradients`.
    A chunk with MoE layers reduces every gradient by hand (`plait.runtime.experts`; `grad_accumulation`
    micro-batches are averaged by the caller's backward). FSDP units reduce gradients in `reduce_dtype`
    (None: their own); the caller reduces the returned ones in it too."""
    segments = chunk.segments
    names = [[str(i) for i in range(*seg.layers)] for seg in segments]
    relayouts = {}
    previous = chunk.input_layout
    for seg, layers in zip(segments, names):
        if previous is not None and previous != seg.layout:
            assert chunk.group is not None  # a one-rank stage has one layout
            relayouts[layers[0]] = Relayout(previous, seg.layout, chunk.position, chunk.ranks, chunk.group)
        previous = seg.layout
    model.relayouts = relayouts or None
    first = segments[0]
    if first.strategy.cp > 1 and model.tok_embeddings is not None:
        model.sequence_slice = first.sequence_slice(seq_len)
    manual: list[Sync] = []
    for k, (seg, layers) in enumerate(zip(segments, names)):
        s = seg.strategy
        manual += apply_ep(model, seg, layers, chunk.group, grad_accumulation, reduce_dtype)
        if s.cp > 1:
            apply_cp(model, seg.mesh["cp"].get_group(), layers, s.cp_mode, seq_len)
        if s.tp > 1:
            apply_tp(model, seg.tp_mesh, s.sp, layers, embedding=k == 0, head=k == len(segments) - 1)
        apply_recompute_modules(model, s.recompute_modules, layers)
        apply_ac(model, s.recompute, layers)
        apply_swap(model, s.swap, layers, swap_gathers(s))
    synced = expert_params(model)  # reduced by the syncs of apply_ep
    if len(segments) == 1:
        hand_sync = first.strategy.tp > 1 or first.strategy.cp > 1 or pipelined or bool(synced)
        s = first.strategy
        if apply_dp(model, first.weight_mesh, s.zero, hand_sync, s.offload, reduce_dtype):
            manual.append(([p for p in model.parameters() if id(p) not in synced], first.replica_group, None))
        return manual
    # a tied embedding and head are one parameter: sync it once
    for k, (seg, layers) in enumerate(zip(segments, names)):
        edges = []
        if k == 0:
            edges += [m for m in (model.tok_embeddings, model.pos_embeddings) if m is not None]
        if k == len(segments) - 1:
            edges += model.head_modules
        if apply_dp_segment(model, layers, edges, seg.weight_mesh, seg.strategy.zero, seg.strategy.offload,
                            reduce_dtype):
            params = [p for name in layers for p in model.layers[name].parameters() if id(p) not in synced]
            params += [p for m in edges for p in m.parameters() if id(p) not in synced]
            synced.update(id(p) for p in params)
            manual.append((params, seg.replica_group, None))
    return manual
