"""ZeRO stages on FSDP2 units, and what each stage does between the micro-batches of one step.

`shard_unit` wraps a module with `fully_shard` and records its ZeRO stage on it. The stages differ in
what a unit keeps between two micro-batches of one optimizer step, which is what the cost model prices
(`plait.cost.layer.zero_sync_time`, `plait.cost.comm.gradient_sync`):

- ZeRO-1 keeps whole gradients and whole parameters; it reduce-scatters once, after the last backward.
- ZeRO-2 keeps whole parameters but reduce-scatters every micro-batch's gradients, so only the
  gradient shard accumulates.
- ZeRO-3 also frees the gathered parameters after forward and after backward, and gathers them again
  for the next pass.

FSDP2's defaults do neither across micro-batches (it reshards after every backward and reduces whenever
gradient sync is on), and torch's pipeline stages turn the reduction and the resharding off for every
micro-batch but the last, whatever the unit; `micro_batch_flags` sets each unit's two flags from its
stage, and `follow_zero_stages` makes a pipeline stage's calls go through it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from plait.cost.offload import PAGED

ZERO_ATTR = "plait_zero"
"""Attribute of a `shard_unit` module holding its ZeRO stage (1, 2 or 3)."""


REDUCE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp32": None, "bf16": torch.bfloat16}
"""The dtype a plan's `grad_reduce` reduces gradients in (None: the gradients' own). The runtime keeps fp32
gradients under both precisions it trains in (fp32, and bf16 autocast over fp32 master weights), which is
what "auto" means there (`plait.cost.precision`: bf16's and fp32's `grad` are 4 bytes), so fp32 is auto."""


def shard_unit(module: nn.Module, mesh: DeviceMesh, zero: int, reduce_dtype: torch.dtype | None = None,
               **kwargs) -> None:
    """`fully_shard` `module` over `mesh` as ZeRO stage `zero` (only ZeRO-3 frees parameters after forward),
    reducing its gradients in `reduce_dtype` (None: their own dtype). A 2-D mesh ("replicate", "shard") is
    HSDP: reduce-scatter in the shard group, then all-reduce of the shard over the replicas."""
    if reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3, **kwargs)
    setattr(module, ZERO_ATTR, zero)


def paging(offload: str) -> dict:
    """`shard_unit`'s keywords for a strategy's `offload`: paged parameters (offload=params or nvme, as
    `plait.cost.offload.PAGED`) keep the unit's sharded parameters and gradients in host memory (FSDP2's
    CPUOffloadPolicy, pinned only with an accelerator) and copy them to the device for its passes."""
    if offload not in PAGED:
        return {}
    return {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}


def _units(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def micro_batch_flags(model: nn.Module, last: bool) -> None:
    """Set, before a backward, whether each FSDP unit of `model` reduce-scatters its gradients (ZeRO-2/3
    every micro-batch, ZeRO-1 after the `last` one) and frees its gathered parameters afterwards (ZeRO-3
    every micro-batch, ZeRO-1/2 after the last, when the optimizer will change them). Without FSDP units,
    `replicate`'s gradient all-reduce runs after the last micro-batch."""
    units = _units(model)
    for unit in units:
        zero = getattr(unit, ZERO_ATTR, 1)
        FSDPModule.set_requires_gradient_sync(unit, last or zero >= 2, recurse=False)  # type: ignore[arg-type]
        FSDPModule.set_reshard_after_backward(unit, last or zero == 3, recurse=False)  # type: ignore[arg-type]
    if not units and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)


def follow_zero_stages(chunk: nn.Module) -> None:
    """Make the gradient-sync switch that torch's PipelineStage flips on `chunk` (off before every backward
    but the last, on before its final reduction) set each unit's flags by its ZeRO stage
    (`micro_batch_flags`); its reshard switch is set there too."""
    if not isinstance(chunk, FSDPModule):
        return

    def set_requires_gradient_sync(requires: bool, *, recurse: bool = True) -> None:
        micro_batch_flags(chunk, last=requires)

    def set_reshard_after_backward(reshard: bool, *, recurse: bool = True) -> None:
        """Set with the gradient sync (`micro_batch_flags`)."""

    chunk.set_requires_gradient_sync = set_requires_gradient_sync  # type: ignore[method-assign]
    chunk.set_reshard_after_backward = set_reshard_after_backward  # type: ignore[method-assign]
