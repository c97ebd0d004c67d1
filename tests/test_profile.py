"""`plait profile` end to end (quick), and the profile file's round trip and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import expect_error

from plait.cost.measured import calibrate
from plait.profile.schema import PROFILE_VERSION, load_profile
from plait.spec.cluster import dgx


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "profile", "--model", "tiny-llama", "--nproc", "2",
                           "--quick", "--out", str(path)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path, proc.stdout


def test_profile_measures_and_round_trips(measured) -> None:
    path, stdout = measured
    p = load_profile(path)
    assert p.version == PROFILE_VERSION and p.device.kind == "cpu" and p.device.gpu_type == "CPU"
    assert p.device.peak_flops > 1e8 and p.process_bytes > 50 * 2**20
    assert {(lp.tp, lp.recompute) for lp in p.layers} == {(t, r) for t in (1, 2) for r in ("none", "selective", "full")}
    assert {(e.part, e.tp) for e in p.edges} == {("embedding", 1), ("head", 1), ("embedding", 2), ("head", 2)}
    assert {c.op for c in p.collectives} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert all(lp.samples for lp in p.layers) and all(c.samples for c in p.collectives)
    assert load_profile(path) == p  # the file is the whole profile
    for words in ("layers", "collectives", "overlap", "written to"):
        assert words in stdout


def test_a_profile_applies_to_its_device_type_only(measured) -> None:
    p = load_profile(measured[0])
    expect_error(lambda: calibrate(p, dgx(1, 8, "A100-80GB")), "'CPU'", "'A100-80GB'")


@pytest.mark.parametrize("content,needle", [
    (None, "cannot read profile"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a profile object"),
    (json.dumps({"version": 99}), "schema version 99"),
    (json.dumps({"version": PROFILE_VERSION, "device": {"kind": "tpu"}}), "device"),
])
def test_bad_profiles_are_one_line_errors(tmp_path, content, needle) -> None:
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    expect_error(lambda: load_profile(path), needle)


def test_profile_needs_two_ranks() -> None:
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "profile", "--model", "tiny-llama", "--nproc", "1"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "--nproc" in proc.stderr and "Traceback" not in proc.stderr
