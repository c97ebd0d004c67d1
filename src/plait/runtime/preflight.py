"""What `plait train` checks before it launches any rank: numbers in range, paths writable, disk space for
a checkpoint, host memory for the ranks. Each check raises PlaitError with one line saying what to change.

Nothing here imports torch: the checks cost milliseconds, not a process launch.
"""

from __future__ import annotations

import math
from pathlib import Path

from plait.errors import PlaitError
from plait.io import check_writable_dir, free_bytes
from plait.spec.model import ModelSpec

GIB = 2**30
MAX_LR = 1.0
"""Largest --lr (AdamW's peak learning rate; useful ones are far below)."""
CHECKPOINT_BYTES_PER_PARAM = 12
"""Bytes a checkpoint stores per parameter: fp32 weights and AdamW's two fp32 moments."""
INIT_BYTES_PER_PARAM = 4
"""Host bytes per parameter every rank holds while it builds the full fp32 model (before sharding it)."""
STATE_BYTES_PER_PARAM = 16
"""Host bytes per parameter of the training state summed over every rank: weights, gradients, two moments."""
RANK_BASE_BYTES = 300 * 2**20
"""Host bytes of one rank's process before the model (Python, torch, the process group)."""
SWITCH_VIA = ("network", "dcp")
"""How a plan switch moves state (`plait.runtime.stragglers`): from old to new owners over the network, or a
DCP save and resharded load."""
DTYPES = ("fp32", "bf16", "bf16-pure")
"""What `plait train --dtype` trains in: fp32; bf16 autocast over fp32 weights and optimizer (mixed precision);
pure bf16 (bf16 weights, gradients and Adam moments, no fp32 master)."""
REPLAN_DEGREES = ("any", "keep")
"""What a live re-plan may change (`plait.runtime.stragglers`): any degree, or keep the current tp and pp
degrees."""


def check_numbers(*, lr: float, seed: int, timeout_s: float) -> None:
    """Refuse a learning rate outside (0, MAX_LR], a negative or too large seed, and a non-positive or
    non-finite collective timeout (seconds)."""
    if not (math.isfinite(lr) and 0 < lr <= MAX_LR):
        raise PlaitError(f"--lr must be a positive number up to {MAX_LR:g}, got {lr}; e.g. --lr 3e-4")
    if not 0 <= seed < 2**63:
        raise PlaitError(f"--seed must be an integer from 0 to 2^63-1, got {seed}")
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= 86400):
        raise PlaitError(f"--timeout must be a number of seconds in (0, 86400], got {timeout_s}")


def check_dtype(dtype: str, offloads: set[str] | frozenset[str] = frozenset()) -> None:
    """Refuse a --dtype outside DTYPES, and pure bf16 with an offloaded optimizer (`offloads`: the plan's
    strategies' offload choices), which steps fp32 master weights on the host."""
    if dtype not in DTYPES:
        raise PlaitError(f"--dtype must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {dtype!r}")
    if dtype == "bf16-pure" and (offloaded := set(offloads) - {"none"}):
        raise PlaitError(f"--dtype bf16-pure keeps no fp32 master weights, which offload={min(offloaded)} steps "
                         "on the host; train it with --dtype fp32 or bf16")


def check_replan_degrees(value: str) -> None:
    """Refuse a --replan-degrees other than those of `REPLAN_DEGREES`."""
    if value not in REPLAN_DEGREES:
        raise PlaitError(f"--replan-degrees must be {' or '.join(REPLAN_DEGREES)}, got {value!r}")


def check_switch_via(value: str) -> None:
    """Refuse a --switch-via other than those of `SWITCH_VIA`."""
    if value not in SWITCH_VIA:
        raise PlaitError(f"--switch-via must be {' or '.join(SWITCH_VIA)}, got {value!r}")


def check_seq_len(seq_len: int | None, model: ModelSpec) -> None:
    """Refuse a sequence length (tokens) the model cannot take (None: not given, nothing to check)."""
    if seq_len is None:
        return
    if seq_len <= 0:
        raise PlaitError(f"--seq-len must be a positive number of tokens, got {seq_len}")
    if seq_len > model.max_seq_len:
        raise PlaitError(f"--seq-len {seq_len} exceeds {model.name}'s {model.max_seq_len} positions; give "
                         f"--seq-len {model.max_seq_len} or less")


def checkpoint_bytes(model: ModelSpec) -> int:
    """Bytes one checkpoint of `model` takes on disk (model and optimizer state)."""
    return int(model.params * CHECKPOINT_BYTES_PER_PARAM)


def check_checkpoint_dir(directory: Path, model: ModelSpec, *, free: int | None = None) -> None:
    """Refuse a checkpoint directory that is a file, cannot be written, or lacks the space for one more
    checkpoint (`free`: bytes available, measured when None)."""
    if directory.exists() and not directory.is_dir():
        raise PlaitError(f"--checkpoint-dir {str(directory)!r} is a file; give a directory")
    check_writable_dir(directory, "--checkpoint-dir")
    need = checkpoint_bytes(model)
    free = free_bytes(directory) if free is None else free
    if free < need:
        raise PlaitError(f"--checkpoint-dir {str(directory)!r} has {free / GIB:.2f} GiB free but a checkpoint of "
                         f"{model.name} takes about {need / GIB:.2f} GiB; free space or give another directory")


def host_memory_bytes() -> int:
    """Bytes of host memory available for new processes (MemAvailable; total memory where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_need(model: ModelSpec, ranks: int) -> int:
    """A lower bound on the host bytes `ranks` local ranks need to train `model`: every rank builds the full
    fp32 model before sharding it, and the training state lives somewhere at least once."""
    per_rank = RANK_BASE_BYTES + INIT_BYTES_PER_PARAM * model.params
    return int(max(ranks * per_rank, STATE_BYTES_PER_PARAM * model.params + ranks * RANK_BASE_BYTES))


def check_host_memory(model: ModelSpec, ranks: int, *, available: int | None = None) -> None:
    """Refuse a run whose ranks cannot fit in host memory (`available` bytes, measured when None)."""
    need = host_memory_need(model, ranks)
    available = host_memory_bytes() if available is None else available
    if need > available:
        raise PlaitError(f"training {model.name} ({model.params / 1e9:.2f}B parameters) on {ranks} rank(s) needs at "
                         f"least {need / GIB:.1f} GiB of host memory (fp32 weights on every rank while it builds the "
                         f"model; weights, gradients and AdamW state once in all) but {available / GIB:.1f} GiB is "
                         "available; use a smaller model or fewer ranks")
