"""Tensors dropped from what backward keeps and rebuilt when backward first reads them: Megatron-LM's
`CheckpointWithoutOutput`, behind its module-wise recompute of the norms (`layernorm`), the experts' activation
(`moe_act`) and latent attention's up-projections (`mla_up_proj`).

    with Dropped(outputs, rebuild, keep=inputs):
        y = consumer(outputs)

Every tensor that `consumer`'s operations save for backward and that shares its storage with one of `outputs`
(the tensor itself, a view, a DTensor around it) is kept as a marker instead; the first marker that backward
unpacks calls `rebuild(*inputs)` (under no_grad and the forward's autocast; it must return tensors of the same
values and layout, by running the same forward again) and every marker reads its view from that. `inputs` are
kept as saved tensors are (through the hooks active outside: a swap moves them, a meter counts them), so
`rebuild` must not hold tensors of its own. Once forward drops its own references, the outputs' memory is
free until backward. Other saved tensors go to the saved-tensor hooks that were active outside (a swap, a
meter) or stay as they are. Gradients are those of the plain forward: `outputs` keep their autograd history;
only what the consumer keeps of them changes.

Sequence parallelism keeps, the same way, only the shard of a projection's input and gathers it again in
backward, as Megatron-LM's does (`plait.models.llama.TransformerBlock.through`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class _Marker:
    """A dropped saved tensor: output `index`'s storage, read as `view` (shape, strides, offset of the local
    tensor), wrapped again as a DTensor of `spec` when it was one."""

    owner: Dropped
    index: int
    view: tuple[tuple[int, ...], tuple[int, ...], int]
    spec: object | None


@dataclass(frozen=True)
class _Outer:
    """A saved tensor packed by the hooks active outside the region: their unpack and what they packed."""

    unpack: Callable[[object], Tensor]
    packed: object


def _local(t: Tensor) -> Tensor:
    """`t`'s local tensor if it is a DTensor, else `t`."""
    return getattr(t, "_local_tensor", t)


class Dropped:
    """The saved-tensor hooks of one region (see the module): `outputs` dropped, `rebuild(*keep)` makes them
    again."""

    def __init__(self, outputs: Tensor | tuple[Tensor, ...], rebuild: Callable[..., Tensor | tuple[Tensor, ...]],
                 keep: tuple[Tensor, ...] = ()) -> None:
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        self.rebuild = rebuild
        self.keep: tuple[Tensor, ...] | list[object] = keep
        device = _local(self.outputs[0]).device.type  # rebuilt under the forward's autocast
        self._autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        self._storages = {_local(t).untyped_storage().data_ptr(): i for i, t in enumerate(self.outputs)}
        self._rebuilt: tuple[Tensor, ...] | None = None
        self._pending = 0  # markers not yet unpacked (the rebuilt tensors are let go after the last)
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._outer: tuple[Callable, Callable] | None = None

    def __enter__(self) -> Dropped:
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.keep = [self._pass_on(t) for t in self.keep]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
        self.outputs = ()  # forward's references are the caller's alone now

    def _pack(self, t: Tensor) -> object:
        local = _local(t)
        index = self._storages.get(local.untyped_storage().data_ptr())
        if index is not None and local.dtype == _local(self.outputs[index]).dtype:
            self._pending += 1
            return _Marker(self, index, (tuple(local.shape), tuple(local.stride()), local.storage_offset()),
                           t._spec if local is not t else None)
        return self._pass_on(t)

    def _pass_on(self, t: Tensor) -> object:
        """`t` packed by the hooks active outside the region (as it is without any)."""
        if self._outer is None:
            return t
        pack, unpack = self._outer
        return _Outer(unpack, pack(t))

    @staticmethod
    def _unpack(packed: object) -> Tensor:
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        if not isinstance(packed, _Marker):
            return packed  # type: ignore[return-value]
        owner = packed.owner
        if owner._rebuilt is None:
            device, dtype, enabled = owner._autocast
            with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                rebuilt = owner.rebuild(*(Dropped._unpack(k) for k in owner.keep))
            owner._rebuilt = rebuilt if isinstance(rebuilt, tuple) else (rebuilt,)
        local = _local(owner._rebuilt[packed.index]).as_strided(*packed.view)
        owner._pending -= 1
        if owner._pending <= 0:
            owner._rebuilt, owner._pending = None, 0
        if packed.spec is None:
            return local
        from torch.distributed.tensor import DTensor

        spec = packed.spec
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=spec.shape, stride=spec.stride)  # type: ignore[attr-defined]
