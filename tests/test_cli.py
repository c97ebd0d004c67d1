"""Tests for the `plait` command line (DESIGN.md's public interface): presets, simulate, errors.

Most tests run the typer app in-process with CliRunner (fast). One test runs the installed console script
in a subprocess to prove the entry point works and that `--json` puts exactly one JSON object on stdout.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ANSI, assert_bad_input
from typer.testing import CliRunner

from plait.cli import app
from plait.plan import Pipeline, Plan, Stage, Strategy, uniform_plan
from plait.spec.cluster import GPUS, load_cluster
from plait.spec.model import PRESETS, load_model

REPO = Path(__file__).resolve().parents[1]

GPT175 = ["--model", "gpt3-175b", "--cluster", "192x8xA100-80GB", "--seq-len", "2048"]
GPT175_STRATEGY = "tp=8,pp=8,dp=24,mbs=2,gbs=2304,recompute=full,vpp=2"
TINY = ["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--seq-len", "256"]
TINY_STRATEGY = "tp=2,dp=2,mbs=1,gbs=8"
# A 2-stage tiny pipeline (so --slow on one stage shows in the critical path).
TINY_PP = ["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--seq-len", "256",
           "--strategy", "tp=2,pp=2,dp=1,mbs=1,gbs=8"]

DESIGN_KEYS = {"iteration_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu",
               "hfu", "peak_memory_gib", "fits", "breakdown"}

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def ok(*args: str):
    """Invoke and require success without an escaped exception."""
    result = invoke(*args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


def report(*args: str) -> dict:
    """Run `simulate ... --json` and return the one JSON object of stdout."""
    result = ok("simulate", *args, "--json")
    data = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert isinstance(data, dict)
    assert result.stdout.count("\n") == 1 and result.stdout.endswith("\n")
    return data


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


# ---- presets ------------------------------------------------------------------------------------------

def test_models_lists_every_preset():
    out = ok("models").stdout
    for name in PRESETS:
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", out, re.MULTILINE), name


def test_clusters_lists_gpu_types():
    out = ok("clusters").stdout
    for gpu in ("A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"):
        assert gpu in out
    assert set(GPUS) >= {"A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"}


def test_no_arguments_shows_help_not_traceback():
    result = invoke()
    assert "Traceback" not in result.output
    assert "simulate" in result.output


# ---- simulate: table and JSON --------------------------------------------------------------------------

def test_simulate_prints_prediction_table():
    out = ANSI.sub("", ok("simulate", *GPT175, "--strategy", GPT175_STRATEGY).stdout)
    for text in ("iteration time", "MFU", "HFU", "peak memory", "memory per device", "gpt3-175b",
                 "192x8xA100-80GB"):
        assert text in out, text
    assert "Traceback" not in out


def test_simulate_names_how_a_moe_plans_tokens_travel():
    moe = ("-m", "qwen3-30b-a3b", "-c", "2x8xH100-80GB", "-s", "4096")
    out = " ".join(ANSI.sub("", ok("simulate", *moe, "--strategy",
                                   "dp=16,ep=16,gbs=1024,dispatcher=deepep,ep_overlap=1").stdout).split())
    assert "routed tokens: deepep, ep overlap" in out
    plain = " ".join(ANSI.sub("", ok("simulate", *moe, "--strategy", "dp=16,ep=16,gbs=1024").stdout).split())
    assert "routed tokens: alltoall" in plain and "ep overlap" not in plain
    assert "routed tokens" not in ANSI.sub("", ok("simulate", *GPT175, "--strategy", GPT175_STRATEGY).stdout)


def test_simulate_json_report_keys_and_consistency():
    data = report(*GPT175, "--strategy", GPT175_STRATEGY)
    assert DESIGN_KEYS <= data.keys()
    for key in DESIGN_KEYS - {"fits", "breakdown"}:
        assert isinstance(data[key], float) and math.isfinite(data[key]) and data[key] > 0, key
    assert isinstance(data["fits"], bool)
    assert data["fits"] is True  # the published Megatron layout fits on 80 GB
    assert data["hfu"] >= data["mfu"]
    assert data["hardware_tflops_per_gpu"] > data["model_tflops_per_gpu"]  # recompute=full repeats FLOPs
    assert data["hfu"] < 1.0 and data["mfu"] < 1.0
    bd = data["breakdown"]
    assert isinstance(bd, dict) and bd
    assert all(isinstance(v, (int, float)) and v >= 0 for v in bd.values())
    assert close(sum(bd.values()), data["iteration_time_s"], 1e-6)
    assert bd["recompute"] > 0 and bd["compute"] > 0
    # tokens/s agrees with the iteration time: 2304 sequences of 2048 tokens
    assert close(data["tokens_per_s"] * data["iteration_time_s"], 2304 * 2048, 1e-9)
    assert data["peak_memory_gib"] > 0


def test_simulate_json_without_recompute_has_equal_model_and_hardware_flops():
    data = report(*TINY, "--strategy", TINY_STRATEGY)
    assert close(data["hfu"], data["mfu"])
    assert close(data["hardware_tflops_per_gpu"], data["model_tflops_per_gpu"])
    assert close(sum(data["breakdown"].values()), data["iteration_time_s"], 1e-6)


def console_script() -> Path:
    """The installed `plait` entry point next to this interpreter (the project's .venv)."""
    exe = Path(sys.executable).with_name("plait")
    return exe if exe.exists() else REPO / ".venv" / "bin" / "plait"


def test_console_script_json_is_exactly_one_object():
    proc = subprocess.run(
        [str(console_script()), "simulate", *TINY, "--strategy", TINY_STRATEGY, "--json"],
        check=False, capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    decoder = json.JSONDecoder()
    obj, end = decoder.raw_decode(proc.stdout)
    assert proc.stdout[end:].strip() == ""  # nothing after the one object
    assert proc.stdout.lstrip() == proc.stdout  # nothing before it
    assert isinstance(obj, dict) and DESIGN_KEYS <= obj.keys()
    assert obj["iteration_time_s"] > 0


def test_console_script_bad_input_exits_2_without_traceback():
    proc = subprocess.run(
        [str(console_script()), "simulate", "--model", "no-such-model", "--cluster", "1x4xA100-80GB", "--strategy", "tp=1"],
        check=False, capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr


# ---- --plan ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_plan_file_matches_strategy(tmp_path, suffix):
    model, cluster = load_model("gpt3-175b"), load_cluster("192x8xA100-80GB")
    path = tmp_path / f"plan{suffix}"
    uniform_plan(GPT175_STRATEGY, model, cluster, 2048).save(path)
    from_plan = report("--model", "gpt3-175b", "--cluster", "192x8xA100-80GB", "--plan", path)
    from_strategy = report(*GPT175, "--strategy", GPT175_STRATEGY)
    assert close(from_plan["iteration_time_s"], from_strategy["iteration_time_s"], 1e-12)
    assert close(from_plan["peak_memory_gib"], from_strategy["peak_memory_gib"], 1e-12)


def test_plan_file_with_seq_len_override_matches_strategy(tmp_path):
    model, cluster = load_model("tiny-gpt"), load_cluster("1x4xA100-80GB")
    path = tmp_path / "plan.json"
    uniform_plan(TINY_STRATEGY, model, cluster, 256).save(path)
    overridden = report("--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan", path, "--seq-len", "128")
    direct = report("--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--seq-len", "128",
                    "--strategy", TINY_STRATEGY)
    assert close(overridden["iteration_time_s"], direct["iteration_time_s"], 1e-12)


def per_layer_plan() -> Plan:
    """tiny-llama on 4 ranks, one stage: layers 0-1 dp2 tp2, layers 2-3 dp4 (Galvatron-style)."""
    a = Strategy(dp=2, tp=2)
    b = Strategy(dp=4, tp=1)
    stage = Stage(layers=(0, 4), ranks=(0, 1, 2, 3), strategies=(a, a, b, b))
    return Plan(model="tiny-llama", seq_len=256, global_batch=8,
                pipelines=(Pipeline(stages=(stage,), micro_batches=2, micro_batch_sequences=4),))


def test_hand_written_per_layer_plan(tmp_path):
    path = tmp_path / "layers.json"
    per_layer_plan().save(path)
    args = ("--model", "tiny-llama", "--cluster", "1x4xA100-80GB", "--plan", path)
    data = report(*args)
    assert data["iteration_time_s"] > 0 and data["fits"] is True
    assert data["breakdown"]["relayout"] > 0
    assert close(sum(data["breakdown"].values()), data["iteration_time_s"], 1e-6)
    out = ANSI.sub("", ok("simulate", *args).stdout)
    assert "dp2 tp2" in out and "dp4 tp1" in out


def test_hand_written_two_stage_plan_yaml(tmp_path):
    """Stages on explicit ranks, different strategies per stage, written as YAML by hand."""
    path = tmp_path / "two.yaml"
    path.write_text(
        "model: tiny-gpt\nseq_len: 256\nglobal_batch: 8\nschedule: 1f1b\n"
        "pipelines:\n"
        "- micro_batches: 4\n  micro_batch_sequences: 2\n  stages:\n"
        "  - {layers: [0, 2], ranks: [0, 1], strategies: [{dp: 2}]}\n"
        "  - {layers: [2, 4], ranks: [2, 3], strategies: [{tp: 2}]}\n"
    )
    data = report("--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan", path)
    assert data["iteration_time_s"] > 0
    assert len(data["devices"]) == 2
    assert close(sum(data["breakdown"].values()), data["iteration_time_s"], 1e-6)


# ---- --timeline ---------------------------------------------------------------------------------------

def test_timeline_writes_png_and_no_temp_files(tmp_path):
    png = tmp_path / "out.png"
    result = ok("simulate", *TINY_PP, "--timeline", png)
    assert png.is_file() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png"]
    assert "out.png" in ANSI.sub("", result.stdout).replace("\n", "")


def test_timeline_with_json_keeps_stdout_pure(tmp_path):
    png = tmp_path / "t.png"
    data = report(*TINY_PP, "--timeline", png)
    assert data["iteration_time_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png"]


def test_timeline_unwritable_path_is_bad_input(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_bad_input(invoke("simulate", *TINY_PP, "--timeline", tmp_path / "file" / "out.png"))


# ---- --slow -------------------------------------------------------------------------------------------

def test_slow_rank_makes_iteration_slower():
    base = report(*TINY_PP)
    slow = report(*TINY_PP, "--slow", "0:3.0")
    assert slow["iteration_time_s"] > base["iteration_time_s"] * 1.2
    assert slow["mfu"] < base["mfu"]
    assert close(sum(slow["breakdown"].values()), slow["iteration_time_s"], 1e-6)
    big = report(*GPT175, "--strategy", GPT175_STRATEGY, "--slow", "5:1.5")
    assert big["iteration_time_s"] > report(*GPT175, "--strategy", GPT175_STRATEGY)["iteration_time_s"]


def test_slow_shows_the_healthy_time_beside():
    slow = report(*TINY_PP, "--slow", "0:3.0")
    assert slow["healthy_iteration_time_s"] == pytest.approx(report(*TINY_PP)["iteration_time_s"])
    assert "healthy_iteration_time_s" not in report(*TINY_PP)
    text = ok("simulate", *TINY_PP, "--slow", "0:3.0").stdout
    assert "the healthy cluster's" in text


def test_slow_factor_one_changes_nothing():
    base = report(*TINY_PP)
    same = report(*TINY_PP, "--slow", "2:1.0")
    assert close(same["iteration_time_s"], base["iteration_time_s"], 1e-12)


@pytest.mark.parametrize("value", ["x", "3", "99:2", "0:0.5", "0:abc", "-1:2", "0:0"])
def test_bad_slow_values(value):
    assert_bad_input(invoke("simulate", *TINY_PP, "--slow", value), "--slow")


@pytest.mark.parametrize("value", ["0:nan", "0:inf"])
def test_non_finite_slow_values(value):
    assert_bad_input(invoke("simulate", *TINY_PP, "--slow", value), "--slow")


# ---- --memory-gib ---------------------------------------------------------------------------------------

def test_memory_override_reports_not_fitting():
    data = report(*GPT175, "--strategy", GPT175_STRATEGY, "--memory-gib", "1")
    assert data["fits"] is False
    assert data["over_memory_gib"] > 0
    assert close(data["over_memory_gib"], data["peak_memory_gib"] - 1.0, 1e-9)
    out = ANSI.sub("", ok("simulate", *GPT175, "--strategy", GPT175_STRATEGY, "--memory-gib", "1").stdout)
    assert "GiB over" in out


@pytest.mark.parametrize("value", ["0", "-1"])
def test_non_positive_memory_is_bad_input(value):
    assert_bad_input(invoke("simulate", *TINY, "--strategy", TINY_STRATEGY, "--memory-gib", value),
                     "--memory-gib")


def test_nan_memory_is_bad_input():
    assert_bad_input(invoke("simulate", *TINY, "--strategy", TINY_STRATEGY, "--memory-gib", "nan"),
                     "--memory-gib")


# ---- bad input ------------------------------------------------------------------------------------------

def _write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


BAD_INPUTS = {
    "unknown preset": (["--model", "no-such-model", "--cluster", "1x4xA100-80GB", "--strategy", "tp=1"],
                       ["no-such-model"]),
    "malformed inline spec": (["--model", "gpt:layers=x", "--cluster", "1x4xA100-80GB", "--strategy", "tp=1"],
                              ["layers"]),
    "inline spec missing keys": (["--model", "gpt:layers=4", "--cluster", "1x4xA100-80GB", "--strategy",
                                  "tp=1"], ["hidden"]),
    "unknown gpu type": (["--model", "tiny-gpt", "--cluster", "2x8xV100", "--strategy", "tp=1"], ["V100"]),
    "unknown cluster text": (["--model", "tiny-gpt", "--cluster", "bogus", "--strategy", "tp=1"], ["bogus"]),
    "missing cluster yaml": (["--model", "tiny-gpt", "--cluster", "{tmp}/nope.yaml", "--strategy", "tp=1"],
                             ["nope.yaml"]),
    "tp not dividing heads": (["--model", "tiny-gpt", "--cluster", "1x8xA100-80GB", "--strategy", "tp=8"],
                              ["tp=8"]),
    "degrees do not match devices": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy",
                                      "tp=2,dp=1"], ["4 devices"]),
    "degrees do not divide devices": (["--model", "gpt3-1.3b", "--cluster", "1x8xA100-80GB", "--strategy",
                                       "tp=3"], ["divide"]),
    "both plan and strategy": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy", "tp=1",
                                "--plan", "{tmp}/plan.json"], ["--plan"]),
    "neither plan nor strategy": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB"], ["--strategy"]),
    "missing plan file": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan", "{tmp}/none.json"],
                          ["none.json"]),
    "corrupt plan json": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan", "{tmp}/corrupt.json"],
                          ["corrupt.json"]),
    "corrupt plan yaml": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan", "{tmp}/corrupt.yaml"],
                          ["corrupt.yaml"]),
    "plan json of wrong shape": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan",
                                  "{tmp}/list.json"], ["list.json"]),
    "plan with unknown field": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan",
                                 "{tmp}/extra.json"], ["extra.json"]),
    "plan for more ranks than cluster": (["--model", "tiny-gpt", "--cluster", "1x2xA100-80GB", "--plan",
                                          "{tmp}/plan.json"], ["rank 3"]),
    "plan for another model's layers": (["--model", "gpt3-1.3b", "--cluster", "1x4xA100-80GB", "--plan",
                                         "{tmp}/plan.json"], ["layers"]),
    "unknown strategy key": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy", "tp=2,foo=1"],
                             ["foo"]),
    "strategy item without =": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy", "tp2"],
                                ["tp2"]),
    "non-integer degree": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy", "tp=two"],
                           ["tp"]),
    "zero degree": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy", "tp=0"], ["tp"]),
    "bad recompute": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy", "recompute=most"],
                      ["recompute"]),
    "gbs not multiple of mbs*dp": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy",
                                    "dp=4,gbs=6"], ["gbs"]),
    "negative seq-len": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy", "tp=1",
                          "--seq-len", "-5"], ["--seq-len"]),
    "zero seq-len": (["--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--strategy", "tp=1",
                      "--seq-len", "0"], ["--seq-len"]),
}


