"""The one training loop (`plait.runtime.loop.train_loop`) with a stand-in stepper: hook order, the
learning rate each step sees, checkpoints on schedule, and a resumed run's metrics file."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from helpers import run_workers
from plait.runtime.loop import lr_at, train_loop
from plait.runtime.train import TrainConfig


class Recorder:
    """A stepper that trains nothing and writes down what the loop asked of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def before_step(self, step: int) -> None:
        self.calls.append(f"before {step}")

    def train_step(self, step: int, t0: float) -> dict:
        lr = self.optimizer.param_groups[0]["lr"]
        self.calls.append(f"train {step} lr={lr:.4f}")
        return {"step": step, "loss": float(step), "lr": lr}

    def after_step(self, step: int, record: dict) -> None:
        record["switched"] = step == 2
        self.calls.append(f"after {step}")

    def save(self, done: int) -> None:
        self.calls.append(f"save {done}")

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_steps_hooks_learning_rate_checkpoints_and_resumed_metrics(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(4)))  # an earlier run
    cfg = TrainConfig(model="tiny-llama", plan={}, steps=5, lr=1.0, warmup=2, checkpoint_dir=str(tmp_path / "c"),
                      checkpoint_every=2, metrics_out=str(metrics))
    reported: list[int] = []
    stepper = Recorder()
    out = train_loop(cfg, stepper, start=1, report=lambda r: reported.append(r["step"]))
    lrs = [lr_at(s, cfg) for s in range(5)]
    assert lrs[1] == 1.0 and lrs[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 3)))
    assert stepper.calls == [
        "before 1", f"train 1 lr={lrs[1]:.4f}", "after 1", "save 2",  # saved after 2 steps done
        "before 2", f"train 2 lr={lrs[2]:.4f}", "after 2",
        "before 3", f"train 3 lr={lrs[3]:.4f}", "after 3", "save 4",
        "before 4", f"train 4 lr={lrs[4]:.4f}", "after 4", "save 5", "close"]  # and after the last
    assert [r["step"] for r in out] == reported == [1, 2, 3, 4]
    assert [r["switched"] for r in out] == [False, True, False, False]  # after_step's additions are published
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(0, 9.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]


def test_variable_length_runs_resume_through_the_same_loop(tmp_path) -> None:
    """--varlen flexsp on 2 ranks: 4 steps straight, and 2 steps then 2 more resumed from the step-2
    checkpoint, in one torchrun job: the resumed steps train the documents of the uninterrupted run to its
    losses."""
    from importlib.resources import files

    lengths = str(files("plait") / "data" / "wikipedia-lengths-10k.txt")
    base = {"model": "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=300,seq=512", "plan": {},
            "lr": 0.01, "varlen": "flexsp", "lengths": lengths, "global_batch": 8, "capacity": 256}
    runs = {"whole": {"steps": 4, "checkpoint_dir": str(tmp_path / "a")},
            "first": {"steps": 2, "checkpoint_dir": str(tmp_path / "b")},
            "resumed": {"steps": 4, "checkpoint_dir": str(tmp_path / "b")}}
    paths = []
    for name, options in runs.items():
        cfg = TrainConfig(**{**base, "metrics_out": str(tmp_path / f"{name}.jsonl"), **options})
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(cfg.to_json())
    run_workers(paths)
    whole, first, second = ([json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
                            for name in runs)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step-4"]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-2", "step-4"]
    assert [r["step"] for r in first] == [0, 1] and [r["step"] for r in second] == [2, 3]  # resumed at step 2
    resumed = first + second
    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in whole]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], rel=1e-6, abs=0)
