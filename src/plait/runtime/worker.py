"""Entry point of every torchrun rank: `python -m plait.runtime.worker CONFIG.json [CONFIG.json ...]`.

Several configs run one after the other in the same job (same ranks), which saves the launch of a job
per run (tests and benchmarks)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from plait.errors import PlaitError
from plait.runtime.launch import Failure, report_failure
from plait.runtime.multitask import MultitaskConfig
from plait.runtime.multitask import run as run_multitask
from plait.runtime.train import COLLECTIVE_TIMEOUT_S, TrainConfig, init_distributed, run

FAILURE_KEY = "plait/failure/"
"""Store key prefix under which a failing rank posts its Failure (JSON) for the ranks of other nodes."""
PEER_LOST_TEXTS = ("connection closed by peer", "connection reset by peer", "broken pipe")
"""What gloo's errors say when another rank's process went away (lower case)."""


def is_timeout(exc: BaseException) -> bool:
    """Whether `exc` is a collective or store operation that gave up waiting for another rank."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or isinstance(exc, dist.DistError) and "timeout" in text)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because another rank closed its connection."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in PEER_LOST_TEXTS)


def _post(failure: Failure) -> None:
    """Record `failure` in the job's store too, where ranks on other nodes find it (best effort: the store
    may be gone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{FAILURE_KEY}{failure.rank}", json.dumps(asdict(failure)))
    except Exception:  # noqa: BLE001 - the failure is reported locally anyway
        pass


def _peer_failure(rank: int) -> Failure | None:
    """The error another rank posted before it stopped, named by rank and node (None when none did)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        for other in range(dist.get_world_size()):
            if other != rank and store.check([f"{FAILURE_KEY}{other}"]):
                posted = Failure(**json.loads(store.get(f"{FAILURE_KEY}{other}")))
                if posted.kind == "error":
                    return Failure(rank, f"rank {other} on node {other // per_node}: {posted.message}")
    except Exception:  # noqa: BLE001 - the store went away with the failed node
        return None
    return None


def load_config(text: str) -> TrainConfig | MultitaskConfig:
    """A run's config from its JSON: `plait train --tasks` configs carry the units of a multitask plan."""
    data = json.loads(text)
    return MultitaskConfig(**data) if "units" in data else TrainConfig(**data)


def run_config(cfg: TrainConfig | MultitaskConfig, report=None) -> list[dict]:
    """Train `cfg` on this rank (rank 0 returns the metrics)."""
    if isinstance(cfg, MultitaskConfig):
        return run_multitask(cfg, report)
    return run(cfg, report=report)


def main(argv: list[str]) -> int:
    """Run every config on this rank; 0 on success, 2 after reporting bad input or a timed-out collective
    (`plait.runtime.launch.report_failure`)."""
    configs = [load_config(Path(path).read_text()) for path in argv]
    timeout_s = configs[0].timeout_s if configs else COLLECTIVE_TIMEOUT_S
    init_distributed(timeout_s)
    rank = dist.get_rank()
    try:
        for cfg in configs:
            if rank == 0:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

                bar = Progress(TextColumn("training"), BarColumn(),
                               TextColumn("{task.completed}/{task.total} steps"), TextColumn("{task.description}"),
                               TimeElapsedColumn())
                with bar:
                    task = bar.add_task("", total=cfg.steps)
                    metrics = run_config(cfg, report=lambda r, t=task, b=bar: b.update(
                        t, advance=1, description=f"loss {r['loss']:.4f} {r['tokens_per_s']:,.0f} tok/s"))
                if metrics and "memory_terms" in metrics[0]:
                    from rich.console import Console

                    from plait.runtime.memory import table

                    Console().print(table(metrics[0]["memory_terms"]))
            else:
                run_config(cfg)
            dist.barrier()
        return 0
    except PlaitError as exc:
        _exit_reported(Failure(rank, str(exc)))
    except MemoryError:
        _exit_reported(Failure(rank, f"rank {rank} ran out of host memory; use a smaller model, fewer ranks or a "
                                     "smaller --global-batch"))
    except Exception as exc:
        if is_peer_lost(exc):
            _exit_reported(_peer_failure(rank) or Failure(
                rank, f"rank {rank} lost its connection to another rank, which stopped without saying why; see "
                      "that rank's output (on another node: that node's launcher)", "lost"))
        if not is_timeout(exc):
            raise
        _exit_reported(Failure(rank, f"rank {rank} timed out in a collective", "timeout", timeout_s))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_reported(failure: Failure) -> None:
    """Report `failure` and end the rank with exit code 2 at once: the other ranks may be stuck in a
    collective with this one, so tearing the process group down could wait, and the communication threads
    would abort the interpreter's exit with a message of their own."""
    report_failure(failure)
    if dist.is_initialized():
        _post(failure)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
