"""`plait train` over several machines, tested with two launchers on this machine forming a 2-node job on
localhost: the losses equal the 1-node run's, output files come from global rank 0 only, a node that
cannot reach the rendezvous or never joins ends in one line (exit 2, within --timeout), and a rank that
fails on the other node is named. `--slurm` writes an sbatch script, run here with a fake srun/scontrol."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import helpers
from helpers import assert_bad_input
from plait.cli import app

STEPS = 3
TINY = ["--model", "tiny-llama", "--seq-len", "64", "--lr", "0.01", "--steps", str(STEPS)]
PLANS = {"dp2": "dp=2,gbs=4", "pp2": "pp=2,gbs=4"}
PLAIT = [sys.executable, "-m", "plait.cli"]
WAIT_S = 300
"""Seconds a test waits for a launcher before calling it hung (the machine's CPUs are shared)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str | Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([*PLAIT, "train", *TINY, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=WAIT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def node(rank: int, port: int, *args: str | Path, env: dict | None = None) -> subprocess.Popen:
    return start("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}", *args, env=env)


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def one_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """One `error:` line and exit 2 (the launcher's other output aside), no traceback."""
    return helpers.one_error(proc, *needles, others="")


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict[str, list[float]]:
    """The losses of each plan on one node with 2 ranks."""
    root = tmp_path_factory.mktemp("one")
    found = {}
    for name, strategy in PLANS.items():
        proc = finish(start("--strategy", strategy, "--nproc", "2", "--metrics-out", root / f"{name}.jsonl"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[name] = losses(root / f"{name}.jsonl")
        assert len(found[name]) == STEPS
    return found


@pytest.mark.parametrize("name", PLANS)
def test_two_nodes_train_to_the_losses_of_one(tmp_path, one_node, name) -> None:
    port = free_port()
    common = ["--strategy", PLANS[name], "--nproc", "1"]
    first = node(0, port, *common, "--metrics-out", tmp_path / "node0.jsonl")
    second = node(1, port, *common, "--metrics-out", tmp_path / "node1.jsonl")
    for proc in (finish(first), finish(second)):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "node0.jsonl") == pytest.approx(one_node[name], abs=1e-6)
    assert not (tmp_path / "node1.jsonl").exists()  # global rank 0 writes the metrics, on node 0


def test_slurm_script_runs_one_launcher_per_node(tmp_path, one_node) -> None:
    script = tmp_path / "job.sbatch"
    metrics = tmp_path / "m s.jsonl"  # a space: the script quotes it
    proc = finish(start("--strategy", PLANS["dp2"], "--metrics-out", metrics, "--slurm", script, "--nodes", "2",
                        "--gpus-per-node", "1", "--partition", "debug", "--time", "00:10:00"))
    assert proc.returncode == 0 and f"wrote {script}" in proc.stderr, proc.stderr
    text = script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=1", "#SBATCH --partition=debug",
                 "#SBATCH --time=00:10:00", 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p',
                 "bash -c 'exec \"$@\" --node-rank \"$SLURM_NODEID\"'",
                 f"$PLAIT train --model tiny-llama --strategy dp=2,gbs=4 --steps {STEPS} --seq-len 64 --lr 0.01 "
                 f"--metrics-out '{metrics}' --nnodes 2 --nproc 1 --rdzv-endpoint \"$HEAD:$PORT\""):
        assert line in text, line
    assert "--slurm" not in text.splitlines()[-1] and "--partition" not in text.splitlines()[-1]
    assert subprocess.run(["bash", "-n", script], check=False).returncode == 0
    # Slurm on this machine: srun starts one task per node with its SLURM_NODEID, every host is localhost.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf '127.0.0.1\\n127.0.0.1\\n'\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nn=1\nwhile [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && n=${1#--nodes=}; shift; done\n"
        "pids=()\nfor ((i = 0; i < n; i++)); do SLURM_NODEID=$i \"$@\" & pids+=($!); done\n"
        "rc=0\nfor p in \"${pids[@]}\"; do wait \"$p\" || rc=$?; done\nexit $rc\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]",
           "PLAIT": " ".join(PLAIT), "PLAIT_RDZV_PORT": str(free_port())}
    run = subprocess.run(["bash", script], check=False, capture_output=True, text=True, env=env, timeout=WAIT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    assert losses(metrics) == pytest.approx(one_node["dp2"], abs=1e-6)


def test_unreachable_endpoint_is_one_line() -> None:
    port = free_port()
    one_error(finish(node(1, port, "--strategy", PLANS["dp2"], "--nproc", "1", "--timeout", "3")),
              f"cannot reach node 0's rendezvous at 127.0.0.1:{port} within 3 s", "--node-rank 0")


def test_a_node_that_never_joins_is_one_line() -> None:
    port = free_port()
    one_error(finish(node(0, port, "--strategy", PLANS["dp2"], "--nproc", "1", "--timeout", "3")),
              f"1 of 1 other nodes did not join the rendezvous at 127.0.0.1:{port} within 3 s", "raise --timeout")


def test_a_rank_failing_on_the_other_node_is_named(tmp_path) -> None:
    port = free_port()
    common = ["--strategy", PLANS["dp2"], "--nproc", "1", "--timeout", "60"]
    fail = {"PLAIT_FAIL_AT_STEP": "1", "PLAIT_FAIL_MODE": "error", "PLAIT_FAIL_MARKER": str(tmp_path / "failed")}
    first, second = node(0, port, *common), node(1, port, *common, env=fail)
    assert one_error(finish(first)) == "error: rank 1 on node 1: injected failure on rank 1 at step 1"
    assert one_error(finish(second)) == "error: injected failure on rank 1 at step 1"


runner = CliRunner()


@pytest.mark.parametrize("args, needle", [
    (["--nnodes", "2", "--nproc", "1"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0' is not HOST:PORT"),
    (["--nnodes", "2", "--nproc", "1", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
     "--node-rank must be in 0..1 for --nnodes 2"),
    (["--rdzv-endpoint", "h:1"], "are for --nnodes 2 or more"),
    (["--slurm", "SCRIPT", "--nodes", "2", "--nproc", "1", "--time", "1h"], "--time '1h' is not HH:MM:SS"),
    (["--slurm", "SCRIPT", "--nodes", "2"], "--nnodes 2 without --plan needs --nproc (or --gpus-per-node)"),
    (["--slurm", "SCRIPT", "--nodes", "2", "--nproc", "1", "--rdzv-endpoint", "h:1"],
     "--slurm sets --node-rank and --rdzv-endpoint"),
])
def test_bad_node_options_are_one_line(tmp_path, args, needle) -> None:
    script = tmp_path / "x.sbatch"
    result = runner.invoke(app, ["train", *TINY, "--strategy", PLANS["dp2"],
                                 *[str(script) if a == "SCRIPT" else a for a in args]])
    assert_bad_input(result, needle)
    assert not script.exists()


def test_a_plan_that_does_not_fill_the_nodes_is_one_line(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    made = runner.invoke(app, ["plan", "--model", "tiny-llama", "--cluster", "1x2xA100-80GB", "--seq-len", "64",
                               "--global-batch", "4", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["train", *TINY, "--plan", str(plan), "--nnodes", "2", "--nproc", "2",
                                 "--rdzv-endpoint", "h:1"])
    assert_bad_input(result, "the plan uses 2 devices (ranks 0..1) but --nnodes 2 x --nproc 2 launches 4 ranks; "
                             "give --nproc 1 for 2 x --nproc ranks")


def test_torchrun_arguments_of_a_node() -> None:
    from plait.runtime.nodes import Nodes, torchrun_args

    assert torchrun_args(Nodes(2, 1, "10.0.0.1:29500"), 4, 299.6, 0) == [
        "--nnodes=2", "--node-rank=1", "--rdzv-backend=static", "--rdzv-endpoint=10.0.0.1:29500",
        "--rdzv-conf=timeout=300", "--nproc-per-node=4", "--max-restarts=0"]
    assert torchrun_args(Nodes(), 2, 30, 1) == ["--standalone", "--nproc-per-node=2", "--max-restarts=1"]


def test_notes_on_wide_tensor_parallelism_and_unshared_checkpoints(tmp_path) -> None:
    from plait.plan import uniform_plan
    from plait.runtime.nodes import Nodes, node_notes
    from plait.spec.cluster import local_ranks
    from plait.spec.model import load_model

    plan = uniform_plan("tp=2,gbs=4", load_model("tiny-llama"), local_ranks(2), 64)
    remote = node_notes(plan, Nodes(2, 0, "10.0.0.1:29500"), 1, tmp_path)
    assert len(remote) == 2 and "tp=2 is wider than a node's 1 ranks" in remote[0]
    assert f"--checkpoint-dir {str(tmp_path)!r} must be one shared directory" in remote[1]
    assert node_notes(plan, Nodes(2, 0, "127.0.0.1:29500"), 1, tmp_path) == remote[:1]  # localhost: shared
    assert node_notes(plan, Nodes(), 2, tmp_path) == []


def test_rendezvous_failures_and_lost_peers_read_as_one_line() -> None:
    from plait.runtime.launch import Failure, rendezvous_failure, summary

    endpoint, conf = "10.0.0.1:29500", "timeout=30"
    assert rendezvous_failure(RuntimeError("Timed out after 31 seconds waiting for clients. 2/4 clients joined."),
                              endpoint, 4, conf) == (
        "2 of 3 other nodes did not join the rendezvous at 10.0.0.1:29500 within 30 s: start `plait train ... "
        "--node-rank R` on each of them, or raise --timeout")
    assert rendezvous_failure(RuntimeError("The server socket has failed to listen on any local network address. "
                                           "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE"),
                              endpoint, 2, conf).startswith("port 29500 of --rdzv-endpoint 10.0.0.1:29500 is taken")
    assert rendezvous_failure(RuntimeError("CUDA out of memory"), endpoint, 2, conf) is None
    lost = Failure(0, "rank 0 lost its connection", "lost")
    assert summary([lost], {0: 2}, 2) == ("rank 0 lost its connection", 2)
    assert summary([lost], {0: 2, 1: -9}, 2)[0].startswith("rank 1 was killed by SIGKILL")
    assert summary([lost], {0: 2, 1: 1}, 2) == ("rank 1 failed with exit code 1; its error is printed above", 1)
