"""Galvatron-BMW's stage partitioner: the memory-balanced start and the time-balancing layer moves."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from plait.cost.calibration import calibration_for
from plait.plan import Plan, split_layers
from plait.planner import engine
from plait.planner.baselines import Candidate
from plait.planner.engine import DEFAULT_LIMITS, _Config, _memory_balanced
from plait.planner.space import SpaceLimits
from plait.simulate import Report, simulate
from plait.spec.cluster import Cluster, dgx
from plait.spec.model import PRESETS

BALANCE = 1.15
"""Largest device memory the memory-balanced start may leave, as a multiple of the mean over devices."""
NO_RECOMPUTE = SpaceLimits(recompute=("none",))
"""Without recomputation activations dominate, so 1F1B's in-flight micro-batches weigh on early stages."""


@dataclass(frozen=True)
class Case:
    """One (pp, micro-batches, schedule) configuration of a preset model on DGX nodes."""

    model: str
    nodes: int
    gpu: str
    seq_len: int
    global_batch: int
    pp: int
    micro_batches: int
    schedule: str = "1f1b"
    memory_gib: float | None = None
    limits: SpaceLimits = DEFAULT_LIMITS

    @property
    def id(self) -> str:
        memory = f"-{self.memory_gib:g}GiB" if self.memory_gib else ""
        recompute = "" if self.limits.recompute == DEFAULT_LIMITS.recompute else "-no-recompute"
        return f"{self.model}-pp{self.pp}-m{self.micro_batches}-{self.schedule}{memory}{recompute}"

    def config(self) -> _Config:
        cluster = self.cluster()
        chunks = 2 if self.schedule == "interleaved" else 1
        return _Config(PRESETS[self.model], cluster, calibration_for(cluster.gpu.name), self.seq_len,
                       self.global_batch, self.pp, self.micro_batches, self.schedule, chunks, "bf16",
                       self.limits)

    def cluster(self) -> Cluster:
        cluster = dgx(self.nodes, 8, self.gpu)
        return cluster if self.memory_gib is None else cluster.with_memory(self.memory_gib)


def simulated(cfg: _Config, plan: Plan) -> Report:
    return simulate(plan, cfg.model, cfg.cluster, cal=cfg.cal, validate=False)


def least_memory_bytes(cfg: _Config, counts: list[int]) -> np.ndarray:
    """Simulated bytes per device group of the plan with `counts` layers per group, every block on the
    strategy that needs the least memory on its group (states plus in-flight activations)."""
    choices = []
    for d, n in enumerate(counts):
        mult = cfg.in_flight[d] / cfg.chunks
        least = min(cfg.priced[0], key=lambda p: p.states + p.activation * mult)  # one layer kind
        choices.append([least.strategy] * n)
    report = simulated(cfg, cfg.assemble(counts, choices))
    return np.array([device.memory.total for device in report.devices])


BALANCE_CASES = [
    Case("llama2-7b", 1, "A100-80GB", 2048, 64, 4, 16, limits=NO_RECOMPUTE),
    Case("llama2-7b", 1, "A100-80GB", 2048, 64, 8, 32, limits=NO_RECOMPUTE),
    Case("llama2-7b", 1, "A100-80GB", 2048, 64, 4, 16, "interleaved", limits=NO_RECOMPUTE),
    Case("llama2-13b", 2, "A100-80GB", 4096, 128, 8, 32, limits=NO_RECOMPUTE),
    Case("gpt3-1.3b", 1, "A100-40GB", 2048, 256, 4, 32, limits=NO_RECOMPUTE),
    Case("gpt3-1.3b", 1, "A100-40GB", 2048, 256, 4, 32),
    Case("gpt3-1.3b", 1, "A100-40GB", 2048, 256, 4, 32, "interleaved"),
]


@pytest.mark.parametrize("case", BALANCE_CASES, ids=lambda c: c.id)
def test_memory_balanced_start_evens_out_device_memory(case: Case) -> None:
    """Memory is the simulator's per-device total of the assembled plan, each block on its device's
    least-memory strategy (what the start balances). The cases give every device at least one block and
    blocks small enough next to a device's memory for 1.15x to be reachable, while the even split misses
    it: 1F1B keeps up to pp micro-batches of activations in flight on the first stage and one on the last
    (no recomputation makes activations dominate), and GPT-3's tied embedding and its logits weigh on the
    last stage."""
    cfg = case.config()
    counts = _memory_balanced(cfg, cfg.cluster.gpu.memory_bytes)
    assert sum(counts) == cfg.model.layers and min(counts) >= cfg.chunks
    memory = least_memory_bytes(cfg, counts)
    even = least_memory_bytes(cfg, split_layers(cfg.model.layers, cfg.pp))
    assert even.max() > BALANCE * even.mean()
    assert memory.max() <= BALANCE * memory.mean() and memory.max() < even.max()