@pytest.fixture
def plan_dir(tmp_path: Path) -> Path:
    model, cluster = load_model("tiny-gpt"), load_cluster("1x4xA100-80GB")
    uniform_plan(TINY_STRATEGY, model, cluster, 256).save(tmp_path / "plan.json")
    _write(tmp_path / "corrupt.json", '{"model": "tiny-gpt", "seq_len": ')
    _write(tmp_path / "corrupt.yaml", "model: [tiny-gpt\n")
    _write(tmp_path / "list.json", "[1, 2, 3]")
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["bogus"] = 1
    _write(tmp_path / "extra.json", json.dumps(plan))
    return tmp_path


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, plan_dir):
    args, needles = BAD_INPUTS[case]
    args = [a.replace("{tmp}", str(plan_dir)) for a in args]
    assert_bad_input(invoke("simulate", *args), *needles)


@pytest.mark.parametrize("seq_len", ["-5", "0"])
def test_plan_with_non_positive_seq_len_is_bad_input(plan_dir, seq_len):
    assert_bad_input(invoke("simulate", "--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan",
                            plan_dir / "plan.json", "--seq-len", seq_len), "--seq-len")


def test_binary_plan_file_is_bad_input(tmp_path):
    path = _write(tmp_path / "binary.json", bytes(range(128, 256)))
    assert_bad_input(invoke("simulate", "--model", "tiny-gpt", "--cluster", "1x4xA100-80GB", "--plan", path),
                     "binary.json")


