"""How plait's launcher starts CPU ranks (`plait.runtime.launch`, `plait.runtime.rank`): each rank is a fork of one
server that imported plait's runtime already, and runs its script as `python SCRIPT ARGS` would (its arguments,
its directory on sys.path, the torchrun environment)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from helpers import ranks_command

HERE = Path(__file__).parent


def test_cpu_ranks_are_forks_of_a_server_that_imported_the_runtime(tmp_path) -> None:
    out = tmp_path / "probe"
    proc = subprocess.run(ranks_command(2, str(HERE / "rank_probe.py"), str(out), "--flag"), check=False,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    for rank in seen:
        assert rank == {"preloaded": True, "argv": [str(out), "--flag"], "sibling": "found", "world": "2"}
