"""Calibration: the achievable fractions of datasheet peaks that the analytic cost model uses.

Each field is a dimensionless fraction or a time, with where its default comes from. A profile measured
on real hardware (`plait profile`) replaces these defaults for the GPU type it was measured on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from plait.cached_hash import cached_hash

if TYPE_CHECKING:
    from plait.cost.measured import Measured
    from plait.cost.measured_memory import MeasuredMemory
    from plait.spec.cluster import GPU


@cached_hash
@dataclass(frozen=True)
class Calibration:
    """Achievable efficiencies of one GPU type and its links."""

    gemm_efficiency: float = 0.78
    """Fraction of the 16-bit tensor-core peak that a large, well-shaped cuBLAS GEMM sustains inside a
    training step (A100: 230-250 of 312 TFLOP/s measured for 8K x 6K x 2K fp16 GEMMs)."""
    gemm_k_overhead: float = 64.0
    """Elements of the reduction dimension k whose worth of time each output tile spends in prologue and
    epilogue: a GEMM's efficiency is scaled by k / (k + gemm_k_overhead). Small-k GEMMs (attention with
    head_dim 64-128) run at 50-70% of large ones on A100/H100."""
    gemm_tile: int = 128
    """Output tile edge (elements) for tile and wave quantisation (cuBLAS/CUTLASS 128x128 or 128x256
    tiles on Ampere/Hopper)."""
    flash_fwd_efficiency: float = 0.62
    """Fraction of peak that FlashAttention-2 forward reaches (A100, head_dim 128, 2K tokens: ~190 of 312
    TFLOP/s, Dao 2023, Fig. 4)."""
    flash_bwd_efficiency: float = 0.50
    """Fraction of peak that FlashAttention-2 backward reaches (~150-170 of 312 TFLOP/s on A100)."""
    causal_work_fraction: float = 0.5
    """Fraction of the s x s attention scores that a causal flash kernel computes (it skips masked
    blocks); eager attention computes all of them."""
    memory_efficiency: float = 0.8
    """Fraction of datasheet HBM bandwidth that fused elementwise kernels (norms, activations, softmax,
    optimizer) reach (STREAM-like copies reach 85-90% on A100/H100)."""
    kernel_overhead_s: float = 4e-6
    """Launch/idle time per kernel between back-to-back kernels in a step (eager PyTorch/Megatron ~3-5 us)."""
    nvlink_efficiency: float = 0.80
    """NCCL all-reduce bus bandwidth / NVLink per-direction peak inside a node (nccl-tests on DGX A100:
    ~230-240 of 300 GB/s)."""
    network_efficiency: float = 0.90
    """NCCL bus bandwidth / NIC line rate between nodes (DGX A100 8x HDR: ~180-190 of 200 GB/s)."""
    overlap_efficiency: float = 0.9
    """Fraction of an overlap window that background communication can actually use (SM and memory
    contention with the compute it hides behind)."""
    overlap_contention: float = 0.6
    """Fraction of compute throughput lost while a ZeRO-2/3 (FSDP) gather or reduce-scatter runs beside it:
    the hidden part of a collective of c seconds lengthens the compute by overlap_contention * c. NCCL ring
    kernels hold one SM per channel (24 of an H100's 132 SMs for an FSDP all-gather: 18%), the GEMMs that
    share the GPU then need an extra partial wave, and the copies compete for HBM; a 132-block GEMM beside an
    all-gather ran ~1.7x longer (NVIDIA developer forum, "Compute-communication overlap causes severe GEMM
    performance degradation because of tail effect", 2025). Chosen on the fitted FSDP rows of
    benchmarks/data/published_runs.json (held-out rows untouched) inside that physical range: from the SM
    share alone (0.18 on H100, 0.22 on A100) to the forum's 0.7."""
    fsdp_collective_overhead_s: float = 1.5e-3
    """Seconds each per-layer ZeRO-2/3 collective adds to its micro-batch pass beyond its transfer: FSDP's
    pre/post-forward and backward hooks in eager PyTorch, the flat-parameter copies around each gather and
    reduce-scatter, and the all-gather rate limiter (limit_all_gathers) that makes the compute stream wait for
    the previous unit's memory. Chosen with overlap_contention on the fitted FSDP rows (0.001-0.003 s span
    fitted medians of 3-9%); re-chosen (from 2e-3) once llm-foundry's rows were priced with their Triton
    attention (`attention: triton`): 1.5e-3 gives the smallest fitted maximum (17.7%, median 4.8%) of the grid
    overlap_contention 0.3-0.6 x 1-3 ms; it matters where layers are small or micro-batches short."""
    moe_exchange_overhead_s: float = 0.29e-3
    """Seconds each token exchange of an MoE layer under expert parallelism (a dispatch or a combine, forward
    or backward) takes beyond moving its bytes: Megatron's dropless dispatchers copy the received-token counts to
    the host before each dispatch (a sync that drains the GPU's queue), and every exchange waits for the
    slowest rank of the ep group to arrive. From a controlled, profiled run (Megatron-Bridge
    skills/nemo-mbridge-perf-moe-comm-overlap, commit 7ded17dae: Qwen3-30B-A3B on 16 H100, TP1 PP1 EP16, MBS1
    GBS1024, seq 4096, HybridEP, forced balance, expert-parallel overlap off): its Nsight profile counts 9.079
    ms of communication beside compute as 0.11% of all communication time, so 8.25 s of communication kernels
    in a 24.71 s step, of which the data-parallel collectives are ~0.03 s; plait prices the step's 12,288
    exchanges (48 layers x 64 micro-batches x 4) at 4.67 s from their bytes: (8.25 - 0.03 - 4.67) s / 12,288 =
    0.29 ms each (0.26-0.32 ms for 0.105-0.115%). Not chosen on any other row of
    benchmarks/data/published_runs.json (that run is a row of its own); a profile that times the exchange
    (`plait profile`, strategy `ep`) replaces it with the measured one."""
    ep_overlap_hidden: float = 0.46
    """Share of an MoE layer's token exchange that Megatron's expert-parallel overlap
    (--overlap-moe-expert-parallel-comm, `Plan.ep_overlap`) hides when the schedule pairs the micro-batch's pass
    with another's opposite pass: the exchanges run beside the other micro-batch's compute, slowed by the
    communication kernels' share of the SMs and exposed where one sub-module's exchange outlasts the compute it
    is paired with. From the same Megatron-Bridge A/B (overlap on: 20.99 s a step, off: 24.71 s): 3.73 s hidden
    of the 8.23 s of exchanges plait prices there, 63 of 64 micro-batches paired: 0.46. Checked on Megatron-MoE-
    ModelZoo's Qwen3-235B-A22B pair on 256 H100 (19.7 s off, 17.6 s on), a held-out row."""
    measured: Measured | None = None
    """Costs measured by `plait profile` on this device type (`plait.cost.measured`), preferred to the
    analytic formulas wherever they cover a case."""
    memory: MeasuredMemory | None = None
    """Memory terms measured on this device type (Galvatron's memory profile, `plait.cost.measured_memory`),
    preferred to the analytic activation and model-state bytes wherever they cover a case."""


DEFAULT_CALIBRATION = Calibration()

HOPPER_GEMM_EFFICIENCY = 0.72
"""H100/H200 GEMMs reach a smaller share of the datasheet peak than A100's: the best cuBLAS bf16 GEMM found by
a shape sweep is 794 of 989 TFLOP/s on H100 SXM (80%) against 271 of 312 on A100 SXM (87%) (S. Bekman,
ml-engineering, compute/accelerator "Maximum Achievable Matmul FLOPS" table), so A100's 0.78 scales to
0.78 x 0.80 / 0.87 = 0.72; plain 8192^3 cuBLAS runs measure 518 (CUDA 12.4, pranjalssh/fast.cu issue 13) to
797 TFLOP/s (PyTorch 2.7, zzc0721/torch-performance-test-data issue 79), power throttling with random data
(H. He 2024, "Strangely, matrix multiplications on GPUs run faster when given predictable data")."""

HOPPER_CALIBRATION = Calibration(gemm_efficiency=HOPPER_GEMM_EFFICIENCY, flash_fwd_efficiency=0.40,
                                 flash_bwd_efficiency=0.33)
"""H100/H200: GEMMs at HOPPER_GEMM_EFFICIENCY; FlashAttention-2 reaches ~335-400 of 989 TFLOP/s (Dao 2023;
Shah et al. 2024, FlashAttention-3, Fig. 1-2), a smaller share of the peak than on A100."""

V100_GEMM_EFFICIENCY = 0.45
"""Effective share of V100's 125 TFLOP/s fp16 tensor peak that a training step's GEMMs reach, everything
2019-2021 V100 software does that plait does not price lumped in (unfused eager softmax/dropout, apex
LayerNorm, fp16 loss scaling): chosen so that Megatron-LM's single-V100 baseline (Shoeybi et al. 2019, Sec. 5.1:
a 1.2B GPT-2, 40 layers, hidden 1536, 16 heads, batch 8, sequence 1024, activation checkpointing, "39
TeraFLOPs ... 30% of the theoretical peak") prices at 39.4 hardware TFLOP/s. Not chosen on any held-out row."""
V100_CALIBRATION = Calibration(gemm_efficiency=V100_GEMM_EFFICIENCY)
"""V100-32GB: GEMMs at V100_GEMM_EFFICIENCY, the rest as A100 (no FlashAttention on Volta; rows use eager)."""

CALIBRATIONS: dict[str, Calibration] = {
    "A100-40GB": DEFAULT_CALIBRATION,
    "A100-80GB": DEFAULT_CALIBRATION,
    "H100-80GB": HOPPER_CALIBRATION,
    "H200-141GB": HOPPER_CALIBRATION,
    "A800-80GB": DEFAULT_CALIBRATION,
    "GH200-96GB": HOPPER_CALIBRATION,
    "V100-32GB": V100_CALIBRATION,
}


FSDP_NCCL_CHANNEL_SMS = 24
"""SMs that the NCCL kernels of one ZeRO-2/3 gather or reduce-scatter hold while it runs, one per ring channel
(the SM share that `Calibration.overlap_contention` starts from: 24 of an H100's 132 SMs, of an A100's 108)."""


def megatron_fsdp(cal: Calibration, gpu: GPU) -> Calibration:
    """`cal` for ZeRO-3 run by Megatron-FSDP rather than PyTorch FSDP, from what its guide (Megatron-LM
    docs/user-guide/features/megatron_fsdp.md) says it does differently: it gathers into and reduce-scatters out
    of persistent double buffers registered with NCCL ("true zero-COPY data movement", "avoids redundant COPY
    operations before and after collectives"; "Double Buffering": no allocation after initialisation), so no
    per-collective hook, copy or rate-limiter time (`fsdp_collective_overhead_s` 0) and a contention of the NCCL
    kernels' SM share alone (FSDP_NCCL_CHANNEL_SMS / the GPU's SMs: 0.18 on H100), without PyTorch FSDP's copy
    traffic. Not chosen on any row."""
    return replace(cal, overlap_contention=FSDP_NCCL_CHANNEL_SMS / gpu.sm_count, fsdp_collective_overhead_s=0.0)


def calibration_for(gpu_name: str) -> Calibration:
    """The default calibration of a GPU type (A100-like for types without their own)."""
    return CALIBRATIONS.get(gpu_name, DEFAULT_CALIBRATION)
