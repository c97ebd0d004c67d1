"""One rank of the collective measurement (started by plait's launcher from `plait.profile.collectives`).

    python -m plait.runtime.launch --standalone --nproc-per-node=N -m plait.profile.collectives_worker \
        OUT.json --sizes 4096,65536 [--quick] [--model SPEC]

Every rank measures all-reduce, all-gather, reduce-scatter and all-to-all over the groups of ranks 0..g-1
for g in `group_sizes(N)`, p2p between ranks 0 and 1, how a GEMM loop and an all-reduce slow each other
down, and with `--model SPEC` that model's block under each parallel strategy
(plait.profile.strategy_blocks). Rank 0 prints one `PROGRESS_PREFIX` line per finished item to stdout and
writes the raw samples (bytes per rank, seconds) to OUT.json; the parent fits them. A failure prints one `ERROR_PREFIX` line to
stderr and exits with 1. Units: seconds, bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from plait.io import write_atomically
from plait.profile.collectives import ELEMENT_BYTES, ERROR_PREFIX, GROUP_OPS, PROGRESS_PREFIX, group_sizes

DTYPE = torch.float32  # ELEMENT_BYTES bytes an element

MAX_REPS = 20  # timed repetitions of a small message
QUICK_MAX_REPS = 10
MIN_REPS = 3  # timed repetitions of the largest messages
QUICK_MIN_REPS = 3
REP_BYTES_BUDGET = 64 * 2**20
"""Bytes per rank that the timed repetitions of one size may move: large messages get fewer repetitions."""

ORPHAN_CHECK_S = 1.0
"""Seconds between checks that torchrun (the parent) still lives; an orphaned rank exits."""


@dataclass(frozen=True)
class OverlapSetup:
    """The fixed work of the overlap measurement on one kind of device."""

    gemm_dim: int  # square matrices of this side
    gemm_iters: int  # GEMMs per compute loop
    comm_bytes: int  # bytes per rank of the all-reduce
    reps: int  # timed repetitions after one warm-up


# Each sized so that the GEMM loop alone takes about as long as the all-reduce alone, or a bit longer (a
# 256-wide fp32 GEMM takes ~0.9 ms on one CPU thread, a 16 MiB gloo all-reduce of 2 ranks ~20-35 ms here;
# a 4096-wide one ~2-3 ms on an H100 in fp32, a 256 MiB NCCL all-reduce of 8 NVLink GPUs ~2-3 ms).
OVERLAP_SETUPS = {
    ("cpu", False): OverlapSetup(gemm_dim=256, gemm_iters=48, comm_bytes=16 * 2**20, reps=5),
    ("cpu", True): OverlapSetup(gemm_dim=256, gemm_iters=16, comm_bytes=4 * 2**20, reps=2),
    ("cuda", False): OverlapSetup(gemm_dim=4096, gemm_iters=8, comm_bytes=256 * 2**20, reps=5),
    ("cuda", True): OverlapSetup(gemm_dim=4096, gemm_iters=2, comm_bytes=64 * 2**20, reps=2),
}


def repetitions(nbytes: int, quick: bool) -> int:
    """Timed repetitions of one message of `nbytes` bytes per rank: fewer for large messages."""
    high, low = (QUICK_MAX_REPS, QUICK_MIN_REPS) if quick else (MAX_REPS, MIN_REPS)
    return max(low, min(high, REP_BYTES_BUDGET // max(nbytes, 1)))


def _sync(device: torch.device) -> None:
    """Wait for queued device work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Line the ranks of `group` up: a one-element all-reduce that works on gloo and NCCL alike."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    _sync(device)


