"""What this device is and what one rank of it sustains: a large GEMM's FLOP/s and a large copy's bytes/s
(the analytic model's fallbacks where no layer was measured)."""

from __future__ import annotations

import os
import platform
import time

import torch

from plait.cost.profile_file import Device

GEMM_SIZE = 1024
"""Edge of the square GEMM whose rate stands for the device's peak (large enough to be compute bound)."""
COPY_BYTES = 64 * 2**20
"""Bytes of the copy whose rate stands for the memory bandwidth (far larger than the caches)."""
REPEATS = 5


def _best_seconds(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):  # noqa: SIM115 -- read once, closed at exit of the loop
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_device(ranks: int, gpu_type: str | None = None, dtype: str = "fp32") -> Device:
    """Measure one rank of this machine (with the thread count a training rank uses: 1 on CPU), its GEMM rate
    in `dtype` ("fp32" or "bf16"). On CPU the memory per rank is the machine's memory shared by `ranks`
    ranks."""
    from plait.profile.layers import TORCH_DTYPES

    cuda = torch.cuda.is_available()
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    try:
        device = "cuda" if cuda else "cpu"
        a = torch.randn(GEMM_SIZE, GEMM_SIZE, device=device, dtype=TORCH_DTYPES[dtype])
        b = torch.randn(GEMM_SIZE, GEMM_SIZE, device=device, dtype=TORCH_DTYPES[dtype])
        flops = 2 * GEMM_SIZE**3 / _best_seconds(lambda: a @ b)
        src = torch.empty(COPY_BYTES // 4, device=device)
        dst = torch.empty_like(src)
        bandwidth = 2 * COPY_BYTES / _best_seconds(lambda: dst.copy_(src))  # read + write
    finally:
        torch.set_num_threads(threads)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        name, memory = props.name, float(props.total_memory)
    else:
        name = _cpu_name()
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks
    return Device(kind="cuda" if cuda else "cpu", gpu_type=gpu_type or ("CPU" if not cuda else name), name=name,
                  threads=1 if not cuda else threads, cores=os.cpu_count() or 1, memory_bytes=memory, peak_flops=flops,
                  memory_bandwidth=bandwidth, torch=torch.__version__)
