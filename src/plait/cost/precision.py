"""Bytes per element and per parameter under each training precision."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from plait.cached_hash import cached_hash
from plait.spec.cluster import GPU


@cached_hash
@dataclass(frozen=True)
class PrecisionBytes:
    """Storage of one training precision.

    Mixed precision (Micikevicius et al. 2018; Megatron; FSDP2 MixedPrecisionPolicy): 16-bit weights and
    activations, fp32 main gradients, fp32 master weights and Adam moments (4 + 4 + 4 bytes). Pure bf16
    (a model cast to bf16 whose optimizer steps its bf16 parameters, as NeMo AutoModel trains): no master
    copy, bf16 gradients and Adam moments (2 + 2 + 2 + 2 bytes a parameter).
    """

    activation: int  # bytes per activation element
    param: int  # bytes per parameter of the compute copy of the weights
    grad: int  # bytes per parameter of the accumulated gradient
    optimizer: int  # bytes per parameter of optimizer state (master copy + Adam moments)
    optimizer_traffic: int  # bytes moved through HBM per parameter by one fused Adam step
    reduce: int = 0  # bytes per gradient element on the wire of data-parallel reductions (0: `grad`)
    master: int = 4  # bytes per parameter of the fp32 master copy counted in `optimizer` (0: the weights are it)

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element that data-parallel reductions move (FSDP's reduce_dtype)."""
        return self.reduce or self.grad

    def peak_flops(self, gpu: GPU) -> float:
        """Tensor-core peak FLOP/s at this precision (fp32 runs on TF32 tensor cores)."""
        return gpu.peak_flops if self.activation == 2 else gpu.peak_tf32_flops


# Adam traffic per parameter, mixed: read grad 4, read+write master 8, m 8, v 8, write 16-bit copy 2.
PRECISIONS: dict[str, PrecisionBytes] = {
    "bf16": PrecisionBytes(activation=2, param=2, grad=4, optimizer=12, optimizer_traffic=30),
    # Megatron keeps fp16 gradients in 16 bits unless told otherwise (accumulate_allreduce_grads_in_fp32).
    "fp16": PrecisionBytes(activation=2, param=2, grad=2, optimizer=12, optimizer_traffic=28),
    # fp32: weights are the master copy; Adam reads grad 4, read+write param 8, m 8, v 8.
    "fp32": PrecisionBytes(activation=4, param=4, grad=4, optimizer=8, optimizer_traffic=28, master=0),
    # Pure bf16: the bf16 weights are stepped in place; Adam reads grad 2, read+write param 4, m 4, v 4.
    "bf16-pure": PrecisionBytes(activation=2, param=2, grad=2, optimizer=4, optimizer_traffic=14, master=0),
}


REDUCE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per element of a gradient reduced in fp32 or bf16 (a plan's `grad_reduce`; "auto" keeps `grad`)."""


@lru_cache(maxsize=16)
def plan_precision(precision: str, grad_reduce: str = "auto") -> PrecisionBytes:
    """The storage of a plan's `precision` with its gradients reduced in `grad_reduce` (FSDP's reduce_dtype:
    PyTorch FSDP MixedPrecision(reduce_dtype=torch.bfloat16) halves the bytes of every reduce-scatter and
    all-reduce; the sharded gradient and the optimizer stay as they are)."""
    prec = PRECISIONS[precision]
    return prec if grad_reduce == "auto" else replace(prec, reduce=REDUCE_BYTES[grad_reduce])