def _max_over_ranks(values: list[float], group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    """The element-wise maximum of `values` over the ranks of `group`."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def _time_reps(run: Callable[[], None], reps: int, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """Median over `reps` repetitions of the slowest rank's seconds for one `run()`, after one warm-up."""
    run()
    _sync(device)
    seconds = []
    for _ in range(reps):
        _barrier(group, device)
        start = time.perf_counter()
        run()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(_max_over_ranks(seconds, group, device))


def _elements(nbytes: int, g: int) -> int:
    """DTYPE elements of a `nbytes`-byte buffer, rounded down to a multiple of the group size (at least g)."""
    return max(g, nbytes // ELEMENT_BYTES // g * g)


def _collective(op: str, nbytes: int, g: int, group: dist.ProcessGroup,
                device: torch.device) -> tuple[int, Callable[[], None]]:
    """(bytes per rank as `CollectiveSample.bytes` counts them, a function that runs `op` once)."""
    n = _elements(nbytes, g)
    full = torch.zeros(n, dtype=DTYPE, device=device)  # zeros: repeated sums never overflow
    part = torch.zeros(n // g, dtype=DTYPE, device=device)
    # torch 2.13 deprecates the *_tensor names in favour of *_single; older versions only have the former.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op == "all_reduce":
        def run() -> None:
            dist.all_reduce(full, group=group)
    elif op == "all_gather":  # bytes: the gathered output
        def run() -> None:
            gather(full, part, group=group)
    elif op == "reduce_scatter":  # bytes: the input
        def run() -> None:
            scatter(part, full, group=group)
    elif op == "all_to_all":
        out = torch.empty_like(full)

        def run() -> None:
            dist.all_to_all_single(out, full, group=group)
    else:
        raise ValueError(f"unknown collective {op!r}")
    return n * ELEMENT_BYTES, run


def _ping_pong(nbytes: int, rank: int, device: torch.device) -> tuple[int, Callable[[], None]]:
    """(message bytes, a function that sends a message 0 -> 1 and back) for ranks 0 and 1."""
    n = _elements(nbytes, 1)
    message = torch.ones(n, dtype=DTYPE, device=device)
    reply = torch.empty_like(message)
    peer = 1 - rank

    def run() -> None:
        if rank == 0:
            dist.send(message, peer)
            dist.recv(reply, peer)
        else:
            dist.recv(reply, peer)
            dist.send(message, peer)

    return n * ELEMENT_BYTES, run


def measure_curve(op: str, g: int, group: dist.ProcessGroup, sizes: list[int], quick: bool,
                  device: torch.device) -> list[dict[str, float]]:
    """Samples {bytes, seconds} of `op` over ranks 0..g-1 (call on those ranks only); p2p takes seconds per
    one-way message, half a round trip."""
    rank = dist.get_rank()
    samples = []
    for size in sizes:
        if op == "p2p":
            nbytes, run = _ping_pong(size, rank, device)
            seconds = _time_reps(run, repetitions(nbytes, quick), group, device) / 2
        else:
            nbytes, run = _collective(op, size, g, group, device)
            seconds = _time_reps(run, repetitions(nbytes, quick), group, device)
        samples.append({"bytes": float(nbytes), "seconds": seconds})
    return samples


def _gemm_loop(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, iters: int,
               poll: Callable[[], None] | None = None) -> None:
    """`iters` matrix products into `out`, calling `poll` after each."""
    for _ in range(iters):
        torch.mm(a, b, out=out)
        if poll is not None:
            poll()


def _overlapped_cpu(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, x: torch.Tensor,
                    setup: OverlapSetup) -> tuple[float, float]:
    """(compute seconds, comm seconds) of a GEMM loop run while an async all-reduce is in flight (CPU).

    The all-reduce's end is the first time `is_completed()` is seen between GEMMs (or its `wait()` when the
    loop ends first), so a longer compute loop does not inflate the communication time.
    """
    comm_end: list[float] = []

    def poll() -> None:
        if not comm_end and work.is_completed():
            comm_end.append(time.perf_counter())

    comm_start = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    compute_start = time.perf_counter()
    _gemm_loop(a, b, out, setup.gemm_iters, poll)
    compute_end = time.perf_counter()
    work.wait()
    if not comm_end:
        comm_end.append(time.perf_counter())
    return compute_end - compute_start, comm_end[0] - comm_start


def _overlapped_cuda(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, x: torch.Tensor, setup: OverlapSetup,
                     device: torch.device) -> tuple[float, float]:
    """(compute seconds, comm seconds) of a GEMM loop run while an async all-reduce is in flight (CUDA).

    CUDA events time both: the comm ends at an event recorded on a side stream that waits for the NCCL work.
    """
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    comm_start, comm_end, compute_start, compute_end = events
    side = torch.cuda.Stream(device)
    comm_start.record()
    work = dist.all_reduce(x, async_op=True)
    with torch.cuda.stream(side):
        work.wait()  # makes the side stream wait for the all-reduce, without blocking the host
        comm_end.record(side)
    compute_start.record()
    _gemm_loop(a, b, out, setup.gemm_iters)
    compute_end.record()
    torch.cuda.synchronize(device)
    ms_to_s = 1e-3
    return compute_start.elapsed_time(compute_end) * ms_to_s, comm_start.elapsed_time(comm_end) * ms_to_s


def measure_overlap(quick: bool, device: torch.device) -> dict[str, float]:
    """Seconds of a fixed GEMM loop and an all-reduce over all ranks, each alone and overlapped (slowest rank
    per repetition, median over repetitions)."""
    setup = OVERLAP_SETUPS[(device.type, quick)]
    a = torch.randn(setup.gemm_dim, setup.gemm_dim, dtype=DTYPE, device=device)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    x = torch.zeros(setup.comm_bytes // ELEMENT_BYTES, dtype=DTYPE, device=device)

    def compute_alone() -> float:
        _barrier(None, device)
        start = time.perf_counter()
        _gemm_loop(a, b, out, setup.gemm_iters)
        _sync(device)
        return time.perf_counter() - start

    def comm_alone() -> float:
        _barrier(None, device)
        start = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        return time.perf_counter() - start

    def overlapped() -> tuple[float, float]:
        _barrier(None, device)
        if device.type == "cuda":
            return _overlapped_cuda(a, b, out, x, setup, device)
        return _overlapped_cpu(a, b, out, x, setup)

    compute_alone(), comm_alone(), overlapped()  # warm-up
    rows = [(compute_alone(), comm_alone(), *overlapped()) for _ in range(setup.reps)]
    flat = _max_over_ranks([v for row in rows for v in row], None, device)
    columns = [statistics.median(flat[i::4]) for i in range(4)]
    return dict(zip(("compute_alone_s", "comm_alone_s", "compute_overlapped_s", "comm_overlapped_s"), columns))


def rank_device() -> torch.device:
    """The device this rank's collectives use (the one `init_distributed` selected)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _progress(rank: int, what: str) -> None:
    if rank == 0:
        print(f"{PROGRESS_PREFIX} {what}", flush=True)


def measure(sizes: list[int], quick: bool, model: str | None = None, dtype: str = "fp32") -> dict:
    """Everything, on a joined process group: {"curves": [{op, ranks, samples}], "overlap": {...},
    "strategies": [{kind, group, ranks, samples}]} (strategies of `model`'s block, if given)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    groups = {g: dist.new_group(list(range(g))) for g in group_sizes(world)}  # same order on every rank
    plan = [(op, g) for op in GROUP_OPS for g in groups] + [("p2p", 2)]
    curves = []
    for op, g in plan:
        if rank < g:
            samples = measure_curve(op, g, groups[g], sizes, quick, device)
            curves.append({"op": op, "ranks": g, "samples": samples})
        _barrier(None, device)  # ranks outside the group wait here, not inside the next item
        _progress(rank, f"{op} {g}")
    overlap = measure_overlap(quick, device)
    _progress(rank, "overlap")
    strategies = []
    if model is not None:
        from plait.profile import strategy_blocks
        from plait.spec.model import load_model

        spec = load_model(model)
        items = strategy_blocks.planned_items(spec, world, group_sizes(world))
        passes: dict[tuple, list[dict]] = {item: [] for item in items}
        for _ in range(strategy_blocks.PASSES):
            for item in items:
                raw = strategy_blocks.measure_item(spec, item, quick, dtype)
                if raw is not None:
                    passes[item].append(raw)
                _barrier(None, device)
                _progress(rank, " ".join(map(str, item)))
        strategies = [strategy_blocks.merge(p) for p in passes.values() if p]
    return {"world": world, "backend": dist.get_backend(), "curves": curves, "overlap": overlap,
            "strategies": strategies}


FIRST_STEP_DIMS = {"layers": 1, "hidden": 64, "heads": 2, "kv_heads": 2, "ffn": 128, "vocab": 64}
"""A model this small adds nothing measurable but the code and state a rank's first step loads."""


def _first_step(model: str | None) -> None:
    """One training step of a tiny model of `model`'s family (llama by default) through the model code,
    autograd, clipping and AdamW, then freed: what every training rank loads on its first step stays
    resident (and belongs to the rank's fixed memory), the tiny model itself does not."""
    import gc
    from dataclasses import replace

    from plait.models import build_model
    from plait.runtime.train import clip_grads
    from plait.spec.model import load_model

    spec = load_model(model or "tiny-llama")
    tiny = build_model(replace(spec, mixed=(), **FIRST_STEP_DIMS, head_dim=32))  # the trunk decoder layer
    optimizer = torch.optim.AdamW(tiny.parameters())
    tiny(torch.zeros(1, 16, dtype=torch.long)).float().sum().backward()
    clip_grads(list(tiny.parameters()), 1.0, None)
    optimizer.step()
    del tiny, optimizer
    gc.collect()


def _exit_when_orphaned(parent: int) -> None:
    """Exit this process when its parent (torchrun) is gone, so that a killed job leaves no ranks behind."""
    while True:
        time.sleep(ORPHAN_CHECK_S)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str] | None = None) -> int:
    """Join the torchrun job, measure, and (rank 0) write the results; 0 on success, 1 on failure."""
    parser = argparse.ArgumentParser(prog="plait.profile.collectives_worker")
    parser.add_argument("out", type=Path, help="JSON file for the results (written by rank 0)")
    parser.add_argument("--sizes", required=True, help="comma-separated message bytes per rank")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller overlap test")
    parser.add_argument("--model", help="also time this model's block under each parallel strategy")
    parser.add_argument("--dtype", default="fp32", help="the model's weights and activations: fp32 or bf16")
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    rank = int(os.environ.get("RANK", "0"))
    try:
        import torch.distributed.pipelining  # everything a training rank loads

        import plait.runtime.parallelize  # noqa: F401
        from plait.runtime.memory import resident_bytes
        from plait.runtime.train import init_distributed

        sizes = [int(s) for s in args.sizes.split(",")]
        init_distributed()
        torch.set_num_threads(1)
        rank = dist.get_rank()
        _first_step(args.model)
        resident = resident_bytes()  # a rank with the runtime loaded, run once, and the process group up
        result = measure(sizes, args.quick, args.model, args.dtype) | {"process_bytes": resident}
        if rank == 0:
            write_atomically(args.out, json.dumps(result) + "\n")
        _barrier(None, rank_device())  # before destroy: avoids a rare abort at exit (see the notes)
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        message = " ".join(str(exc).split()) or "no message"
        print(f"{ERROR_PREFIX} rank {rank}: {type(exc).__name__}: {message}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
