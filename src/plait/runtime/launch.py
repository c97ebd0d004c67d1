"""Launch a training job's ranks with torchrun's agent and turn a failed rank into one line on stderr.

`python -m plait.runtime.launch TORCHRUN_ARGS...` takes torchrun's arguments. A rank that fails on bad
input (PlaitError) or in a collective that timed out writes a short report into the directory named by
PLAIT_ERROR_DIR (`report_failure`); the launcher prints the report of the first failed rank, or says which
ranks stopped answering, and exits with 2, instead of torchrun's ChildFailedError traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ERROR_DIR_ENV = "PLAIT_ERROR_DIR"
"""Environment variable naming the directory where ranks report their failures."""


@dataclass(frozen=True)
class Failure:
    """What one rank reported before it exited: `kind` is "error" (bad input, its own or another node's
    rank's), "timeout" (a collective that waited `timeout_s` seconds) or "lost" (a peer closed the
    connection without saying why)."""

    rank: int
    message: str
    kind: str = "error"
    timeout_s: float = 0.0
    time: float = 0.0


def report_failure(failure: Failure) -> None:
    """In a rank: record `failure` for the launcher (or print it on rank 0 when run by plain torchrun)."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if not directory:
        if failure.rank == 0:
            print(f"error: {failure.message}", file=sys.stderr)
        return
    from plait.io import write_atomically

    data = {"rank": failure.rank, "message": failure.message, "kind": failure.kind,
            "timeout_s": failure.timeout_s, "time": time.time()}
    write_atomically(Path(directory) / f"rank-{failure.rank}.json", json.dumps(data))


def read_failures(directory: Path) -> list[Failure]:
    """The failures ranks reported in `directory`, earliest first."""
    found = []
    for path in directory.glob("rank-*.json"):
        try:
            found.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found, key=lambda f: f.time)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, sorted(ranks)))


def summary(reported: list[Failure], exitcodes: dict[int, int], world: int) -> tuple[str, int]:
    """(the one line to print, the exit code) for a failed job: `reported` failures, `exitcodes` of the ranks
    torchrun saw fail (negative: killed by that signal), `world` ranks in all."""
    errors = [f for f in reported if f.kind == "error"]
    if errors:
        return errors[0].message, 2
    timeouts = [f for f in reported if f.kind == "timeout"]
    if timeouts:
        waited = [f.rank for f in timeouts]
        silent = sorted(set(range(world)) - set(waited))
        limit = max(f.timeout_s for f in timeouts)
        if silent:
            one = len(silent) == 1
            it, process, slow = ("it", "that process", "it is") if one else ("them", "those processes", "they are")
            return (f"{_ranks(silent)} stopped answering: {_ranks(waited)} waited {limit:g} s for {it} in a "
                    f"collective; check {process} (stopped, swapped out, deadlocked), or raise --timeout if "
                    f"{slow} only slow"), 2
        return (f"{_ranks(waited)} timed out after {limit:g} s waiting in a collective; raise --timeout if the "
                "job is only slow"), 2
    killed = {r: c for r, c in exitcodes.items() if c < 0}
    if killed:
        rank, code = min(killed.items())
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        hint = " (the kernel kills a process that runs out of host memory: use a smaller model or fewer ranks)" \
            if -code == signal.SIGKILL else ""
        return f"rank {rank} was killed by {name}{hint}", 2
    lost = [f for f in reported if f.kind == "lost"]
    crashed = {r: c for r, c in exitcodes.items() if r not in {f.rank for f in lost}}
    if lost and not crashed:  # the rank that went away is on another node
        return lost[0].message, 2
    rank, code = min(crashed.items()) if crashed else (0, 1)
    return f"rank {rank} failed with exit code {code}; its error is printed above", 1


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; 0 when every rank succeeded, else print one line and return 2 (or 1 for
    an unexpected crash, whose traceback the rank printed)."""
    import logging

    _start_fork_server_early(argv)  # before this process imports torch and quiets the logs below
    # torchrun's own failure logs, and the store's C++ retry logs while nodes meet: the summary below
    # replaces them; the ranks get the caller's settings back.
    with _environ({"LOGLEVEL": "CRITICAL", "TORCH_CPP_LOG_LEVEL": "FATAL"}):
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

    for name in ("torch.distributed.elastic", "torch.multiprocessing"):  # also stopping forked ranks
        logging.getLogger(name).setLevel(logging.CRITICAL)
    args = parse_args(argv)
    _fork_server_ranks(args)
    with tempfile.TemporaryDirectory(prefix="plait-torchrun-") as logs:
        if args.log_dir is None and args.redirects == "0" and args.tee == "0":
            args.log_dir = logs  # torchrun's per-rank error files go with the job (else one directory a launch stays)
        try:
            run(args)
        except ChildFailedError as exc:
            directory = os.environ.get(ERROR_DIR_ENV)
            reported = read_failures(Path(directory)) if directory else []
            world = int(str(args.nproc_per_node)) * int(str(args.nnodes).split(":")[-1]) \
                if str(args.nproc_per_node).isdigit() else len(exc.failures)
            message, code = summary(reported, {r: f.exitcode for r, f in exc.failures.items()}, world)
            print(f"error: {message}", file=sys.stderr)
            return code
        except Exception as exc:
            message = rendezvous_failure(exc, args.rdzv_endpoint, int(str(args.nnodes).split(":")[-1]),
                                         args.rdzv_conf)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            return 2
    return 0


PRELOADED = ("plait.runtime.train", "plait.runtime.multitask")
"""Modules the ranks' fork server imports once (torch, DTensor, distributed checkpoint, plait's runtime)."""


GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")
"""Where an NVIDIA or AMD GPU driver shows itself without importing torch."""


def _start_fork_server_early(argv: list[str]) -> None:
    """Start the ranks' fork server now, where its ranks will fork from it (`_fork_server_ranks`): it imports
    `PRELOADED` (~4 s of CPU) while this process imports torch (~2.5 s) instead of after, on another core.
    Only for several ranks a node, not where torchrun runs the program as given (--no-python, --run-path) nor
    where a GPU driver is present (GPU jobs start fresh interpreters); else torchrun starts the server when its
    ranks start, as before. The server gets the environment it would have had then: unbuffered output, and
    OMP_NUM_THREADS=1 unless set (torchrun's default for several ranks a node)."""
    import multiprocessing
    import multiprocessing.forkserver

    given = {"--no-python", "--no_python", "--run-path", "--run_path"}
    if _ranks_per_node(argv) < 2 or given & set(argv) or any(os.path.exists(p) for p in GPU_DRIVER_PATHS) or \
            "forkserver" not in multiprocessing.get_all_start_methods():
        return
    multiprocessing.forkserver.set_forkserver_preload(list(PRELOADED))
    with _environ({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}):
        multiprocessing.forkserver.ensure_running()


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """`values` set in os.environ inside the block, the names' earlier values (or absence) back after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _ranks_per_node(argv: list[str]) -> int:
    """torchrun's --nproc-per-node in `argv` as a number (1 where absent or not a number: "gpu", "auto")."""
    for i, arg in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1:]
            else:
                continue
            return int(value) if value.isdigit() else 1
    return 1


