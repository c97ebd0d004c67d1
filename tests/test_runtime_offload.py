"""Optimizer offload as the runtime executes it (`plait.runtime.offload`): AdamW on the CPU over master copies
(offload=optim), its states in files (offload=nvme), parameter paging (offload=params) on one replica, with
any ZeRO stage, context parallelism, a per-layer mix and MoE layers (paged too); every plan trains to the single-process
losses (gloo, fp32, one torchrun job per width)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_runtime import SEQ, assert_same, text, train_together  # noqa: F401

from plait.executable import unsupported
from plait.plan import Pipeline, Plan, Stage, Strategy, uniform_plan
from plait.runtime.offload import HostAdamW, step_metrics
from plait.runtime.optim import ADAM_BETAS, WEIGHT_DECAY
from plait.spec.cluster import local_ranks
from plait.spec.model import PRESETS

GBS = 4
STEPS = 3
FP32 = 4  # bytes per fp32 element


def _plan(text_: str, nproc: int, model: str = "tiny-llama") -> Plan:
    return uniform_plan(f"{text_},gbs={GBS},precision=fp32", PRESETS[model], local_ranks(nproc), SEQ)


def _mix() -> Plan:
    """Two ranks, ZeRO-1 over both, each layer offloaded differently: optim, none, params, nvme."""
    stage = Stage(layers=(0, 4), ranks=(0, 1), strategies=tuple(
        Strategy(dp=2, zero=1, offload=o) for o in ("optim", "none", "params", "nvme")))  # type: ignore[arg-type]
    return Plan(model="tiny-llama", seq_len=SEQ, global_batch=GBS, precision="fp32",
                pipelines=(Pipeline(stages=(stage,), micro_batches=1, micro_batch_sequences=GBS),))


def _two_pipelines() -> Plan:
    """Two one-rank pipelines whose ZeRO-1 splits each layer's optimizer state between them
    (`plait.runtime.replica_zero`), every layer offloaded: each rank steps its slice on the host."""
    pipes = tuple(Pipeline(stages=(Stage(layers=(0, 4), ranks=(r,), strategies=(Strategy(zero=1, offload="optim"),)),),
                           micro_batches=1, micro_batch_sequences=GBS // 2) for r in (0, 1))
    return Plan(model="tiny-llama", seq_len=SEQ, global_batch=GBS, precision="fp32", pipelines=pipes)


ONE_RANK = {"dp1 offload=optim": _plan("dp=1,offload=optim", 1), "dp1 offload=params": _plan("dp=1,offload=params", 1),
            "dp1 offload=nvme": _plan("dp=1,offload=nvme", 1),
            "tiny-moe dp1 offload=params": _plan("dp=1,offload=params", 1, "tiny-moe")}
TWO_RANKS = {
    "dp2 zero0 optim": _plan("dp=2,offload=optim", 2),
    "dp2 zero2 optim": _plan("dp=2,zero=2,mbs=1,offload=optim", 2),
    "dp2 zero3 optim": _plan("dp=2,zero=3,offload=optim", 2),
    "dp2 zero3 nvme": _plan("dp=2,zero=3,offload=nvme", 2),
    "cp2 zero1 optim": _plan("cp=2,zero=1,offload=optim", 2),
    "cp2 zero3 params": _plan("cp=2,zero=3,offload=params", 2),
    "per-layer mix": _mix(),
    "two pipelines, zero1 across them, optim": _two_pipelines(),
    "tiny-moe dp2 ep2 zero1 optim": _plan("dp=2,ep=2,zero=1,offload=optim", 2, "tiny-moe"),
    "tiny-moe dp2 zero0 optim": _plan("dp=2,offload=optim", 2, "tiny-moe"),
    "tiny-moe dp2 ep2 zero1 params": _plan("dp=2,ep=2,zero=1,offload=params", 2, "tiny-moe"),
    "tiny-moe dp2 zero3 nvme": _plan("dp=2,zero=3,offload=nvme", 2, "tiny-moe"),
    "tiny-moe tp2+sp ep2 etp1 zero0 params": _plan("tp=2,sp=1,ep=2,etp=1,offload=params", 2, "tiny-moe"),
}
NVME = ("dp1 offload=nvme", "dp2 zero3 nvme")
SAVE, RESUME = "saved under dp2 zero3 nvme", "resumed under dp2 zero1 optim"
SAVED_STEPS = 1  # the last resumed loss follows a step on the loaded moments
CHECKPOINTED = {SAVE: TWO_RANKS["dp2 zero3 nvme"], RESUME: _plan("dp=2,zero=1,offload=optim", 2)}


def test_host_adamw_steps_exactly_like_adamw_and_counts_its_bytes(tmp_path: Path) -> None:
    """The CPU step over master copies (host memory or files) gives AdamW's parameters bit for bit; the
    meter counts the hosted shard's bytes: its gradient out and its update back, and under nvme the four
    fp32 rows (master, gradient, two moments) read and written around each step, the gradient written once
    more after backward."""
    results = {}
    for mode in (None, "optim", "nvme"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        hosted = {} if mode is None else {id(p): mode for p in model[0].parameters()}
        opt = HostAdamW(model.parameters(), hosted, tmp_path / str(mode), lr=1e-2, betas=ADAM_BETAS,
                        weight_decay=WEIGHT_DECAY)
        x = torch.randn(5, 8)
        for step in range(3):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            metrics = step_metrics([opt])
        results[mode] = [p.detach().clone() for p in model.parameters()], metrics
    n = 8 * 16 + 16  # the hosted layer's parameters
    assert results[None][1] is None
    assert results["optim"][1] == {"to_host": n * FP32, "to_device": n * FP32, "nvme_read": 0.0, "nvme_written": 0.0}
    assert results["nvme"][1] == {"to_host": n * FP32, "to_device": n * FP32, "nvme_read": 4 * n * FP32,
                                  "nvme_written": 5 * n * FP32}
    assert sorted(f.name for f in (tmp_path / "nvme").iterdir()) == ["state-0.npy", "state-1.npy"]
    for mode in ("optim", "nvme"):
        assert all(torch.equal(a, b) for a, b in zip(results[None][0], results[mode][0])), mode


def test_host_adamw_state_round_trips_through_a_state_dict(tmp_path: Path) -> None:
    """A checkpoint saves the hosted moments by parameter (as AdamW's) and loading them puts them back in
    the state files; the next steps equal an uninterrupted run."""
    def make(where: str):  # noqa: ANN202
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        return model, HostAdamW(model.parameters(), {id(model.weight): "nvme"}, tmp_path / where, lr=1e-2)

    x = torch.randn(4, 6)
    model, opt = make("a")
    for _ in range(4):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    other, resumed = make("b")
    for _ in range(2):
        other(x).sum().backward()
        resumed.step()
        resumed.zero_grad()
    half, half_opt = make("c")
    for _ in range(2):
        half(x).sum().backward()
        half_opt.step()
        half_opt.zero_grad()
    other.load_state_dict(half.state_dict())
    resumed.load_state_dict(half_opt.state_dict())
    for _ in range(2):
        other(x).sum().backward()
        resumed.step()
        resumed.zero_grad()
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


def test_the_runtime_accepts_every_offload_the_planner_emits() -> None:
    for name, plan in (ONE_RANK | TWO_RANKS).items():
        assert unsupported(plan, PRESETS[plan.model]) is None, name
    for text_, model, needle in (("dp=2,offload=params", "tiny-llama", "use zero >= 1 or offload=optim"),
                                 ("dp=2,ep=2,offload=nvme", "tiny-moe", "use zero >= 1 or offload=optim")):
        reason = unsupported(_plan(text_, 2, model), PRESETS[model])
        assert reason is not None and needle in reason and "\n" not in reason, reason


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> dict:  # noqa: F811
    """The single-process references and the one-rank cases in one job, the two-rank cases in another."""
    nvme = tmp_path_factory.mktemp("nvme")
    options = {k: {"steps": STEPS} for k in ("tiny-llama", "tiny-moe", *ONE_RANK, *TWO_RANKS)}
    for k in NVME:
        options[k]["nvme_dir"] = str(nvme / k.replace(" ", "-").replace("=", "-"))
    ones = {"tiny-llama": ("tiny-llama", f"dp=1,gbs={GBS}"), "tiny-moe": ("tiny-moe", f"dp=1,gbs={GBS}")} | \
        {k: (p.model, p) for k, p in ONE_RANK.items()}
    ckpt = str(tmp_path_factory.mktemp("checkpoint"))
    options |= {SAVE: {"steps": SAVED_STEPS, "checkpoint_dir": ckpt}, RESUME: {"steps": STEPS, "checkpoint_dir": ckpt}}
    one = train_together(tmp_path_factory.mktemp("one"), text, 1, ones, options)
    two = train_together(tmp_path_factory.mktemp("two"), text, 2,
                         {k: (p.model, p) for k, p in (TWO_RANKS | CHECKPOINTED).items()}, options)
    return {"one": one, "two": two, "nvme": nvme}


@pytest.mark.parametrize("name", list(ONE_RANK) + list(TWO_RANKS))
def test_offloaded_plans_match_single_process(runs, name) -> None:
    job = runs["one" if name in ONE_RANK else "two"]
    proc, losses = job
    assert name in losses and len(losses[name]) == STEPS, proc.stderr[-3000:]
    model = (ONE_RANK | TWO_RANKS)[name].model
    assert_same(losses[name], runs["one"][1][model])


@pytest.mark.parametrize("name", NVME)
def test_nvme_states_go_through_files(runs, name) -> None:
    """Each step reads and writes this rank's hosted state files (four fp32 rows per parameter shard), which
    lie under --nvme-dir/rank-R/chunk-C."""
    proc, _ = runs["one" if name in ONE_RANK else "two"]
    moved = proc.first_records[name]["offload"]
    folder = runs["nvme"] / name.replace(" ", "-").replace("=", "-") / "rank-0" / "chunk-0"
    files = sum(f.stat().st_size for f in folder.iterdir())
    header = 128 * len(list(folder.iterdir()))  # each .npy file's header
    assert moved["nvme_read"] == files - header
    assert moved["nvme_written"] == pytest.approx(moved["nvme_read"] * 5 / 4)
    assert moved["to_host"] == moved["to_device"] == moved["nvme_read"] / 4


def test_checkpoint_of_offloaded_states_resumes_under_another_offload(runs) -> None:
    """Hosted optimizer states are saved by parameter name and shard (as AdamW's): a run saved under ZeRO-3
    with NVMe state files resumes under ZeRO-1 with host-memory states to the single-process losses."""
    proc, losses = runs["two"]
    saved, resumed = losses.get(SAVE), losses.get(RESUME)
    assert saved is not None and len(saved) == SAVED_STEPS, proc.stderr[-3000:]
    assert resumed is not None and len(resumed) == STEPS - SAVED_STEPS, proc.stderr[-3000:]
    assert_same(saved + resumed, runs["one"][1]["tiny-llama"])


def test_train_cli_keeps_nvme_states_under_nvme_dir(tmp_path: Path) -> None:
    """`plait train --nvme-dir D` puts rank 0's state files under D/rank-0/chunk-0 and reports the bytes per
    step; a --nvme-dir that is a file is refused in one line (exit 2) before anything runs."""
    import json
    import os
    import subprocess
    import sys

    out, nvme = tmp_path / "m.jsonl", tmp_path / "nvme"
    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", "tiny-llama", "--strategy", "dp=1,gbs=2,offload=nvme",
           "--nproc", "1", "--steps", "2", "--seq-len", "32", "--metrics-out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "--nvme-dir", str(nvme)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    files = list((nvme / "rank-0" / "chunk-0").iterdir())
    params = sum(p.numel() for p in _tiny_llama().parameters())
    assert len(files) == len(list(_tiny_llama().parameters()))
    assert [r["offload"]["nvme_read"] for r in records] == [4 * params * FP32] * 2  # every parameter hosted
    blocker = tmp_path / "file"
    blocker.write_text("")
    bad = subprocess.run([*cmd, "--nvme-dir", str(blocker / "d")], capture_output=True, text=True, timeout=600, env=env)
    assert bad.returncode == 2 and "--nvme-dir" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def _tiny_llama() -> torch.nn.Module:
    from plait.models import build_model

    return build_model(PRESETS["tiny-llama"])


def test_step_hooks_run_once_per_step() -> None:
    """Step hooks (ZeRO across pipelines loads and gathers its slices in them) run once around the hosted
    step, not again around AdamW's resident one."""
    model = torch.nn.Linear(3, 2)
    torch.optim.AdamW(model.parameters())  # torch has wrapped AdamW.step with the hooks
    calls: list[str] = []
    opt = HostAdamW(model.parameters(), {id(model.weight): "optim"}, lr=0.1)
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert calls == ["pre", "post"]
