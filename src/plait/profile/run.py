"""`plait profile`: measure the device, the model's layers and the collectives, and write one profile."""

from __future__ import annotations

from collections.abc import Callable

from plait.cost.profile_file import PROFILE_ELEMENT_BYTES, Profile
from plait.errors import PlaitError
from plait.spec.model import ModelSpec

Progress = Callable[[str, int, int], None]
"""progress(phase, done, total)."""
PROFILE_DTYPES = tuple(PROFILE_ELEMENT_BYTES)
"""What `plait profile --dtype` measures in."""


def profile(spec: ModelSpec, nproc: int, *, quick: bool = False, gpu_type: str | None = None,
            progress: Progress | None = None, dtype: str = "fp32") -> Profile:
    """Measure this machine for `spec` with `nproc` ranks: one rank's GEMM rate and copy bandwidth, the
    model's blocks (per tensor-parallel width that divides its heads, up to `nproc`; each distinct layer, an
    MoE layer also per expert-parallel width up to `nproc`), embedding, head and optimizer step, the
    collectives of every group size up to `nproc`, the overlap slowdown, and the trunk decoder layer under
    each parallel strategy as the runtime runs it. The GEMM rate, layers, optimizer step and strategies are
    measured in `dtype` (`PROFILE_DTYPES`: fp32, or bf16 weights and activations)."""
    from plait.profile.collectives import measure_collectives
    from plait.profile.device import measure_device
    from plait.profile.layers import measure_layers
    from plait.profile.optimizer import measure_optimizer

    if dtype not in PROFILE_DTYPES:
        raise PlaitError(f"--dtype must be {' or '.join(PROFILE_DTYPES)}, got {dtype!r}")
    if nproc < 2:
        raise PlaitError(f"--nproc must be at least 2 to measure collectives, got {nproc}")
    kinds = set(spec.kind_counts())
    if spec.family not in ("gpt", "llama") or not kinds <= {"decoder", "moe"}:
        raise PlaitError(f"profiling measures decoder-only stacks of dense and mixture-of-experts layers "
                         f"(gpt, llama); {spec.name} is a {spec.family} model with "
                         f"{', '.join(sorted(kinds))} layers: profile its text model instead")
    device = measure_device(nproc, gpu_type, dtype)
    widths = tuple(w for w in (1, 2, 4, 8) if w <= nproc)
    tps = tuple(t for t in widths if spec.heads % t == 0 and spec.kv_heads % t == 0)
    layers, edges = measure_layers(spec, tps=tps, eps=widths, quick=quick, dtype=dtype,
                                   progress=(lambda d, t: progress("layers", d, t)) if progress else None)
    optimizer = measure_optimizer(spec, quick, dtype)
    # the runtime's machinery under each strategy is timed on stacks of the trunk decoder layer
    job = measure_collectives(nproc, quick=quick, model=spec, dtype=dtype,
                              progress=(lambda d, t: progress("collectives", d, t)) if progress else None)
    return Profile(dtype=dtype, device=device, process_bytes=job.process_bytes, layers=tuple(layers),
                   edges=tuple(edges), collectives=tuple(job.curves), overlap=job.overlap,
                   strategies=tuple(job.strategies), optimizer=optimizer)
