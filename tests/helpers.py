"""Shared test helpers."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from plait.errors import PlaitError


def expect_error(fn, *needles: str) -> PlaitError:
    """Call fn, require a one-line PlaitError (a ValueError) whose message contains every needle."""
    with pytest.raises(PlaitError) as info:
        fn()
    err = info.value
    assert isinstance(err, ValueError)
    msg = str(err)
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return err


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def assert_bad_input(result, *needles: str) -> None:
    """Exit code 2, one line on stderr starting with `error:`, nothing on stdout, no traceback."""
    stderr = ANSI.sub("", result.stderr)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        f"escaped exception {result.exception!r}"
    assert result.exit_code == 2, (result.exit_code, result.stdout, stderr)
    assert "Traceback" not in result.output
    lines = stderr.strip("\n").split("\n")
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error:"), stderr
    assert len(lines[0]) > len("error: ") + 10  # says what is wrong
    assert result.stdout == ""
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def one_error(proc, *needles: str, others: str = "note:") -> str:
    """A finished `plait` process (subprocess.CompletedProcess) exited 2 with exactly one `error: ` line on
    stderr naming every needle and no traceback; every other non-empty stderr line starts with `others`
    (notes; "" allows any, e.g. a launcher's progress output). Returns the error line."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    for marker in ("Traceback", "ChildFailedError", "frame #"):
        assert marker not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert all(line.startswith(others) for line in lines if line not in errors), proc.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def ranks_command(nproc: int, *target: str) -> list[str]:
    """The command that runs `target` (-m MODULE ARGS, or SCRIPT ARGS) on `nproc` local ranks through plait's
    launcher (torchrun's agent; CPU ranks forked from one process that imported plait's runtime once)."""
    return [sys.executable, "-m", "plait.runtime.launch", "--standalone", f"--nproc-per-node={nproc}", *target]


def run_workers(configs, nproc: int = 2):
    """Run `plait.runtime.worker` on each TrainConfig JSON file of `configs` in turn, in one job of `nproc`
    ranks (one thread each, `ranks_command`); returns the finished process after asserting it succeeded."""
    import os
    import subprocess

    cmd = ranks_command(nproc, "-m", "plait.runtime.worker", *map(str, configs))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def load_benchmark(name: str) -> ModuleType:
    """The script benchmarks/`name`.py imported as a module (registered first: dataclasses look their module up
    while the file runs)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
