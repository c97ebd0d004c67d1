"""The search's uniform grid beside its layer-wise search: a forked child's value, exception and cancellation, and
the same search result as running the grid after the layer-wise search."""

from __future__ import annotations

import os
import time

import pytest

from plait.errors import PlaitError
from plait.planner import engine
from plait.planner.background import Background, spare_core
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS

pytestmark = pytest.mark.skipif(not spare_core(), reason="needs Linux's fork and a second core")


def _pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def _refuse(what: str) -> None:
    raise PlaitError(f"cannot {what}; give another one")


def test_the_child_computes_the_value_elsewhere_and_hands_back_its_exception():
    pid, square = Background(_pid_and_square, 7).result()
    assert square == 49 and pid != os.getpid()
    failing = Background(_refuse, "fit")
    with pytest.raises(PlaitError, match="cannot fit; give another one"):
        failing.result()


def test_a_cancelled_child_stops_at_once():
    slow = Background(time.sleep, 60)
    t0 = time.perf_counter()
    slow.cancel()
    assert time.perf_counter() - t0 < 5


def test_search_finds_the_same_with_the_grid_beside_or_after(monkeypatch):
    model, cluster = PRESETS["mixtral-8x7b"], dgx(2, 8, "H100-80GB")
    beside = engine.search(model, cluster, 4096, 64)
    monkeypatch.setattr(engine, "spare_core", lambda: False)
    after = engine.search(model, cluster, 4096, 64)
    assert beside.evaluated == after.evaluated
    for a, b in ((beside.plan, after.plan), (beside.best_uniform.plan, after.best_uniform.plan),
                 (beside.best_layerwise.plan, after.best_layerwise.plan)):
        assert a == b
    assert beside.best_uniform.report.iteration_time_s == after.best_uniform.report.iteration_time_s
    assert beside.best_uniform.label == after.best_uniform.label