def test_every_command_function_is_short():
    """Each command of the cli package is at most 60 lines (signature and docstring included): its steps
    live in named helpers, its options and error handling in plait.cli.common."""
    import inspect

    commands = {info.callback.__name__: info.callback for info in app.registered_commands}
    assert len(commands) == 10
    for name, function in commands.items():
        assert function.__module__.startswith("plait.cli."), name
        lines = len(inspect.getsource(function).splitlines())
        assert lines <= 60, f"{name} ({function.__module__}) is {lines} lines"


def test_python_m_plait_cli_runs_the_command():
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "--help"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    for command in ("models", "clusters", "simulate", "report", "plan", "varlen", "multitask", "kv-eval", "profile",
                    "train"):
        assert command in proc.stdout


def test_simulate_names_the_recompute_modules_and_train_refuses_what_mtp_cannot_in_one_line():
    out = " ".join(ANSI.sub("", ok("simulate", "-m", "deepseek-v3", "-c", "32x8xH100-80GB", "-s", "4096", "--strategy",
                                   "tp=2,sp=1,pp=8,dp=16,ep=32,etp=1,gbs=512,zero=1,recompute_modules=mla_up_proj+mlp"
                                   ).stdout).split())
    assert "rcm=mla_up_proj+mlp" in out
    train = ["train", "--nproc", "2", "--steps", "1", "--seq-len", "32"]
    runner = CliRunner()
    for model, strategy in (("llama:layers=2,hidden=64,heads=2,vocab=256,mtp=1", "cp=2,gbs=4"),
                            ("llama:layers=2,hidden=64,heads=2,vocab=256,mtp=1,tied=1", "dp=2,gbs=4")):
        assert_bad_input(runner.invoke(app, [*train, "--model", model, "--strategy", strategy]),
                         "multi-token-prediction")
