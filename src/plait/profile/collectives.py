"""Measure collectives and the compute/communication overlap on this machine, and fit latency + bandwidth.

`measure_collectives` launches one torchrun job of `plait.profile.collectives_worker` through plait's launcher
(`plait.runtime.launch`: CPU ranks fork from a server that imported the runtime once), follows its progress
lines, reads the samples rank 0 wrote, and fits seconds = latency + bytes / bandwidth per (op, group size)
with `fit_curve`. Every failure of the job, including a hang, ends in a one-line `PlaitError`. Units: seconds,
bytes, bytes/s.

This module does not import torch: the ranks do.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from plait.cost.profile_file import CollectiveCurve, CollectiveSample, Overlap, StrategyProfile
from plait.errors import PlaitError
from plait.spec.model import ModelSpec

PROGRESS_PREFIX = "plait-collectives-progress"
"""Start of the stdout line rank 0 prints after each finished item (see `planned_items`)."""
ERROR_PREFIX = "plait-collectives-error:"
"""Start of the one stderr line a failing rank prints before it exits."""
GROUP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""Collectives measured over every group size; p2p is measured between ranks 0 and 1 only."""
ELEMENT_BYTES = 4  # bytes of one element of the worker's dtype (fp32)

KIB = 2**10
MIB = 2**20
DEFAULT_SIZES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
"""Bytes per rank: 7 points, a factor of 4 apart, from latency-bound to bandwidth-bound."""
QUICK_SIZES = (4 * KIB, 128 * KIB, 4 * MIB)
"""Bytes per rank of a quick measurement: 1000x apart, so that the largest message clearly takes longer
than the smallest even on a busy machine."""

TIMEOUT_BASE_S = 300.0
"""Seconds the measurement itself may take before the job counts as hung (a full 8-rank run: ~1-2 min)."""
TIMEOUT_PER_RANK_S = 30.0
"""Seconds more per rank for starting it (~8-15 s per rank here: `import torch` and joining)."""
TIMEOUT_PER_STRATEGY_S = 120.0
"""Seconds more per strategy timing of a model's block (~5-20 s each here)."""
TERMINATE_GRACE_S = 10.0
"""Seconds torchrun gets to stop its ranks after SIGTERM before it is killed."""
ERROR_TAIL_CHARS = 400
"""Characters of the child's error kept in the one-line message."""

MAX_BANDWIDTH = 1e15
"""bytes/s (1 PB/s, beyond any link) reported when the samples show no growth with size at all."""
MIN_SECONDS = 1e-9
"""Seconds a sample is taken to last at least, so that relative errors stay finite."""

_EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*)$")


