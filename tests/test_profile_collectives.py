"""Collective measurement: the latency/bandwidth fit, the job runner's failures, and one real 2-rank run."""

from __future__ import annotations

import sys
import time

import pytest
from helpers import expect_error

from plait.cost.profile_file import CollectiveSample
from plait.profile.collectives import (
    ERROR_PREFIX,
    GROUP_OPS,
    MAX_BANDWIDTH,
    QUICK_SIZES,
    child_error,
    fit_curve,
    group_sizes,
    measure_collectives,
    planned_items,
    run_job,
)

SIZES = [4096 * 4**i for i in range(7)]  # 4 KiB .. 16 MiB


def _samples(latency: float, bandwidth: float, noise: list[float] | None = None) -> list[CollectiveSample]:
    noise = noise or [0.0] * len(SIZES)
    return [CollectiveSample(bytes=b, seconds=(latency + b / bandwidth) * (1 + e)) for b, e in zip(SIZES, noise)]


def test_fit_recovers_latency_and_bandwidth():
    latency, bandwidth = fit_curve(_samples(50e-6, 2e9))
    assert latency == pytest.approx(50e-6, rel=1e-6)
    assert bandwidth == pytest.approx(2e9, rel=1e-6)
    noisy = _samples(200e-6, 1e9, noise=[0.05, -0.04, 0.03, -0.05, 0.04, -0.03, 0.02])
    latency, bandwidth = fit_curve(noisy)
    assert latency == pytest.approx(200e-6, rel=0.15)
    assert bandwidth == pytest.approx(1e9, rel=0.1)


def test_fit_clamps_noisy_points():
    # Small messages faster than the line through the large ones: the free fit has a negative intercept.
    points = [CollectiveSample(bytes=b, seconds=b / 1e9 * (0.2 if b < 65536 else 1.0)) for b in SIZES]
    latency, bandwidth = fit_curve(points)
    assert latency == 0.0
    assert 1e9 < bandwidth < 5e9  # between the small messages' 5 GB/s and the large ones' 1 GB/s
    # Time falls with size (pure noise): no growth with size, a finite bandwidth, latency the typical time.
    falling = [CollectiveSample(bytes=b, seconds=1e-3 - i * 1e-5) for i, b in enumerate(SIZES)]
    latency, bandwidth = fit_curve(falling)
    assert bandwidth == MAX_BANDWIDTH
    assert 0.9e-3 < latency < 1e-3
    # One size only: all of the time is per byte.
    assert fit_curve([CollectiveSample(bytes=1e6, seconds=1e-3)] * 2) == pytest.approx((0.0, 1e9))
    expect_error(lambda: fit_curve([]), "no collective samples")


def test_group_sizes_and_items():
    assert group_sizes(2) == [2]
    assert group_sizes(6) == [2, 4, 6]
    assert group_sizes(8) == [2, 4, 8]
    assert planned_items(4) == [f"{op} {g}" for op in GROUP_OPS for g in (2, 4)] + ["p2p 2", "overlap"]


def test_bad_arguments_fail_before_any_job():
    expect_error(lambda: measure_collectives(1), "at least 2 ranks")
    expect_error(lambda: measure_collectives(2, sizes=(4096,)), "two different message sizes")
    expect_error(lambda: measure_collectives(2, sizes=(4, 4096)), "bytes >= 8")


def test_child_failure_is_one_line_error():
    script = f"import sys; print('noise', file=sys.stderr); print('{ERROR_PREFIX} rank 1: OSError: boom', " \
             "file=sys.stderr); sys.exit(3)"
    err = expect_error(lambda: run_job([sys.executable, "-c", script], 30, lambda line: None, what="job X"),
                       "job X failed (exit code 3)", "rank 1: OSError: boom")
    assert "noise" not in str(err)
    crash = "raise RuntimeError('gloo\\nconnection closed')"
    expect_error(lambda: run_job([sys.executable, "-c", crash], 30, lambda line: None, what="job Y"),
                 "job Y failed (exit code 1)", "RuntimeError: gloo")


def test_hanging_child_is_stopped():
    lines: list[str] = []
    script = "import time; print('started', flush=True); time.sleep(60)"
    start = time.perf_counter()
    expect_error(lambda: run_job([sys.executable, "-c", script], 2, lines.append, what="job Z"),
                 "job Z did not finish within 2 s")
    assert time.perf_counter() - start < 15
    assert lines == ["started"]


def test_child_error_skips_torchrun_summary():
    stderr = """Traceback (most recent call last):
  File "worker.py", line 3, in <module>
ValueError: the real cause
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
    assert child_error(stderr) == "ValueError: the real cause"
    assert child_error("") == "no error output"


@pytest.fixture(scope="module")
def quick_two_ranks():
    calls: list[tuple[int, int]] = []
    start = time.perf_counter()
    job = measure_collectives(2, quick=True, progress=lambda done, total: calls.append((done, total)))
    assert job.strategies == []  # only with a model
    return job.curves, job.overlap, calls, time.perf_counter() - start, job.process_bytes


def test_real_measurement_with_two_ranks(quick_two_ranks):
    curves, overlap, calls, seconds, rank_bytes = quick_two_ranks
    assert seconds < 60
    assert 100 * 2**20 < rank_bytes < 4 * 2**30  # a rank with torch and the runtime loaded
    assert sorted((c.op, c.ranks) for c in curves) == sorted([(op, 2) for op in GROUP_OPS] + [("p2p", 2)])
    spiked = []
    for c in curves:
        assert c.nodes == 1
        assert c.latency_s >= 0
        assert 0 < c.bandwidth <= MAX_BANDWIDTH, c
        assert len(c.samples) == len(QUICK_SIZES)
        small, large = min(c.samples, key=lambda s: s.bytes), max(c.samples, key=lambda s: s.bytes)
        assert (small.bytes, large.bytes) == (min(QUICK_SIZES), max(QUICK_SIZES))
        assert all(s.seconds > 0 for s in c.samples)
        if large.seconds > small.seconds and c.bandwidth < MAX_BANDWIDTH:
            assert c.at(large.bytes) > c.at(small.bytes)
        else:  # no growth with size measured: the fit's documented clamp
            spiked.append(c)
    # 1000x the bytes takes longer; one op may lose to a load spike on a shared 2-core machine
    assert len(spiked) <= 1, spiked
    assert overlap.compute_slowdown >= 1.0 and overlap.comm_slowdown >= 1.0
    total = len(planned_items(2))
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [done for done, _ in calls] == list(range(total + 1))
