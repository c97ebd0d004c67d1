"""Memory of one device: model states by ZeRO stage and precision, activations, buffers and reserve.

Bytes. Model states follow Rajbhandari et al. 2020 (ZeRO): weights, gradients and optimizer state are each
divided by the data-parallel degree from ZeRO stage 3, 2 and 1 on; at stage 3 the sharded weights are the fp32
master copy itself (PyTorch FSDP). Activations are the per-layer saved
tensors (cost/layer.py) times the micro-batches in flight at the device's pipeline position.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from plait.cost.calibration import Calibration
from plait.cost.precision import PrecisionBytes

CUDA_CONTEXT_BYTES = 0.75 * 1024**3
"""Device memory the CUDA context, cuBLAS/NCCL workspaces and kernels take outside PyTorch's allocator
(measured 0.5-1 GiB on A100/H100 with PyTorch 2.x and NCCL)."""
FRAGMENTATION_FRACTION = 0.05
"""Share of allocated bytes lost to allocator fragmentation and rounding (PyTorch's caching allocator with
expandable segments: reserved/allocated of 1.03-1.10 in long training runs)."""
GRAD_BUCKET_BYTES = 25 * 1024**2
"""Gradient bucket of data-parallel reduction (PyTorch DDP's default bucket_cap_mb = 25)."""


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes on one device, by cause."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    reserve: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers + self.reserve

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def model_state_bytes(params: float, dp: int, zero: int, prec: PrecisionBytes, offload: bool = False
                      ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of `params` parameters replicated over `dp` devices. Under ZeRO-3
    with 16-bit compute weights and the optimizer on the device, no sharded 16-bit copy is kept: PyTorch FSDP's
    sharded flat parameter holds the fp32 values, and each all-gather casts them to `param_dtype` (FSDP
    MixedPrecision; FSDP2 MixedPrecisionPolicy), so the weights are the master copy (`PrecisionBytes.master`) and
    the optimizer keeps only the Adam moments: 4 + 4 + 8 = 16 bytes per parameter in bf16, as ZeRO-3's 16, not
    Megatron's 18. An `offload`ed optimizer takes the master copy to the host, and the 16-bit shard stays.
    Without a master copy (fp32, pure bf16) the sharded weights are the compute weights."""
    if zero >= 3 and not offload and prec.master:
        return (params * prec.master / dp, params * prec.grad / dp, params * (prec.optimizer - prec.master) / dp)
    weights = params * prec.param / (dp if zero >= 3 else 1)
    grads = params * prec.grad / (dp if zero >= 2 else 1)
    optimizer = params * prec.optimizer / (dp if zero >= 1 else 1)
    return weights, grads, optimizer


def context_bytes(cal: Calibration) -> float:
    """Memory a rank holds outside the model: the profiled process (CPU) or context, else the CUDA context."""
    return cal.measured.process_bytes if cal.measured is not None else CUDA_CONTEXT_BYTES


def with_reserve(weights: float, grads: float, optimizer: float, activations: float, buffers: float,
                 cal: Calibration) -> MemoryTerms:
    """MemoryTerms with the allocator's fragmentation and the context (`context_bytes`) added as `reserve`."""
    allocated = weights + grads + optimizer + activations + buffers
    return MemoryTerms(weights, grads, optimizer, activations, buffers,
                       context_bytes(cal) + FRAGMENTATION_FRACTION * allocated)


def unit(largest: float) -> tuple[str, float]:
    """(name, bytes) of the unit to print memory in: GiB, or MiB below 1 GiB."""
    return ("GiB", 2.0**30) if largest >= 2**30 else ("MiB", 2.0**20)