def fit_curve(samples: list[CollectiveSample]) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) of seconds = latency + bytes / bandwidth.

    Least squares of the relative error (each residual divided by the sample's seconds), so 4 KiB and
    16 MiB messages weigh alike, under latency >= 0 and 1 / bandwidth >= 0: when the unconstrained fit
    breaks a bound, the better of the two boundary fits wins (latency 0, or no growth with size, where
    the bandwidth is `MAX_BANDWIDTH`). The bandwidth is always finite and > 0.
    """
    if not samples:
        raise PlaitError("no collective samples to fit; measure at least two message sizes")
    for s in samples:
        if not (math.isfinite(s.bytes) and math.isfinite(s.seconds) and s.bytes >= 0 and s.seconds >= 0):
            raise PlaitError(f"collective sample of {s.bytes} bytes in {s.seconds} s is not a finite, "
                             "non-negative measurement; re-run the measurement")
    xs = [s.bytes for s in samples]
    ys = [max(s.seconds, MIN_SECONDS) for s in samples]
    ws = [1.0 / (y * y) for y in ys]  # weights of squared residuals: relative error
    latency, per_byte = _weighted_fit(xs, ys, ws)
    if latency < 0 or per_byte <= 0:
        candidates = [(0.0, _fit_slope(xs, ys, ws)), (_fit_intercept(ys, ws), 0.0)]
        latency, per_byte = min(candidates, key=lambda c: _weighted_sse(c, xs, ys, ws))
    bandwidth = 1.0 / per_byte if per_byte > 1.0 / MAX_BANDWIDTH else MAX_BANDWIDTH
    return max(0.0, latency), bandwidth


def _weighted_fit(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """Unconstrained weighted least squares (intercept, slope); slope 0 when every x is the same."""
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / total
    my = sum(w * y for w, y in zip(ws, ys)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    if sxx <= 0:
        return 0.0, _fit_slope(xs, ys, ws)  # one size: all of the time is per byte
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx
    return my - slope * mx, slope


def _fit_slope(xs: list[float], ys: list[float], ws: list[float]) -> float:
    """Weighted least-squares slope through the origin (>= 0)."""
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    return max(0.0, sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sxx) if sxx > 0 else 0.0


def _fit_intercept(ys: list[float], ws: list[float]) -> float:
    """Weighted mean of ys: the best constant."""
    return sum(w * y for w, y in zip(ws, ys)) / sum(ws)


def _weighted_sse(fit: tuple[float, float], xs: list[float], ys: list[float], ws: list[float]) -> float:
    a, b = fit
    return sum(w * (a + b * x - y) ** 2 for w, x, y in zip(ws, xs, ys))


def group_sizes(nproc: int) -> list[int]:
    """Group sizes measured on `nproc` ranks: the powers of two from 2 up to nproc, and nproc itself."""
    return sorted({2**k for k in range(1, nproc.bit_length()) if 2**k <= nproc} | {nproc})


def planned_items(nproc: int, model: ModelSpec | None = None) -> list[str]:
    """What the worker reports as done, in order: "OP RANKS" per curve, then "overlap", then (with a model)
    "KIND GROUP BUSY" per strategy measurement, in each of its passes."""
    items = [f"{op} {g}" for op in GROUP_OPS for g in group_sizes(nproc)] + ["p2p 2", "overlap"]
    if model is not None:
        from plait.profile.strategy_blocks import PASSES
        from plait.profile.strategy_blocks import planned_items as strategy_items

        items += [" ".join(map(str, item)) for item in strategy_items(model, nproc, group_sizes(nproc))] * PASSES
    return items


@dataclass(frozen=True)
class JobResult:
    """What the collective job measured."""

    curves: list[CollectiveCurve]
    overlap: Overlap
    process_bytes: float  # resident bytes of a rank with the runtime loaded and its process group up
    strategies: list[StrategyProfile]  # the model's block under each parallel strategy (empty without a model)


def _check_args(nproc: int, sizes: tuple[int, ...]) -> None:
    if not isinstance(nproc, int) or nproc < 2:
        raise PlaitError(f"measuring collectives needs at least 2 ranks, got nproc={nproc!r}")
    if any(not isinstance(s, int) or s < ELEMENT_BYTES * nproc for s in sizes):
        raise PlaitError(f"message sizes must be whole numbers of bytes >= {ELEMENT_BYTES * nproc} "
                         f"({ELEMENT_BYTES}-byte elements, one per rank), got {list(sizes)}")
    if len(set(sizes)) < 2:
        raise PlaitError(f"give at least two different message sizes to fit latency and bandwidth, got "
                         f"{list(sizes)}")


def measure_collectives(nproc: int, *, sizes: tuple[int, ...] | None = None, quick: bool = False,
                        model: ModelSpec | None = None, progress: Callable[[int, int], None] | None = None,
                        timeout_s: float | None = None, dtype: str = "fp32") -> JobResult:
    """Measure all-reduce, all-gather, reduce-scatter, all-to-all and p2p on this machine with `nproc`
    ranks launched through torchrun, for every group size 2..nproc that the machine offers (powers of two
    and nproc itself; one node here, so nodes=1), the overlap slowdown of compute and communication, the
    resident bytes of a rank with the runtime loaded and its process group up (what a training rank holds
    before its model) and, with `model`, its block under each parallel strategy as the runtime runs it (its
    weights and activations in `dtype`; the collectives move fp32 elements).

    `sizes`: bytes per rank (default `DEFAULT_SIZES`, or `QUICK_SIZES` with `quick`, which also takes fewer
    repetitions). `progress(done, total)` is called with 0 first and once per finished item. `timeout_s`:
    seconds before the job counts as hung and is stopped (default: by `nproc`). Raises `PlaitError` with
    one line when the job fails or hangs.
    """
    sizes = tuple(sorted(set(sizes if sizes is not None else (QUICK_SIZES if quick else DEFAULT_SIZES))))
    _check_args(nproc, sizes)
    items = planned_items(nproc, model)
    strategies = len(items) - len(planned_items(nproc))
    timeout = timeout_s if timeout_s is not None else \
        TIMEOUT_BASE_S + TIMEOUT_PER_RANK_S * nproc + TIMEOUT_PER_STRATEGY_S * strategies
    with tempfile.TemporaryDirectory(prefix="plait-collectives-") as tmp:
        out = Path(tmp) / "collectives.json"
        cmd = [sys.executable, "-m", "plait.runtime.launch", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "plait.profile.collectives_worker", str(out), "--sizes", ",".join(map(str, sizes))]
        cmd += ["--quick"] if quick else []
        cmd += ["--model", model.name, "--dtype", dtype] if model is not None else []
        done = 0
        if progress is not None:
            progress(0, len(items))

        def on_line(line: str) -> None:
            nonlocal done
            if line.startswith(PROGRESS_PREFIX) and done < len(items):
                done += 1
                if progress is not None:
                    progress(done, len(items))

        run_job(cmd, timeout, on_line, what=f"collective measurement with {nproc} ranks")
        result = _read_result(out)
    if done != len(items):
        raise PlaitError(f"collective measurement with {nproc} ranks finished {done} of {len(items)} items; "
                         "re-run it")
    strategies = []
    if model is not None:
        from plait.profile.strategy_blocks import profiles

        try:
            strategies = profiles(model.name, result.get("strategies", []))
        except (KeyError, TypeError, ValidationError) as exc:
            raise PlaitError(f"the collective measurement with {nproc} ranks wrote a malformed strategy "
                             f"timing ({type(exc).__name__}); re-run it") from None
    return JobResult(_curves(result, nproc), _overlap(result), float(result.get("process_bytes", 0.0)), strategies)


def run_job(cmd: list[str], timeout_s: float, on_line: Callable[[str], None], *, what: str) -> None:
    """Run `cmd` (OMP_NUM_THREADS=1), calling `on_line` for each stdout line; `PlaitError` naming `what` and
    the child's error when it exits non-zero or runs past `timeout_s` seconds (then it is stopped)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr:
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                    start_new_session=True)
        except OSError as exc:
            raise PlaitError(f"{what} could not start {cmd[0]!r}: {exc.strerror}") from None
        timed_out = threading.Event()
        watchdog = threading.Timer(timeout_s, _stop, args=(proc, timed_out))
        watchdog.daemon = True
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                on_line(line.rstrip("\n"))
            code = proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:  # interrupted while reading: leave nothing running
                _stop(proc, timed_out)
            if proc.stdout is not None:
                proc.stdout.close()
        if timed_out.is_set():
            raise PlaitError(f"{what} did not finish within {timeout_s:g} s and was stopped; a rank may hang "
                             "(check that the ranks can reach each other) or the machine is very busy")
        if code != 0:
            stderr.seek(0)
            reason = child_error(stderr.read())
            raise PlaitError(f"{what} failed (exit code {code}): {reason}")


