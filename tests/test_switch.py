"""Plan switches over the network (`plait.runtime.migrate`): who sends which slice to whom, and real 4-rank
switches whose state equals a DCP switch's exactly and whose losses equal one process's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import ranks_command
from plait.errors import PlaitError
from plait.runtime.migrate import Box, Held, Transfer, rounds, transfers

HERE = Path(__file__).parent
ROWS = 8


def _held(*boxes: Box | None) -> list[dict[str, Held]]:
    return [{"w": Held(b, "float32")} if b is not None else {} for b in boxes]


def _rows(start: int, count: int) -> Box:
    return Box((start, 0), (count, 4))


def test_replicas_to_shards_copy_locally_and_nothing_crosses_the_network() -> None:
    whole = _rows(0, ROWS)
    moves = transfers(_held(whole, whole), _held(_rows(0, 4), _rows(4, 4)))
    assert moves == [Transfer("w", "w", 0, 0, _rows(0, 4), 64, "float32"),
                     Transfer("w", "w", 1, 1, _rows(4, 4), 64, "float32")]


def test_sources_spread_over_replicas() -> None:
    # Ranks 0 and 1 hold the whole tensor; ranks 2 and 3 each need all of it: one sends to each.
    whole = _rows(0, ROWS)
    moves = transfers(_held(whole, whole, None, None), _held(None, None, whole, whole))
    assert [(t.src, t.dst, t.nbytes) for t in moves] == [(0, 2, 128), (1, 3, 128)]


def test_a_needed_slice_is_cut_along_the_old_shards() -> None:
    # Old: 4 row shards of 2; new: rank 0 needs rows 1..5, the others nothing.
    old = _held(*(_rows(2 * r, 2) for r in range(4)))
    moves = transfers(old, _held(_rows(1, 5), None, None, None))
    assert [(t.src, t.region) for t in moves] == [(0, _rows(1, 1)), (1, _rows(2, 2)), (2, _rows(4, 2))]
    assert sum(t.region.numel for t in moves) == 5 * 4


def test_a_head_tied_to_the_embedding_is_read_from_the_embedding() -> None:
    box = Box((0, 0), (512, 128))
    old = [{"model.tok_embeddings.weight": Held(box, "float32")}, {}]
    moves = transfers(old, [{}, {"model.output.weight": Held(box, "float32")}])
    assert [(t.key, t.source_key, t.src, t.dst) for t in moves] == [
        ("model.output.weight", "model.tok_embeddings.weight", 0, 1)]


def test_a_slice_no_rank_holds_is_refused() -> None:
    with pytest.raises(PlaitError, match="no rank holds 'v'"):
        transfers(_held(_rows(0, ROWS)), [{"v": Held(_rows(0, ROWS), "float32")}])
    with pytest.raises(PlaitError, match="cover 16 of the 32"):
        transfers(_held(_rows(0, 4), None), _held(None, _rows(0, ROWS)))


def test_a_large_slice_travels_in_pieces_of_rows_from_alternating_replicas() -> None:
    whole = _rows(0, ROWS)  # 8 rows of 4 float32: 16 bytes a row
    moves = transfers(_held(whole, whole, None), _held(None, None, whole), limit=40)
    assert [(t.src, t.region) for t in moves] == [(0, _rows(0, 2)), (1, _rows(2, 2)), (0, _rows(4, 2)),
                                                  (1, _rows(6, 2))]
    assert max(t.nbytes for t in moves) == 32


def test_rounds_bound_the_bytes_on_the_network() -> None:
    moves = [Transfer("w", "w", 0, 1, _rows(0, 1), 100, "float32")] * 5 + \
        [Transfer("w", "w", 0, 0, _rows(0, 1), 10**9, "float32")]
    assert [len(b) for b in rounds(moves, limit=250)] == [2, 2, 2]  # local copies cost nothing


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n".join(f"plait weaves layers into one plan number {i} and trains it" for i in range(400)))
    return path


def _torchrun(nproc: int, out: Path, mode: str, text: Path) -> dict:
    cmd = ranks_command(nproc, str(HERE / "switch_check.py"), str(out), mode, str(text))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_network_switches_equal_dcp_switches_and_one_process(tmp_path, text) -> None:
    from switch_check import STEPS, cases

    from plait.models import build_model
    from plait.spec.model import load_model

    reference = _torchrun(1, tmp_path / "reference.json", "reference", text)
    result = _torchrun(4, tmp_path / "switch.json", "switch", text)
    assert list(result) == list(cases())
    for name, (model, _, _) in cases().items():
        entry = result[name]
        states = entry["state"]
        assert [s["unequal"] for s in states] == [[]] * 4, name  # every entry torch.equal to DCP's
        assert all(s["optim_steps"] == [1.0] for s in states if s["compared"]), name
        # ZeRO across pipelines: ranks 0-2 step halves of the moments (rank 3 left out), then ranks 1-3 thirds.
        sliced = [[groups > 0 for groups in s["sliced_groups"]] for s in states]
        zero = name.startswith("ZeRO across")
        assert sliced == ([[True, False], [True, True], [True, True], [False, True]] if zero else [[False] * 2] * 4)
        held = set().union(*(s["model_keys"] for s in states))
        assert held == set(build_model(load_model(model)).state_dict()), name  # the new plan holds every parameter
        expected = reference[model]
        assert expected[-1] < expected[0] - 0.3, "the reference must learn, or equal losses prove little"
        for via in ("network", "dcp"):
            run = entry[via]
            assert len(run["losses"]) == STEPS and [s["via"] for s in run["switches"]] == [via], (name, via)
            assert max(abs(a - b) / b for a, b in zip(run["losses"], expected)) < 1e-5, (name, via, run["losses"])
            assert run["switch_dirs"] == []
        assert entry["network"]["losses"] == entry["dcp"]["losses"], name
        assert entry["network"]["dcp_calls"] == {"save": 0, "load": 0}  # nothing went to disk
        assert entry["dcp"]["dcp_calls"] == {"save": 1, "load": 1}
