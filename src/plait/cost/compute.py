"""Compute time of kernels on one GPU: GEMMs, attention, and memory-bound elementwise work.

A GEMM's time is its FLOPs at an efficiency that falls for small matrices (tile and wave quantisation over
the GPU's SMs, and a fixed per-tile overhead along k), bounded below by the time to move its operands
through HBM. Elementwise kernels are bytes / achievable HBM bandwidth. Times are seconds.
"""

from __future__ import annotations

import math
from functools import lru_cache

from plait.cost.calibration import Calibration
from plait.spec.cluster import GPU


@lru_cache(maxsize=65536)
def gemm_time(m: int, n: int, k: int, gpu: GPU, cal: Calibration, peak_flops: float, elem_bytes: int,
              batch: int = 1) -> float:
    """Seconds for `batch` products [m, k] @ [k, n] (one kernel) with `elem_bytes`-byte operands on
    `gpu` at `peak_flops`."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    # cuBLAS shrinks tiles for skinny products (down to 16 wide); smaller tiles have lower arithmetic
    # intensity, so they run at sqrt(area ratio) of a full tile's rate.
    tm, tn = _tile(m, cal.gemm_tile), _tile(n, cal.gemm_tile)
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / gpu.sm_count)
    # Useful fraction of the tile work actually launched (partial tiles and the last partial wave).
    quantisation = batch * m * n / (waves * gpu.sm_count * tm * tn)
    small_tiles = math.sqrt(tm * tn) / cal.gemm_tile
    efficiency = cal.gemm_efficiency * quantisation * small_tiles * k / (k + cal.gemm_k_overhead)
    flop_time = 2.0 * batch * m * n * k / (peak_flops * efficiency)
    memory_time = batch * elem_bytes * (m * k + k * n + m * n) / (gpu.hbm_bandwidth * cal.memory_efficiency)
    return max(flop_time, memory_time) + cal.kernel_overhead_s


def _tile(dim: int, full: int) -> int:
    """Tile edge cuBLAS would use along a dimension of `dim` elements (a power of two, 16..full)."""
    return min(full, max(16, 1 << (dim - 1).bit_length()))


def elementwise_time(bytes_moved: float, gpu: GPU, cal: Calibration, kernels: int = 1) -> float:
    """Seconds for memory-bound kernels that read and write `bytes_moved` bytes in all."""
    return bytes_moved / (gpu.hbm_bandwidth * cal.memory_efficiency) + kernels * cal.kernel_overhead_s


TRITON_FLASH_FWD_SLOWDOWN = 1.4
"""Forward time of the Triton FlashAttention (flash_attn_triton.py) over FlashAttention-2's at the same shape
(dimensionless): "FlashAttention-2 is around 1.3-1.5x faster than FlashAttention in Triton in the forward pass"
(Dao 2023, FlashAttention-2, Section 4.1, A100 80GB, head_dim 64/128, sequence 512-16K); the midpoint."""
TRITON_FLASH_BWD_SLOWDOWN = 2.0
"""Backward time of the Triton FlashAttention over FlashAttention-2's (dimensionless): "around 2x faster in the
backward pass" (Dao 2023, Section 4.1)."""


def flash_attention_time(batch_heads: int, seq_q: int, seq_kv: int, head_dim: int, causal: bool,
                         cal: Calibration, peak_flops: float, kernel: str = "flash") -> tuple[float, float]:
    """(forward, backward) seconds of a fused attention kernel over `batch_heads` (sequence, head) pairs.

    `kernel` "flash" is FlashAttention-2 class; "triton" is the Triton FlashAttention, slower by
    TRITON_FLASH_FWD/BWD_SLOWDOWN, whose tiles span a power-of-two head dimension (BLOCK_HEADDIM =
    next_power_of_2(head_dim) in flash_attn_triton.py), so a head_dim of 112 computes 128 columns."""
    work = cal.causal_work_fraction if causal else 1.0
    fwd_slow, bwd_slow = 1.0, 1.0
    if kernel == "triton":
        head_dim = max(16, 1 << (head_dim - 1).bit_length())
        fwd_slow, bwd_slow = TRITON_FLASH_FWD_SLOWDOWN, TRITON_FLASH_BWD_SLOWDOWN
    flops = 4.0 * batch_heads * seq_q * seq_kv * head_dim * work  # QK^T and PV
    fwd = fwd_slow * flops / (peak_flops * cal.flash_fwd_efficiency) + cal.kernel_overhead_s
    bwd = bwd_slow * 2.5 * flops / (peak_flops * cal.flash_bwd_efficiency) + cal.kernel_overhead_s  # 5 GEMMs vs 2
    return fwd, bwd


def eager_attention_time(batch_heads: int, seq: int, head_dim: int, dropout: bool, gpu: GPU,
                         cal: Calibration, peak_flops: float, elem_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of unfused attention: batched QK^T, masked softmax, dropout, PV.

    Forward moves per score: softmax read+write (2 x elem), dropout read+write + 1-byte mask; backward
    about twice that. GEMMs backward are two GEMMs per forward GEMM.
    """
    qk = gemm_time(seq, seq, head_dim, gpu, cal, peak_flops, elem_bytes, batch_heads)
    pv = gemm_time(seq, head_dim, seq, gpu, cal, peak_flops, elem_bytes, batch_heads)
    scores = batch_heads * seq * seq
    per_score = 2 * elem_bytes + ((2 * elem_bytes + 1) if dropout else 0)
    fwd_elem = elementwise_time(scores * per_score, gpu, cal, kernels=2)
    bwd_elem = elementwise_time(scores * (2 * per_score + elem_bytes), gpu, cal, kernels=2)
    return qk + pv + fwd_elem, 2 * (qk + pv) + bwd_elem