def _fork_server_ranks(args) -> None:  # noqa: ANN001 - torchrun's argparse namespace
    """On CPU ranks, have torchrun start each rank (`python -u -m MODULE ...` or `python -u SCRIPT ...`) as a fork of
    one server that imported `PRELOADED` once, rather than as a fresh interpreter that imports them again (about
    3 s of CPU a rank, more than a small job's training): torchrun's --run-path runs `plait/runtime/rank.py` in
    each fork, which runs the rank's program as the interpreter would have; output stays unbuffered. GPU jobs
    keep fresh interpreters (a fork must not inherit CUDA state)."""
    import multiprocessing
    import multiprocessing.forkserver

    import torch

    if args.no_python or args.run_path or torch.cuda.is_available() or \
            "forkserver" not in multiprocessing.get_all_start_methods():
        return
    program = ["-m", args.training_script] if args.module else [args.training_script]
    args.training_script_args = [*program, *args.training_script_args]
    args.module, args.run_path, args.start_method = False, True, "forkserver"
    args.training_script = str(Path(__file__).with_name("rank.py"))
    multiprocessing.forkserver.set_forkserver_preload(list(PRELOADED))
    os.environ["PYTHONUNBUFFERED"] = "1"


def rendezvous_failure(exc: Exception, endpoint: str, nnodes: int, conf: str) -> str | None:
    """The one line for a job whose nodes did not meet (None when `exc` is something else): node 0's
    rendezvous store at `endpoint` unreachable or its port taken, or nodes that did not join within the
    rendezvous timeout of `conf` ("timeout=SECONDS")."""
    text = str(exc)
    seconds = dict(item.partition("=")[::2] for item in conf.split(",") if item).get("timeout", "?")
    if "trying to connect to" in text:
        return (f"cannot reach node 0's rendezvous at {endpoint} within {seconds} s: start node 0 (--node-rank 0) "
                "too, check the address and port (a firewall?), or raise --timeout")
    if "address already in use" in text.lower() or "EADDRINUSE" in text:
        return (f"port {endpoint.rpartition(':')[2]} of --rdzv-endpoint {endpoint} is taken on node 0; choose a "
                "free port")
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        missing = int(joined.group(2)) - int(joined.group(1))
        return (f"{missing} of {nnodes - 1} other nodes did not join the rendezvous at {endpoint} within {seconds} "
                "s: start `plait train ... --node-rank R` on each of them, or raise --timeout")
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
