"""`plait train` as a user runs it (a subprocess, one thread per rank), for the live benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def plait_train(name: str, metrics: Path, *args: str) -> list[dict]:
    """Run `plait train ARGS --metrics-out METRICS`; its per-step records, or exit naming the failed run."""
    cmd = [sys.executable, "-m", "plait.cli", "train", *args, "--metrics-out", str(metrics)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed: {proc.stderr[-2000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]
