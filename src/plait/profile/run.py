"""`plait profile`: measure the device, the model's layers and the collectives, and write one profile."""

from __future__ import annotations

from collections.abc import Callable

from plait.cost.profile_file import Profile
from plait.errors import PlaitError
from plait.spec.model import ModelSpec

Progress = Callable[[str, int, int], None]
"""progress(phase, done, total)."""


def profile(spec: ModelSpec, nproc: int, *, quick: bool = False, gpu_type: str | None = None,
            progress: Progress | None = None) -> Profile:
    """Measure this machine for `spec` with `nproc` ranks: one rank's GEMM rate and copy bandwidth, the
    model's blocks (per tensor-parallel width that divides its heads, up to `nproc`), embedding, head and
    optimizer step, the collectives of every group size up to `nproc`, the overlap slowdown, and the block
    under each parallel strategy as the runtime runs it."""
    from plait.profile.collectives import measure_collectives
    from plait.profile.device import measure_device
    from plait.profile.layers import measure_layers
    from plait.profile.optimizer import measure_optimizer

    if nproc < 2:
        raise PlaitError(f"--nproc must be at least 2 to measure collectives, got {nproc}")
    if not spec.uniform or spec.family not in ("gpt", "llama"):
        raise PlaitError(f"profiling measures stacks of identical decoder layers (gpt, llama); {spec.name} is a "
                         f"{spec.family} model of several layer kinds: profile its text model instead")
    device = measure_device(nproc, gpu_type)
    tps = tuple(t for t in (1, 2, 4, 8) if t <= nproc and spec.heads % t == 0 and spec.kv_heads % t == 0)
    layers, edges = measure_layers(spec, tps=tps, quick=quick,
                                   progress=(lambda d, t: progress("layers", d, t)) if progress else None)
    optimizer = measure_optimizer(spec, quick)
    job = measure_collectives(nproc, quick=quick, model=spec,
                              progress=(lambda d, t: progress("collectives", d, t)) if progress else None)
    return Profile(device=device, process_bytes=job.process_bytes, layers=tuple(layers), edges=tuple(edges),
                   collectives=tuple(job.curves), overlap=job.overlap, strategies=tuple(job.strategies),
                   optimizer=optimizer)
