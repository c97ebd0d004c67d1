"""The one training loop: fixed-length plans (`plait.runtime.train`) and variable-length documents planned
every step (`plait.runtime.varlen`) both run through `train_loop`.

The loop owns what every run does the same way: the steps from the one resumed at to the last, fault
injection, the learning-rate schedule, the step's start time, plan-switching hooks at step boundaries,
rank 0's metrics (kept, appended to --metrics-out, handed to the progress report) and checkpoints. A
`Stepper` owns its batch source and its per-step plan: it trains one step and describes it in a record.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from plait.errors import PlaitError


class Stepper(Protocol):
    """One path's steps: its batches (fixed global batches, or documents packed per step), its plan for each
    step, and what it saves."""

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """This rank's optimizers now (a plan switch may replace them)."""
        ...

    def before_step(self, step: int) -> None:
        """Untimed work before a step (e.g. simulated stragglers taking effect)."""

    def train_step(self, step: int, t0: float) -> dict:
        """Train step `step` (its clock started at `t0`, `time.perf_counter` seconds) and return its record:
        at least step, loss, step_time_s, tokens_per_s, lr, grad_norm, peak_memory_bytes."""
        ...

    def after_step(self, step: int, record: dict) -> None:
        """The plan-switching hook: every rank may switch plans here, at the same step boundary (it may add
        to `record`)."""

    def save(self, done: int) -> None:
        """Save a checkpoint taken after `done` steps."""

    def close(self) -> None:
        """Release what the stepper started (threads, injected slowdowns)."""


def lr_at(step: int, cfg) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak over the run."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def step_optimizers(optimizers: list[torch.optim.Optimizer]) -> None:
    """Apply the step's gradients and drop them."""
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_loop(cfg, stepper: Stepper, start: int = 0, report: Callable[[dict], None] | None = None,
               before_step: Callable[[int], None] | None = None) -> list[dict]:
    """Steps `start` .. cfg.steps - 1 of `stepper`; returns (on rank 0) one metrics dict per step.
    `report(record)` gets each step's metrics on rank 0; `before_step(step)` runs on every rank before a
    step is timed. Checkpoints go to cfg.checkpoint_dir every cfg.checkpoint_every steps and after the last."""
    rank = dist.get_rank()
    metrics: list[dict] = []
    out = open_metrics(cfg.metrics_out, start) if rank == 0 else None
    try:
        for step in range(start, cfg.steps):
            _maybe_fail(step, rank)
            if before_step:
                before_step(step)
            stepper.before_step(step)
            t0 = time.perf_counter()
            for optimizer in stepper.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step, cfg)
            record = stepper.train_step(step, t0)
            stepper.after_step(step, record)
            if rank == 0:
                publish(record, metrics, out, report)
            done = step + 1
            if cfg.checkpoint_dir and (done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)):
                stepper.save(done)
    finally:
        if out:
            out.close()
        stepper.close()
    return metrics


def publish(record: dict, metrics: list[dict], out, report) -> None:
    """Rank 0's end of a step: keep the record, append it to the metrics file, hand it to `report`."""
    metrics.append(record)
    if out:
        out.write(json.dumps(record) + "\n")
        out.flush()
    if report:
        report(record)


def open_metrics(path: str | None, start: int):
    """The metrics file for appending, keeping only the records of steps before `start` (a resumed run
    neither loses nor repeats a step)."""
    if not path:
        return None
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if file.exists() and start > 0:
        kept = [line for line in file.read_text().splitlines() if line and json.loads(line)["step"] < start]
    file.write_text("".join(line + "\n" for line in kept))
    return file.open("a")


def _maybe_fail(step: int, rank: int) -> None:
    """Fault injection for restart tests: PLAIT_FAIL_AT_STEP=k kills rank PLAIT_FAIL_RANK (default 1) at
    step k, once (PLAIT_FAIL_MARKER names a file that records it happened); with PLAIT_FAIL_MODE=hang the
    rank stops answering instead, with PLAIT_FAIL_MODE=error it fails with a PlaitError."""
    at = os.environ.get("PLAIT_FAIL_AT_STEP")
    marker = os.environ.get("PLAIT_FAIL_MARKER")
    if at is None or marker is None or int(at) != step or rank != int(os.environ.get("PLAIT_FAIL_RANK", "1")):
        return
    if not os.path.exists(marker):
        Path(marker).write_text(str(step))
        if os.environ.get("PLAIT_FAIL_MODE") == "hang":
            time.sleep(10**6)
        if os.environ.get("PLAIT_FAIL_MODE") == "error":
            raise PlaitError(f"injected failure on rank {rank} at step {step}")
        os._exit(1)