def _stop(proc: subprocess.Popen, stopped: threading.Event) -> None:
    """Stop torchrun: SIGTERM (it stops its ranks), then SIGKILL to its process group after a grace time.

    The ranks run in sessions of their own; one whose torchrun is gone exits by itself (the worker checks).
    """
    if proc.poll() is not None:
        return
    stopped.set()
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    except ProcessLookupError:
        pass


def child_error(stderr: str) -> str:
    """One line saying why the job failed: a rank's own error line, else the last exception line that is
    not torchrun's summary, else the last line of stderr."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    reason = next((ln[len(ERROR_PREFIX):].strip() for ln in lines if ln.startswith(ERROR_PREFIX)), None)
    if reason is None:
        exceptions = [m.group(1) for ln in lines if (m := _EXCEPTION_LINE.match(ln))
                      and "ChildFailedError" not in ln]
        reason = exceptions[-1] if exceptions else (lines[-1] if lines else "no error output")
    return reason if len(reason) <= ERROR_TAIL_CHARS else reason[:ERROR_TAIL_CHARS] + "..."


def _read_result(path: Path) -> dict:
    try:
        result = json.loads(path.read_text())
    except OSError:
        raise PlaitError("the collective measurement wrote no results; re-run it") from None
    except json.JSONDecodeError:
        raise PlaitError("the collective measurement wrote unreadable results; re-run it") from None
    if not isinstance(result, dict) or not isinstance(result.get("curves"), list):
        raise PlaitError("the collective measurement wrote results without curves; re-run it")
    return result


def _curves(result: dict, nproc: int) -> list[CollectiveCurve]:
    """A fitted `CollectiveCurve` per measured (op, group size), samples kept, on one node."""
    curves = []
    try:
        for raw in result["curves"]:
            samples = [CollectiveSample(bytes=s["bytes"], seconds=s["seconds"]) for s in raw["samples"]]
            latency, bandwidth = fit_curve(samples)
            curves.append(CollectiveCurve(op=raw["op"], ranks=raw["ranks"], nodes=1, latency_s=latency,
                                          bandwidth=bandwidth, samples=tuple(samples)))
    except (KeyError, TypeError, ValidationError) as exc:
        raise PlaitError(f"the collective measurement with {nproc} ranks wrote a malformed curve "
                         f"({type(exc).__name__}); re-run it") from None
    expected = {tuple(item.split()) for item in planned_items(nproc) if item != "overlap"}
    missing = expected - {(c.op, str(c.ranks)) for c in curves}
    if missing:
        raise PlaitError(f"the collective measurement with {nproc} ranks lacks {min(missing)}; re-run it")
    return curves


def _overlap(result: dict) -> Overlap:
    """Slowdowns (overlapped / alone, at least 1) of compute and communication."""
    try:
        o = result["overlap"]
        compute = o["compute_overlapped_s"] / o["compute_alone_s"]
        comm = o["comm_overlapped_s"] / o["comm_alone_s"]
    except (KeyError, TypeError, ZeroDivisionError):
        raise PlaitError("the collective measurement wrote no usable overlap timings; re-run it") from None
    if not (math.isfinite(compute) and math.isfinite(comm)):
        raise PlaitError("the collective measurement wrote non-finite overlap timings; re-run it")
    return Overlap(compute_slowdown=max(1.0, compute), comm_slowdown=max(1.0, comm))
