"""Failures inside training ranks (2 CPU ranks under torchrun): unreadable checkpoints are skipped with a
note and the newest readable one is used; a failed save keeps the previous checkpoint; bad input found in a
rank and a rank that stops answering end in one line on stderr and exit 2, never torchrun's traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import one_error

STEPS = 6
BASE = ["--strategy", "dp=2,gbs=4", "--nproc", "2", "--seq-len", "64", "--lr", "0.01"]


def train(*args: str | Path, env: dict | None = None, model: str = "tiny-llama") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", model, *BASE, *map(str, args)]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Checkpoints after steps 3 and 6 of a tiny-llama run, and that run's metrics."""
    root = tmp_path_factory.mktemp("saved")
    proc = train("--steps", STEPS, "--checkpoint-dir", root / "ck", "--checkpoint-every", 3,
                 "--metrics-out", root / "m.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((root / "ck" / "step-6" / "plait.json").read_text())
    assert meta["step"] == 6 and meta["model"] == "tiny-llama" and len(meta["model_fingerprint"]) == 16
    return root / "ck", records(root / "m.jsonl")


def _truncate(step: Path) -> None:
    with open(step / "__0_0.distcp", "r+b") as fh:
        fh.truncate(3_000_000)


def _garble(step: Path) -> None:
    with open(step / "__0_0.distcp", "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\x00garbage" * 20_000)


def _drop_metadata(step: Path) -> None:
    (step / ".metadata").unlink()


@pytest.mark.parametrize("damage, why", [
    (_truncate, "its data file __0_0.distcp is truncated (3000000 of"),
    (_garble, "cannot load checkpoint"),
    (_drop_metadata, "its .metadata is unreadable"),
])
def test_unreadable_checkpoint_falls_back_to_the_previous_one(tmp_path, saved, damage, why) -> None:
    ck, first = saved
    shutil.copytree(ck, tmp_path / "ck")
    damage(tmp_path / "ck" / "step-6")
    proc = train("--steps", STEPS, "--checkpoint-dir", tmp_path / "ck", "--metrics-out", tmp_path / "m.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "step-6" in notes[0] and why in notes[0], proc.stderr
    resumed = records(tmp_path / "m.jsonl")
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in first[3:]], rel=1e-6)


def test_resume_from_picks_a_checkpoint(tmp_path, saved) -> None:
    ck, first = saved
    proc = train("--steps", STEPS, "--resume-from", ck / "step-3", "--metrics-out", tmp_path / "m.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = records(tmp_path / "m.jsonl")  # step-6 is readable too, but step-3 was asked for
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in first[3:]], rel=1e-6)


def test_checkpoint_of_another_model_is_refused(saved) -> None:
    ck, _ = saved
    one_error(train("--checkpoint-dir", ck, model="tiny-gpt"),
              f"checkpoint {str(ck / 'step-6')!r} holds tiny-llama, not tiny-gpt")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, saved) -> None:
    ck, _ = saved
    shutil.copytree(ck, tmp_path / "ck")
    shutil.rmtree(tmp_path / "ck" / "step-6")
    (tmp_path / "ck" / ".step-6.tmp").write_text("")  # a file where the save writes its directory
    proc = train("--steps", STEPS, "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 3)
    one_error(proc, f"cannot save checkpoint step-6 in {str(tmp_path / 'ck')!r}",
              "the previous checkpoint step-3 is intact")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".step-6.tmp", "step-3"]
    assert json.loads((tmp_path / "ck" / "step-3" / "plait.json").read_text())["step"] == 3


def test_a_rank_that_stops_answering_is_named(tmp_path) -> None:
    env = {"PLAIT_FAIL_AT_STEP": "1", "PLAIT_FAIL_MARKER": str(tmp_path / "hung"), "PLAIT_FAIL_MODE": "hang"}
    proc = train("--steps", 3, "--timeout", 4, env=env)
    one_error(proc, "rank 1 stopped answering: rank 0 waited 4 s for it", "raise --timeout")
