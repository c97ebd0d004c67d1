"""Galvatron 2.4.0's memory profiles calibrate plait's memory terms, and plait's default memory model agrees
with what they measured (fixtures: Galvatron's shipped files under tests/data/galvatron)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

from plait.cost.calibration import calibration_for
from plait.cost.comm import SINGLE
from plait.cost.layer import BlockContext, block_activation_bytes
from plait.cost.precision import PRECISIONS
from plait.errors import PlaitError
from plait.galvatron import load_galvatron_profiles, measured_memory, to_calibration
from plait.plan import Strategy, uniform_plan
from plait.simulate import simulate
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS

DATA = Path(__file__).parent / "data" / "galvatron"
LLAMA = DATA / "llama_fa"
PROFILE = "memory_profiling_bf16_hidden4096_head32_seqlen2048.json"
MIB = 2**20
MODEL = PRESETS["llama2-7b"]
CLUSTER = dgx(1, 8, "A100-80GB")
ROOT = Path(__file__).resolve().parent.parent


def _calibration(model_dir: Path = LLAMA):
    galv = load_galvatron_profiles(model_dir, DATA / "hardware_configs", "A100-80GB")
    return galv, to_calibration(galv, MODEL, CLUSTER, calibration_for("A100-80GB"))


def test_reader_keeps_the_other_memory_entries():
    galv, _ = _calibration()
    other = {(o.position, o.sequence_parallel): o for o in galv.other_memory}
    assert sorted(other) == [("first", False), ("first", True), ("last", False), ("last", True),
                             ("whole", False), ("whole", True)]
    whole = other[("whole", False)]
    assert (whole.seq_len, dict(whole.model_states_mib), dict(whole.activation_mib_per_sample)) == \
        (2048, {1: 4258.0}, {1: 572.53076171875})
    assert dict(other[("last", True)].activation_mib_per_sample) == {1: 157.0390625, 2: 78.53125,
                                                                     4: 43.32733154296875, 8: 21.663665771484375}


def test_profile_maps_into_plait_memory_terms():
    galv, cal = _calibration()
    mem = cal.memory
    assert mem is not None and measured_memory(galv, MODEL)[0].edges.keys() == mem.edges.keys() == \
        {"whole", "first", "last"}
    # 301.28173828125 MiB per 2048-token sequence = 154,256.25 bytes per token; checkpoint 16 MiB = 2 h bytes.
    assert mem.activation_bytes_per_token[("decoder", 1, "none")] == 154256.25
    assert mem.activation_bytes_per_token[("decoder", 8, "none")] == 93.56256103515625 * 512
    assert {k: v for k, v in mem.activation_bytes_per_token.items() if k[2] == "full"} == {
        ("decoder", tp, "full"): 8192.0 for tp in (1, 2, 4, 8)}
    # 4 x 773.25 MiB over the 202,383,360 parameters of a Llama-2-7B block: Galvatron's 16 bytes each.
    assert MODEL.block.params == 202383360
    assert mem.states_bytes_per_param["decoder"] == pytest.approx(16.0, rel=2e-3)
    assert mem.states_bytes_per_param["decoder"] == 4 * 773.2509765625 * MIB / 202383360
    assert mem.edge_activation("head", False, 1, 2) == 572.53076171875 * 512
    assert mem.edge_activation("head", True, 1, 2) == 184.5286865234375 * 512
    assert mem.edge_activation("embedding", False, 2, 2) == 46.5582275390625 * 512 / 2


def test_calibrated_plan_has_galvatrons_measured_activations():
    """Pure ZeRO-3 over 8 GPUs, 4 micro-batches of 16 sequences (2 per device): the device keeps 32 blocks x
    2 sequences of Galvatron's measured block activations and the head's measured peak for 2 sequences. Its
    measured model states (16.03 bytes per parameter) agree with plait's ZeRO-3 default (16: the fp32 shard is
    the master copy) within 0.2%; at 18 bytes (a sharded 16-bit copy beside the master) they were 12% over."""
    _, cal = _calibration()
    plan = uniform_plan("tp=1,pp=1,dp=8,zero=3,mbs=2,gbs=64", MODEL, CLUSTER, 2048)
    terms = max((d.memory for d in simulate(plan, MODEL, CLUSTER, cal).devices), key=lambda m: m.total)
    assert terms.activations / MIB == pytest.approx(32 * 2 * 301.28173828125 + 2 * 572.53076171875, rel=1e-12)
    default = max((d.memory for d in simulate(plan, MODEL, CLUSTER).devices), key=lambda m: m.total)
    assert (default.weights + default.gradients + default.optimizer) / \
        (terms.weights + terms.gradients + terms.optimizer) == pytest.approx(1.0, abs=2e-3)


def test_default_model_agrees_with_the_measured_block():
    """plait's formula for a Llama-2-7B block (flash attention, unfused SwiGLU keeping four ffn-wide tensors)
    within 0.4% of Galvatron's measurement, and a GPT block within 0.05% (Korthikanti's 34 s h)."""
    ctx = BlockContext(MODEL, CLUSTER, calibration_for("A100-80GB"), PRECISIONS["bf16"], 2048, 1, SINGLE, SINGLE,
                       SINGLE)
    per_seq = block_activation_bytes(MODEL.block, Strategy(), ctx)
    h, f = 4096, 11008
    assert per_seq == 2048 * (8 * h + 4 * h + 2 * h + 2 * h + 4 * 2 * f + 4 * 32)
    assert per_seq / MIB == pytest.approx(301.28173828125, rel=0.004)
    assert per_seq / MIB / 301.28173828125 - 1 == pytest.approx(-0.0035, abs=5e-4)


def test_memory_profile_errors_are_one_line(tmp_path: Path):
    for name in ("computation_profiling_bf16_hidden4096_head32_seqlen2048.json", PROFILE):
        shutil.copy(LLAMA / name, tmp_path / name)
    raw = json.loads((tmp_path / PROFILE).read_text())
    cases = [({"activation": "big", "model_states": 1.0}, "other_memory_pp_off.activation must be a number"),
             ({"model_states": 1.0}, "other_memory_pp_off lacks model_states or activation"),
             ([1, 2], "other_memory_pp_off is not an object"),
             ({"activation": {"x": 1.0}, "model_states": 1.0}, "has key 'x'; expected TP degrees")]
    for value, message in cases:
        (tmp_path / PROFILE).write_text(json.dumps(raw | {"other_memory_pp_off": value}))
        with pytest.raises(PlaitError, match=message) as err:
            load_galvatron_profiles(tmp_path, None, "A100-80GB")
        assert "\n" not in str(err.value)


def test_cli_simulate_uses_the_memory_profile(tmp_path: Path):
    ref = f"A100-80GB:{LLAMA}:{DATA / 'hardware_configs'}"
    args = [sys.executable, "-m", "plait.cli", "simulate", "--model", "llama2-7b", "--cluster", "1x8xA100-80GB",
            "--seq-len", "2048", "--strategy", "tp=1,pp=1,dp=8,zero=3,mbs=2,gbs=64", "--json"]
    default = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
    calibrated = json.loads(subprocess.run(args + ["--galvatron-profile", ref], capture_output=True, text=True,
                                           check=True).stdout)
    assert round(default["peak_memory_gib"], 1) == 37.1 and round(calibrated["peak_memory_gib"], 1) == 37.3
    (tmp_path / "configs").mkdir()
    for name in ("computation_profiling_bf16_hidden4096_head32_seqlen2048.json", PROFILE):
        shutil.copy(LLAMA / name, tmp_path / "configs" / name)
    bad = json.loads((LLAMA / PROFILE).read_text()) | {"other_memory_pp_on_last": 3}
    (tmp_path / "configs" / PROFILE).write_text(json.dumps(bad))
    out = subprocess.run(args + ["--galvatron-profile", f"A100-80GB:{tmp_path / 'configs'}"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "other_memory_pp_on_last is not an object" in out.stderr + out.stdout


def _benchmark():
    return load_benchmark("galvatron_memory")


def test_galvatrons_own_model_on_its_profile():
    """The benchmark's re-implementation of Galvatron's MemoryCostModel: pure ZeRO-3 over 8 GPUs, 4 chunks,
    2048 tokens: 32 x 3093 MiB x (7/8 (1/8 + 0.003) + 1/8) of states (an unsharded 1/8: bf16 gradients kept
    whole while the reduction waits for the last micro-batch), 32 x 2 x 301.28 MiB of activations, 4258 MiB
    of unsharded embedding and head, 2 x 572.53 MiB of their transients, 1024 MiB of context: 48.0 GiB."""
    bench = _benchmark()
    mem = json.loads((LLAMA / PROFILE).read_text())
    g = bench.galvatron_memory(mem, 32, 1, 1, 8, True, False, 4, 2048)
    assert g.states == pytest.approx(32 * 4 * 773.2509765625 * (7 / 8 * (1 / 8 + 0.003) + 1 / 8), rel=1e-12)
    assert g.activations == 32 * 2 * 301.28173828125
    assert (g.edge_states, g.edge_activations, g.context) == (4258.0, 2 * 572.53076171875, 1024)
    assert round(g.total / 1024, 1) == 48.0
    assert round(bench.galvatron_memory(mem, 32, 1, 1, 8, True, False, 4, 4096).total / 1024, 1) == 67.2
