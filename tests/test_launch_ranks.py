"""How plait's launcher starts CPU ranks (`plait.runtime.launch`, `plait.runtime.rank`): each rank is a fork of one
server that imported plait's runtime already, started before the launcher imports torch, and runs its script as
`python SCRIPT ARGS` would (its arguments, its directory on sys.path, the torchrun environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import ranks_command

HERE = Path(__file__).parent


def test_cpu_ranks_are_forks_of_a_server_that_imported_the_runtime(tmp_path) -> None:
    out, temp = tmp_path / "probe", tmp_path / "temp"
    temp.mkdir()
    proc = subprocess.run(ranks_command(2, str(HERE / "rank_probe.py"), str(out), "--flag"), check=False,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [p.name for p in temp.iterdir() if p.name.startswith(("torchelastic_", "plait-torchrun-"))]
    seen = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    for rank in seen:
        assert rank.pop("parent") > 0
        assert rank == {"preloaded": True, "argv": [str(out), "--flag"], "sibling": "found", "world": "2"}


EARLY = """
import json, multiprocessing.forkserver, os, sys, time
from plait.runtime import launch

argv, seen, early = sys.argv[1:], {}, launch._start_fork_server_early


def recorded(argv):
    seen["torch"] = "torch" in sys.modules
    early(argv)
    server = seen["server"] = multiprocessing.forkserver._forkserver._forkserver_pid
    seen["left"] = [n for n in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS") if n in os.environ]
    for _ in range(100):  # a process starting its program shows no environment for a moment
        text = open(f"/proc/{server}/environ").read() if server is not None else "-"
        if text:
            break
        time.sleep(0.1)
    if server is not None:
        env = dict(e.split("=", 1) for e in text.split(chr(0)) if "=" in e)
        seen.update(omp=env.get("OMP_NUM_THREADS"), unbuffered=env.get("PYTHONUNBUFFERED"))


launch._start_fork_server_early = recorded
if "--no-python" in argv:
    recorded(argv)
else:
    seen["code"] = launch.main(argv)
print(json.dumps(seen))
"""


def test_the_fork_server_starts_before_the_launcher_imports_torch(tmp_path) -> None:
    """The launcher starts the server first (it imports the runtime while the launcher imports torch), with the
    environment torchrun would give it later, and the ranks fork from it; none where torchrun runs the program
    as given."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")}
    out = tmp_path / "probe"
    args = ["--standalone", "--nproc-per-node=2", str(HERE / "rank_probe.py"), str(out)]
    proc = subprocess.run([sys.executable, "-c", EARLY, *args], check=False, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["server"] is not None and not seen["torch"] and seen["left"] == []
    assert (seen["omp"], seen["unbuffered"], seen["code"]) == ("1", "1", 0)
    assert {json.loads(Path(f"{out}.{rank}").read_text())["parent"] for rank in range(2)} == {seen["server"]}
    proc = subprocess.run([sys.executable, "-c", EARLY, "--no-python", *args], check=False, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1])["server"] is None
