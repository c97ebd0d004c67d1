"""`plait profile` end to end (quick), and the profile file's round trip and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import expect_error

from plait.cost import comm
from plait.cost.comm import GroupShape
from plait.cost.layer import BlockContext, block_activation_bytes, block_time
from plait.cost.measured import calibrate, profiled_cluster
from plait.cost.precision import PRECISIONS
from plait.errors import PlaitError
from plait.plan import Strategy, uniform_plan
from plait.profile.schema import (
    PROFILE_VERSION,
    CollectiveCurve,
    Curve,
    Device,
    LayerProfile,
    Profile,
    load_profile,
)
from plait.simulate import simulate
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS


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


def _synthetic() -> Profile:
    device = Device(kind="cpu", gpu_type="CPU", name="test", cores=2, memory_bytes=8 * 2**30, peak_flops=1e11,
                    memory_bandwidth=1e10, torch="2.13")
    curve = Curve(intercept_s=1e-4, per_token_s=1e-6, per_token_seq_s=1e-9)
    block = LayerProfile(model="tiny-llama", tp=1, forward=curve, backward=curve.model_copy(
        update={"per_token_s": 2e-6}), activation_bytes_per_token=1000.0)
    full = block.model_copy(update={"recompute": "full", "backward": curve.model_copy(update={"per_token_s": 3e-6}),
                                    "activation_bytes_per_token": 512.0})
    ar = CollectiveCurve(op="all_reduce", ranks=2, latency_s=1e-4, bandwidth=1e9)
    return Profile(device=device, process_bytes=300 * 2**20, layers=(block, full), collectives=(ar,))


def test_the_cost_model_prefers_measured_costs() -> None:
    p = _synthetic()
    cluster, cal = calibrate(p, profiled_cluster(p, "1x2xCPU"))
    assert cluster.gpu.name == "CPU" and cluster.gpu.peak_flops == 1e11
    spec = PRESETS["tiny-llama"]
    prec = PRECISIONS["fp32"]
    ctx = BlockContext.for_ranks(spec, cluster, cal, prec, 64, 2, Strategy(), (0,), (0,))
    bt = block_time(Strategy(), ctx)
    tokens = 2 * 64
    assert bt.forward == pytest.approx(1e-4 + 1e-6 * tokens + 1e-9 * tokens * 64)
    assert bt.backward == pytest.approx(1e-4 + 2e-6 * tokens + 1e-9 * tokens * 64)
    full = block_time(Strategy(recompute="full"), ctx)
    assert full.recompute == pytest.approx(1e-6 * tokens)  # measured backward with recompute less without
    assert block_activation_bytes(Strategy(recompute="full"), ctx) == pytest.approx(512 * tokens)
    group = GroupShape.of((0, 1), 2)
    assert comm.all_reduce(1e6, group, cluster, cal) == pytest.approx(1e-4 + 1e6 / 1e9)
    assert comm.all_gather(1e6, group, cluster, cal) > 0  # not measured: the analytic model on the fitted link
    report = simulate(uniform_plan("dp=2,gbs=4,precision=fp32", spec, cluster, 64), spec, cluster, cal=cal)
    assert all(d.memory.reserve >= 300 * 2**20 for d in report.devices)
    # four ranks on two cores: each computes at half speed
    crowded, crowded_cal = calibrate(p, profiled_cluster(p, "1x4xCPU"))
    ctx4 = BlockContext.for_ranks(spec, crowded, crowded_cal, prec, 64, 2, Strategy(), (0,), (0,))
    assert block_time(Strategy(), ctx4).forward == pytest.approx(2 * bt.forward)
    assert crowded.gpu.peak_flops == 0.5e11
    with pytest.raises(PlaitError, match="one node"):
        profiled_cluster(p, "2x2xCPU")
    assert profiled_cluster(p, "1x8xA100-80GB") is None
