"""Entry point of every torchrun rank: `python -m plait.runtime.worker CONFIG.json [CONFIG.json ...]`.

Several configs run one after the other in the same job (same ranks), which saves the launch of a job
per run (tests and benchmarks)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from plait.errors import PlaitError
from plait.runtime.train import TrainConfig, init_distributed, run


def main(argv: list[str]) -> int:
    configs = [TrainConfig.from_json(Path(path).read_text()) for path in argv]
    init_distributed()
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
                    metrics = run(cfg, report=lambda r, t=task, b=bar: b.update(
                        t, advance=1, description=f"loss {r['loss']:.4f} {r['tokens_per_s']:,.0f} tok/s"))
                if metrics and "memory_terms" in metrics[0]:
                    from rich.console import Console

                    from plait.runtime.memory import table

                    Console().print(table(metrics[0]["memory_terms"]))
            else:
                run(cfg)
            dist.barrier()
        return 0
    except PlaitError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
