"""Token-wise activation swapping (MEMO): a share of the tokens of every tensor a layer saves for backward goes
to host memory during the layer's forward and comes back when its backward unpacks it.

`attach(block, share, meter)` brackets the block's forward with `torch.autograd.graph.saved_tensors_hooks`:
each saved activation (parameters stay) is cut along its token dimension (the first dimension as long as the
block input's sequence), the first `round(share * tokens)` tokens are copied to a host buffer (pinned host
memory on CUDA, copied on the current stream without blocking; on a CPU-only machine a separate CPU tensor,
so the code path and the byte counts are the same) and the rest is kept as a tensor of its own, so the
original can be freed. Backward concatenates the two parts again: the values, and so the gradients, are
exactly the unswapped ones. A `SwapMeter` counts the resident (kept) and host bytes of the saved activations
(saved tensors with a token dimension; weights and their autocast copies stay and are not counted); bytes.

Under tensor parallelism a saved DTensor is cut as its local tensor and rebuilt with its placements; under
sequence parallelism (a `gather` of tp) the block's input holds 1/tp of the sequence and the tensors after the
all-gather the whole of it, under Ulysses context parallelism (a `gather` of cp) the attention core holds the
whole sequence: every such length counts as the token dimension. Under ring context parallelism the block
holds its rank's chunk of the sequence throughout, and ring attention's saved queries, keys, values, output
and log-sum-exp are cut along that chunk like any other saved tensor.

Selective recomputation keeps its GEMM outputs in checkpoint's own cache, not through saved-tensor hooks:
`cache_storage` gives that cache a storage that cuts each kept output with the running block's swap as it is
stored and joins it again when recomputation reads it, so the swap moves `share` of every byte the layer
keeps (its checkpointed input under the hooks, its GEMM outputs in the cache), as the cost model prices it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from itertools import combinations
import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map


@dataclass
class SwapMeter:
    """Bytes of saved activations alive at once (each storage once while alive): kept on the device
    (`resident_peak`) and in host memory (`host_peak`); `swapped` in all, over every pack."""

    resident_peak: float = 0.0
    host_peak: float = 0.0
    swapped: float = 0.0
    exclude: set[int] = field(default_factory=set)  # storages not to count (parameters)
    owner: nn.Module | None = field(default=None, repr=False)  # whose parameters `exclude` holds
    _resident: dict[int, tuple[StorageWeakRef, int]] = field(default_factory=dict)
    _host: dict[int, tuple[StorageWeakRef, int]] = field(default_factory=dict)

    @staticmethod
    def of(model: nn.Module) -> SwapMeter:
        """A meter that leaves out (and a swap that keeps) the storages of `model`'s parameters and buffers."""
        meter = SwapMeter(owner=model)
        meter.reset()
        return meter

    def _parameter_storages(self) -> None:
        """Take the owner's parameter and buffer storages afresh: sharding (FSDP) replaces them, and an
        activation may later sit at a freed one's address."""
        if self.owner is not None:
            self.exclude = {_local(t).untyped_storage().data_ptr()
                            for t in (*self.owner.parameters(), *self.owner.buffers()) if t is not None}

    def count(self, t: Tensor, host: bool) -> None:
        """Count `t`'s storage as alive (on the host when `host`) and update the peaks."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in self.exclude:
            return
        live = self._host if host else self._resident
        for key in [k for k, (ref, _) in live.items() if ref.expired()]:
            del live[key]
        if ptr not in live:
            live[ptr] = (StorageWeakRef(storage), storage.nbytes())
            if host:
                self.swapped += storage.nbytes()
        alive = float(sum(n for _, n in live.values()))
        if host:
            self.host_peak = max(self.host_peak, alive)
        else:
            self.resident_peak = max(self.resident_peak, alive)

    def reset(self) -> None:
        """Start counting afresh (one step's peaks), with the owner's parameter storages of now."""
        self._parameter_storages()
        self.resident_peak = self.host_peak = self.swapped = 0.0
        self._resident.clear()
        self._host.clear()

    def as_dict(self) -> dict[str, float]:
        """The metrics record's `swap` entry."""
        return {"resident_peak_bytes": self.resident_peak, "host_peak_bytes": self.host_peak,
                "swapped_bytes": self.swapped}


@dataclass(frozen=True)
class _Packed:
    """A saved tensor cut in two along `dim`: `host` (its first tokens) and `kept` (the rest, or None); a view
    of a tensor that fills its storage is cut as the storage's elements and rebuilt by `view` (shape,
    strides and offset into them)."""

    host: Tensor
    kept: Tensor | None
    dim: int
    device: torch.device
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None


def _local(t: Tensor) -> Tensor:
    """`t`'s local tensor if it is a DTensor, else `t`."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class _DPacked:
    """A saved DTensor whose local tensor was cut (`inner`), with what rebuilds it."""

    inner: _Packed
    spec: object  # the DTensor's DTensorSpec


def token_dim(t: Tensor, lengths: tuple[int, ...]) -> int | None:
    """The first dimension of `t` whose length is in `lengths`: the sequence's tokens, or its tokens of every
    sequence flattened together (a GEMM's [B*T, H] input); None if none is."""
    return next((d for d, n in enumerate(t.shape) if n in lengths), None)


def to_host(t: Tensor) -> Tensor:
    """A host copy of `t`: pinned and not blocking from an accelerator, a separate tensor on the CPU."""
    if t.device.type == "cpu":
        return t.clone()
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return buf.copy_(t, non_blocking=True)


class _LayerSwap:
    """The saved-tensor hooks of one block: swap `share` of each saved activation's tokens."""

    def __init__(self, share: float, meter: SwapMeter, gather: tuple[int, ...] = ()) -> None:
        self.share, self.meter = share, meter
        self.factors = sorted({math.prod(c) for n in range(len(gather) + 1) for c in combinations(gather, n)})
        self.tokens = self.rows = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._seen: dict[tuple, tuple[Tensor, _Packed | None]] = {}  # one cut per saved storage in a forward

    def pre(self, _module: nn.Module, args: tuple) -> None:
        x = _local(args[0]) if args and isinstance(args[0], Tensor) else None
        self.tokens = x.shape[1] if x is not None and x.dim() >= 2 else 0
        self.rows = x.shape[0] * self.tokens if self.tokens else 0
        self._seen = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        _RUNNING.append(self)

    def post(self, _module: nn.Module, _args: tuple, _out: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            _RUNNING.remove(self)
        self._seen = {}

    @property
    def lengths(self) -> tuple[int, ...]:
        """Lengths of a token dimension: the block input's tokens and their rows, each gathered by every
        product of the gathering degrees (sequence parallelism, Ulysses)."""
        return tuple(n * f for f in self.factors for n in (self.tokens, self.rows))

    def pack(self, t: Tensor) -> object:
        if isinstance(t, DTensor):
            if t.requires_grad and t.grad_fn is None:
                return t  # a parameter
            inner = self.pack(t._local_tensor)
            return _DPacked(inner, t._spec) if isinstance(inner, _Packed) else t
        if isinstance(t, AsyncCollectiveTensor):  # a functional collective's result: its values, once arrived
            t = t.trigger_wait()
        dim = token_dim(t, self.lengths) if self.tokens else None
        base = t._base if t._base is not None else t
        if (base.requires_grad and base.grad_fn is None) or dim is None or \
                t.untyped_storage().data_ptr() in self.meter.exclude:
            return t  # a parameter (or a view of one, FSDP's gathered ones too), a buffer, or no tokens
        storage = t.untyped_storage()
        flat = base.numel() * base.element_size() == storage.nbytes()  # base covers its storage densely
        if flat:  # views of one storage (x, x.view(B*T, H), an expanded k, a transposed output) share one cut
            key: tuple = (storage.data_ptr(), base.dtype)
            base_dim = token_dim(base, self.lengths)
            unit = base.stride(base_dim) if base_dim is not None else 1  # elements per token in storage order
        else:
            key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in self._seen:  # the original stays referenced until the forward ends: no address reuse
            self._seen[key] = (base, self._cut(base.as_strided((base.numel(),), (1,), 0), 0, unit) if flat
                                      else self._cut(t, dim, 1))
        packed = self._seen[key][1]
        if packed is None:
            return t
        if flat:
            return replace(packed, view=(tuple(t.shape), tuple(t.stride()), t.storage_offset()))
        return packed

    def _cut(self, t: Tensor, dim: int, unit: int) -> _Packed | None:
        """`t` cut along `dim` after `share` of its tokens (`unit` elements each), the first part on the host;
        None when no token moves."""
        k = round(self.share * t.shape[dim] / unit) * unit
        if k == 0:
            self.meter.count(t, host=False)
            return None
        host = to_host(t.narrow(dim, 0, k))
        kept = t.narrow(dim, k, t.shape[dim] - k).clone() if k < t.shape[dim] else None
        self.meter.count(host, host=True)
        if kept is not None:
            self.meter.count(kept, host=False)
        return _Packed(host, kept, dim, t.device)

    @staticmethod
    def unpack(packed: object) -> Tensor:
        if isinstance(packed, _DPacked):
            spec = packed.spec
            return DTensor.from_local(_LayerSwap.unpack(packed.inner), spec.mesh, spec.placements,  # type: ignore[attr-defined]
                                      run_check=False, shape=spec.shape, stride=spec.stride)  # type: ignore[attr-defined]
        if not isinstance(packed, _Packed):
            return packed  # type: ignore[return-value]
        head = packed.host.to(packed.device, non_blocking=True)
        whole = head if packed.kept is None else torch.cat([head, packed.kept], dim=packed.dim)
        return whole if packed.view is None else whole.as_strided(*packed.view)


_RUNNING: list[_LayerSwap] = []
"""The swaps whose block's forward is running, innermost last (what `cache_storage` cuts with)."""


class _Joined:
    """A kept GEMM output in selective checkpointing's cache, cut by a swap: joined again when read."""

    def __init__(self, packed: object) -> None:
        self.packed = packed

    def get_val(self, _allow_mutation: bool) -> Tensor:
        return _LayerSwap.unpack(self.packed)


class _SwappedEntries(dict):
    """One op's kept outputs (call index -> outputs of checkpoint's `_VersionWrapper`s), each tensor cut by
    `swap` as it is stored."""

    def __init__(self, swap: _LayerSwap) -> None:
        super().__init__()
        self.swap = swap

    def __setitem__(self, idx: int, entry: object) -> None:
        def cut(leaf: object) -> object:  # an output left whole keeps checkpoint's own mutation check
            val = getattr(leaf, "val", None)
            packed = self.swap.pack(val) if isinstance(val, Tensor) else val
            return leaf if packed is val else _Joined(packed)
        super().__setitem__(idx, tree_map(cut, entry))


def cache_storage() -> dict:
    """Storage for selective checkpointing's kept op outputs (`create_selective_checkpoint_contexts`'
    modes): cut by the running block's swap (counted by its meter) when one runs, else a plain cache."""
    if not _RUNNING:
        return defaultdict(dict)
    swap = _RUNNING[-1]
    return defaultdict(lambda: _SwappedEntries(swap))


def running_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks of the running block's swap (cut and counted as any saved tensor), or hooks that
    keep tensors as they are when none runs: for an autograd function that saves its tensors inside a
    checkpointed block but outside its recomputation (attn_kept's ring attention)."""
    if _RUNNING:
        return torch.autograd.graph.saved_tensors_hooks(_RUNNING[-1].pack, _LayerSwap.unpack)
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(t: Tensor) -> Tensor:
    return t


def attach(block: nn.Module, share: float, meter: SwapMeter, gather: tuple[int, ...] = ()
           ) -> list[torch.utils.hooks.RemovableHandle]:
    """Swap `share` of the tokens of `block`'s saved activations while it runs forward (0: only count them in
    `meter`; `gather`: the degrees that gather the sequence inside the block: sequence parallelism's tp,
    Ulysses' cp); the hook handles."""
    swap = _LayerSwap(share, meter, gather)
    return [block.register_forward_pre_hook(swap.pre), block.register_forward_hook(swap.post, always_call=True)]


def switchable(model: nn.Module) -> list[_LayerSwap]:
    """Swap hooks on every block of `model`, counted by `model.swap_meter`, that swap nothing (share 0) until
    the caller sets their `share` before a pass: ByteScale's selective offloading of chosen sequences."""
    if getattr(model, "swap_meter", None) is None:
        model.swap_meter = SwapMeter.of(model)
    swaps = []
    for block in model.layers.values():
        swaps.append(_LayerSwap(0.0, model.swap_meter))
        block.register_forward_pre_hook(swaps[-1].pre)
        block.register_forward_hook(swaps[-1].post, always_call=True)
    return swaps


def apply_swap(model: nn.Module, share: float, layers: list[str], gather: tuple[int, ...] = ()) -> None:
    """Swap `share` of the named blocks' saved activations token-wise, counted by `model.swap_meter` (made on
    first use, leaving out the model's parameters and buffers; `gather`: as `attach`)."""
    if share <= 0:
        return
    if getattr(model, "swap_meter", None) is None:
        model.swap_meter = SwapMeter.of(model)
    for name in layers:
        attach(model.layers[name], share, model.swap_meter, gather)


def step_metrics(chunks: Iterable[nn.Module]) -> dict[str, float] | None:
    """The `swap` entry of a step's metrics over a rank's model chunks (bytes; None without swapping)."""
    meters = [m.swap_meter for m in chunks if getattr(m, "swap_meter", None) is not None]
    if not meters:
        return None
    return {k: sum(m.as_dict()[k] for m in meters) for k in meters[0].as_dict()}