@dataclass(frozen=True)
class Attempt:
    """The plans the partitioner simulated for one partition (retries with smaller budgets included)."""

    counts: tuple[int, ...]
    times: tuple[float | None, ...]  # iteration seconds of each plan, None where it does not fit

    @property
    def time(self) -> float | None:
        """Seconds of the plan that fits (the last one tried), None if none does."""
        return self.times[-1]


def layers_per_device(plan: Plan, pp: int) -> tuple[int, ...]:
    counts = [0] * pp
    for j, stage in enumerate(plan.pipelines[0].stages):
        counts[j % pp] += stage.layers[1] - stage.layers[0]
    return tuple(counts)


def record_search(cfg: _Config, monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[Candidate | None, list[Attempt], list[tuple[int, ...]]]:
    """Run the partitioner with an `evaluate` that logs every simulated plan (grouped by partition), and
    note each partition it moves layers from (the start it picked, then every move it accepted)."""
    log: list[tuple[tuple[int, ...], float | None]] = []
    moved_from: list[tuple[int, ...]] = []
    moves = engine._time_balancing_moves

    def evaluate(plan: Plan, bar: float) -> Candidate:  # simulates every plan, whatever the bar
        report = simulated(cfg, plan)
        log.append((layers_per_device(plan, cfg.pp), report.iteration_time_s if report.fits else None))
        return Candidate(plan, report, "layerwise")

    def spy(counts: list[int], times: list[float], chunks: int) -> list[list[int]]:
        moved_from.append(tuple(counts))
        return moves(counts, times, chunks)

    monkeypatch.setattr(engine, "_time_balancing_moves", spy)
    best = engine._partition_search(cfg, cfg.cluster.gpu.memory_bytes, evaluate)
    attempts: list[Attempt] = []
    for counts, time in log:  # a partition is tried once, its retries follow each other
        if attempts and attempts[-1].counts == counts:
            attempts[-1] = Attempt(counts, attempts[-1].times + (time,))
        else:
            attempts.append(Attempt(counts, (time,)))
    return best, attempts, moved_from


MOVE_CASES = [  # (case, moves it accepts at least)
    (Case("gpt3-1.3b", 1, "A100-40GB", 2048, 256, 4, 32, memory_gib=16), 1),  # the head skews the starts
    (Case("gpt3-2.7b", 2, "A100-40GB", 2048, 256, 2, 4, memory_gib=16), 1),  # tight: the starts skew
    (Case("llama2-7b", 1, "A100-80GB", 2048, 64, 4, 16, memory_gib=24), 0),
    (Case("llama2-7b", 1, "A100-80GB", 2048, 64, 4, 16, limits=NO_RECOMPUTE), 0),
    (Case("llama2-13b", 2, "A100-80GB", 4096, 128, 4, 16, memory_gib=48), 0),
]


@pytest.mark.parametrize(("case", "least_moves"), MOVE_CASES, ids=[c.id for c, _ in MOVE_CASES])
def test_time_balancing_moves_never_worsen_the_prediction(case: Case, least_moves: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Instrumented through `evaluate` (and a note of the partitions moved from): the plan returned is the
    fastest that fitted, so never slower than the memory-balanced start's plan; moves start from the faster
    start, and every move accepted was faster than every plan before it."""
    cfg = case.config()
    best, attempts, moved_from = record_search(cfg, monkeypatch)
    start = tuple(_memory_balanced(cfg, cfg.cluster.gpu.memory_bytes))
    assert attempts[0].counts == start
    fitted = [a.time for a in attempts if a.time is not None]
    assert best is not None and best.report.fits
    assert best.report.iteration_time_s == min(fitted)
    if attempts[0].time is not None:
        assert best.report.iteration_time_s <= attempts[0].time
    index = {a.counts: i for i, a in enumerate(attempts)}
    even = tuple(split_layers(cfg.model.layers, cfg.pp))
    starts = [a for a in attempts if a.counts in (start, even)]
    assert attempts[: len(starts)] == starts
    assert attempts[index[moved_from[0]]].time == min(a.time for a in starts if a.time is not None)
    for counts in moved_from[1:]:
        i = index[counts]
        before = [a.time for a in attempts[:i] if a.time is not None]
        assert attempts[i].time is not None and attempts[i].time < min(before)
    assert len(moved_from) - 1 >= least_moves
