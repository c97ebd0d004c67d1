"""Bad input through the command line, in-process: one line on stderr, exit 2, nothing written, and the
check happens before any long work (measurement, search, launching ranks)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import ANSI, assert_bad_input
from typer.testing import CliRunner

import plait.runtime.preflight as preflight
from plait.cli import MAX_GLOBAL_BATCH, app, json_line
from plait.plan import MAX_MICRO_BATCH_STAGES
from plait.spec.model import load_model

runner = CliRunner()
SIM = ["simulate", "--model", "tiny-gpt", "--cluster", "1x2xA100-80GB", "--seq-len", "256"]
PLAN = ["plan", "--model", "tiny-gpt", "--cluster", "1x2xA100-80GB", "--global-batch", "8"]
TRAIN = ["train", "--model", "tiny-gpt", "--strategy", "dp=1,gbs=2"]


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_profile_checks_its_output_before_measuring() -> None:
    t0 = time.perf_counter()
    assert_bad_input(invoke("profile", "--model", "tiny-llama", "--nproc", "2", "--quick", "--out", "/proc/p.json"),
                     "--out '/proc/p.json' is not writable")
    assert time.perf_counter() - t0 < 5  # refused before the minute of measuring


def test_huge_batches_are_refused_not_simulated() -> None:
    assert_bad_input(invoke(*SIM, "--strategy", "dp=2,gbs=1000000000000000000"),
                     "runs 500000000000000000 micro-batches", f"at most {MAX_MICRO_BATCH_STAGES}")
    assert_bad_input(invoke(*PLAN[:-1], "1000000000000"), "--global-batch 1000000000000",
                     f"({MAX_GLOBAL_BATCH})")


def test_vpp_needs_a_pipeline() -> None:
    assert_bad_input(invoke(*SIM, "--strategy", "dp=2,vpp=2"), "chunks=2 (vpp)", "pp=1")
    assert_bad_input(invoke(*TRAIN[:-1], "dp=2,vpp=2", "--nproc", "2"), "chunks=2 (vpp)", "pp=1")


def test_repeated_strategy_key() -> None:
    assert_bad_input(invoke(*SIM, "--strategy", "dp=8,dp=2"), "dp is given twice")


@pytest.mark.parametrize("extra, needle", [
    (["--memory-gib", "1e308"], "--memory-gib must be a positive number of GiB up to 1048576"),
    (["--slow", "1:1e308"], "a slowdown factor is a number from 1.0 to 10000"),
])
def test_extreme_numbers_are_refused(extra, needle) -> None:
    assert_bad_input(invoke(*SIM, "--strategy", "dp=2", "--json", *extra), needle)
    assert_bad_input(invoke(*PLAN, "--json", *extra), needle)


def test_json_output_has_no_out_of_range_numbers() -> None:
    assert json_line({"a": float("inf"), "b": [float("nan"), 1.5], "c": {"d": -float("inf")}}) == \
        '{"a": null, "b": [null, 1.5], "c": {"d": null}}\n'
    data = json.loads(invoke(*SIM, "--strategy", "dp=2", "--json", "--memory-gib", "1048576").stdout)
    assert data["memory_capacity_gib"] == 1048576.0


def test_no_file_is_left_when_a_later_output_fails(tmp_path: Path) -> None:
    ok = tmp_path / "ok.json"
    assert_bad_input(invoke(*PLAN, "--out", ok, "--galvatron-out", "/proc/g.json"),
                     "--galvatron-out '/proc/g.json' is not writable")
    assert list(tmp_path.iterdir()) == []


def test_out_naming_a_directory_writes_a_file_inside_it(tmp_path: Path) -> None:
    result = invoke(*PLAN, "--out", f"{tmp_path / 'newdir'}/", "--json")
    assert result.exit_code == 0, result.stderr
    written = json.loads((tmp_path / "newdir" / "plan.json").read_text())
    assert written == json.loads(result.stdout)["plan"]
    assert written["model_fingerprint"] == load_model("tiny-gpt").fingerprint


def test_plan_file_for_another_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    assert invoke(*PLAN, "--out", path).exit_code == 0
    other = "gpt:layers=4,hidden=256,heads=4,vocab=256"  # tiny-gpt's layer count, another shape
    assert_bad_input(invoke("simulate", "--model", other, "--cluster", "1x2xA100-80GB", "--plan", path),
                     "the plan was made for tiny-gpt, whose architecture differs")


def test_messages_keep_square_brackets(tmp_path: Path) -> None:
    name = tmp_path / "galvatron_config_[tpconsec_off].json"
    result = invoke(*SIM, "--plan", name)
    assert_bad_input(result, "[tpconsec_off]")


def test_timeline_path_is_checked_first() -> None:
    assert_bad_input(invoke(*SIM, "--strategy", "dp=2", "--timeline", "/proc/t.png"),
                     "--timeline '/proc/t.png' is not writable")


@pytest.mark.parametrize("extra, needle", [
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--lr", "inf"], "--lr must be a positive number"),
    (["--seed", "-3"], "--seed must be an integer from 0"),
    (["--timeout", "0"], "--timeout must be a number of seconds"),
    (["--seq-len", "0"], "--seq-len must be a positive number of tokens, got 0"),
    (["--seq-len", "512"], "--seq-len 512 exceeds tiny-gpt's 256 positions"),
    (["--metrics-out", "/proc/m.jsonl"], "--metrics-out '/proc/m.jsonl' is not writable"),
    (["--checkpoint-every", "1"], "--checkpoint-every saves into --checkpoint-dir"),
    (["--checkpoint-dir", "/proc/ck"], "--checkpoint-dir '/proc/ck' is not writable"),
    (["--resume-from", "/nonexistent/step-3"], "--resume-from '/nonexistent/step-3' is not a directory"),
    (["--adaptive", "--switch-via", "disk"], "--switch-via must be network or dcp, got 'disk'"),
    (["--adaptive", "--replan-degrees", "some"], "--replan-degrees must be any or keep, got 'some'"),
])
def test_train_checks_before_launching(extra, needle) -> None:
    assert_bad_input(invoke(*TRAIN, *extra), needle)


def test_train_refuses_a_checkpoint_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    path.write_text("")
    assert_bad_input(invoke(*TRAIN, "--checkpoint-dir", path), f"--checkpoint-dir {str(path)!r} is a file")


def test_train_refuses_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "free_bytes", lambda directory: 1000)
    need = preflight.checkpoint_bytes(load_model("tiny-gpt")) / 2**30
    assert_bad_input(invoke(*TRAIN, "--checkpoint-dir", tmp_path / "ck"),
                     "has 0.00 GiB free", f"takes about {need:.2f} GiB")


def test_train_refuses_a_model_larger_than_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 16 * 2**30)
    model = load_model("llama2-7b")
    need = preflight.host_memory_need(model, 2)
    assert need == int(16 * model.params + 2 * preflight.RANK_BASE_BYTES)  # the state outweighs 2 fp32 copies
    result = invoke("train", "--model", "llama2-7b", "--strategy", "dp=2,gbs=2", "--nproc", "2", "--seq-len", "64")
    assert_bad_input(result, f"training llama2-7b (6.74B parameters) on 2 rank(s) needs at least {need / 2**30:.1f} GiB",
                     "16.0 GiB is available")


def test_note_lines_are_not_markup(tmp_path: Path) -> None:
    result = invoke(*SIM, "--plan", tmp_path / "[bold]x.json")
    assert "[bold]x.json" in ANSI.sub("", result.stderr)


def test_launcher_summaries() -> None:
    from plait.runtime.launch import Failure, summary

    bad = Failure(1, "data file 'x' does not exist; give a text file", time=2.0)
    assert summary([bad], {1: 2, 0: -15}, 2) == ("data file 'x' does not exist; give a text file", 2)
    waited = [Failure(0, "rank 0 timed out", "timeout", 30.0), Failure(2, "rank 2 timed out", "timeout", 30.0)]
    assert summary(waited, {0: 2}, 4) == ("ranks 1,3 stopped answering: ranks 0,2 waited 30 s for them in a "
                                          "collective; check those processes (stopped, swapped out, deadlocked), or "
                                          "raise --timeout if they are only slow", 2)
    assert summary(waited[:1], {0: 2}, 1)[0].startswith("rank 0 timed out after 30 s waiting in a collective")
    assert summary([], {1: -9}, 2) == ("rank 1 was killed by SIGKILL (the kernel kills a process that runs out of "
                                       "host memory: use a smaller model or fewer ranks)", 2)
    assert summary([], {0: 1}, 2) == ("rank 0 failed with exit code 1; its error is printed above", 1)


@pytest.mark.parametrize("args, needle", [
    (["--gguf", "nope.gguf"], "--gguf names a file in --model-dir"),
    (["--model-dir", "/nonexistent"], "--model-dir '/nonexistent' is not a directory"),
    (["--model-dir", "/tmp", "--gguf", "nope.gguf"], "--gguf 'nope.gguf' is not a file in '/tmp'"),
    (["--budget", "1"], "--budget: Value error, budget must be a fraction below 1"),
    (["--budget", "1.5"], "budget must be a fraction below 1 or a whole number of tokens from 2, got 1.5"),
    (["--budget", "5000", "--context", "2048"], "--budget 5000 keeps all 2048 tokens of the context"),
    (["--text", "/tmp"], "--text '/tmp' is a directory"),
])
def test_kv_eval_refuses_before_loading_a_model(args, needle) -> None:
    assert_bad_input(invoke("kv-eval", *args), needle)
