"""What a training rank's peak memory holds, measured as the terms `plait simulate` predicts.

weights, grads and optim are the bytes of this rank's parameter shards, gradients (after the backward,
before they are freed) and optimizer state; activ is the peak of the bytes autograd kept for backward at
once during one step (storages packed by saved-tensor hooks, each counted once, while alive); reserve is
what the rank held before its model (CPU: resident set of the interpreter and libraries; CUDA: allocated
bytes); buf is the rest of the peak (communication buffers, gathered FSDP parameters, logits, temporaries,
allocator slack). Units: bytes.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterable
from typing import Self

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

TERMS = ("weights", "grads", "optim", "activ", "buf", "reserve")
"""The terms, in the order `plait simulate` prints them."""


def resident_bytes() -> float:
    """Resident memory of this process now (bytes). Read from /proc/self/statm (Linux); elsewhere the peak
    resident size from getrusage, an upper bound."""
    try:
        with open("/proc/self/statm") as statm:
            return float(int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return _max_rss_bytes()


def current_bytes() -> float:
    """Memory this rank holds now: CUDA allocated bytes, or the resident set size on the CPU."""
    return float(torch.cuda.memory_allocated()) if torch.cuda.is_available() else resident_bytes()


def peak_bytes() -> float:
    """Peak memory of this rank: device memory on CUDA, resident set size on CPU."""
    return float(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else _max_rss_bytes()


def _max_rss_bytes() -> float:
    """This process's peak resident size from getrusage (macOS counts bytes, Linux KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


def tensor_bytes(tensors: Iterable[Tensor | None]) -> float:
    """Bytes of this rank's part of `tensors` (local shards of DTensors), each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return float(sum(seen.values()))


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> float:
    """Bytes of the optimizers' state tensors (Adam moments, step counters) in device memory: on an
    accelerator, offloaded states in host memory or files do not count."""
    return tensor_bytes(v for opt in optimizers for state in opt.state.values() for v in state.values()
                        if isinstance(v, Tensor) and _on_device(v))


def _on_device(t: Tensor) -> bool:
    """Whether `t` (its local shard) lives in the memory a rank's peak measures (all of it on a CPU run)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return not torch.cuda.is_available() or local.device.type != "cpu"


class SavedActivations:
    """Context manager: the peak bytes kept for backward at once while it is active (this thread)."""

    def __init__(self, exclude: Iterable[Tensor]) -> None:
        self.exclude = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0.0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: Tensor) -> Tensor:
        base = t._base if t._base is not None else t  # a view of a parameter (a linear's transposed weight)
        if base.requires_grad and base.grad_fn is None:  # a parameter (FSDP's gathered one too), not an activation
            return t
        local = t.to_local() if isinstance(t, DTensor) else t
        try:
            storage = local.untyped_storage()
            ptr = storage.data_ptr()
        except RuntimeError:  # a wrapper without storage of its own (e.g. a pending collective's result)
            return t
        if ptr and ptr not in self.exclude and ptr not in self.live:
            for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                del self.live[key]
            self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
            self.peak = max(self.peak, float(sum(n for _, n in self.live.values())))
        return t

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def terms(weights: float, grads: float, optim: float, activ: float, reserve: float, peak: float) -> dict[str, float]:
    """The terms of a measured peak, buf being what the others leave unexplained (at least 0)."""
    buf = max(0.0, peak - (weights + grads + optim + activ + reserve))
    return {"weights": weights, "grads": grads, "optim": optim, "activ": activ, "buf": buf, "reserve": reserve,
            "total": peak}


def table(by_rank: list[dict[str, float]]):
    """A rich table of measured terms per rank, with the columns of `plait simulate`'s memory table."""
    from rich import box
    from rich.table import Table

    from plait.cost.memory import unit

    name, size = unit(max(t["total"] for t in by_rank))
    out = Table(title=f"measured memory per rank at the first step's peak ({name})", box=box.SIMPLE_HEAD)
    for col in ("rank", *TERMS, "total"):
        out.add_column(col, justify="right")
    for rank, t in enumerate(by_rank):
        out.add_row(str(rank), *(f"{t[k] / size:.1f}" for k in (*TERMS, "total")))
    return out
