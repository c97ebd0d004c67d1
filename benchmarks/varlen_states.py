"""Variable-length training's model states sharded over 4 gloo ranks (FSDP2, ZeRO-3) against replicated.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/varlen_states.py    # ~2 minutes

The same job (FlexSP layouts, same seed and documents) with `--varlen-states sharded` and `replicated`.
Printed per run: the first step's measured memory terms on the worst rank (`plait.runtime.memory`), what the
run added to the process (the peak less the interpreter's reserve), seconds per step and the losses. The
environment variable makes glibc map every allocation over 64 KiB on its own, so freed buffers (a layer's
gathered weights) leave the resident set, as they return to a GPU's caching allocator; without it the CPU
high-water mark keeps them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from train_run import plait_train

MODEL = "llama:layers=4,hidden=512,heads=8,kv_heads=4,ffn=1376,vocab=512,seq=256"
MIB = 2**20
console = Console(width=140)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    runs = {states: plait_train(states, tmp / f"{states}.jsonl", "--model", args.model, "--nproc", "4", "--steps",
                                str(args.steps), "--global-batch", "8", "--lr", "0.01", "--varlen", "flexsp",
                                "--capacity", "64", "--varlen-states", states)
            for states in ("sharded", "replicated")}
    table = Table(title="4 gloo ranks, FlexSP layouts, first step's peak on the worst rank (MiB)")
    for col in ("states", "weights", "grads", "optim", "activ", "buf", "added (peak - reserve)", "s / step", "losses"):
        table.add_column(col, justify="left" if col in ("states", "losses") else "right")
    added = {}
    for states, recs in runs.items():
        worst = max(recs[0]["memory_terms"], key=lambda t: t["total"] - t["reserve"])
        added[states] = worst["total"] - worst["reserve"]
        table.add_row(states, *(f"{worst[k] / MIB:.1f}" for k in ("weights", "grads", "optim", "activ", "buf")),
                      f"{added[states] / MIB:.1f}", f"{sum(r['step_time_s'] for r in recs) / len(recs):.2f}",
                      " ".join(f"{r['loss']:.9f}" for r in recs))
    console.print(table)
    diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(runs["sharded"], runs["replicated"]))
    console.print(f"measured: sharded states {added['sharded'] / added['replicated']:.2f}x the replicated run's "
                  f"peak per rank, losses equal within {diff:.1e}")


if __name__ == "__main__":
    main()
