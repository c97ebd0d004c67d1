"""Run under torchrun: plan switches over the network (`plait.runtime.migrate`) against DCP switches.

    torchrun --nproc-per-node=4 tests/switch_check.py OUT.json switch TEXT
    torchrun --nproc-per-node=1 tests/switch_check.py OUT.json reference TEXT

`switch` (4 ranks), for each case (a plan before and after): after one AdamW step, the state moved over the
network and the state saved and loaded with DCP, every entry on every rank compared exactly; then training
runs that switch plans after step `SWITCH_AFTER` either way, their losses, and how often DCP saved or loaded
during the network runs. `reference` (1 rank): each model's losses in one process. Training reads the text
file TEXT. Rank 0 writes JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from plait.plan import Pipeline, Plan, Stage, Strategy, uniform_plan
from plait.runtime import checkpoint, migrate, replica_zero, stragglers
from plait.runtime.train import TrainConfig, apply_plan, init_distributed, run
from plait.spec.cluster import local_ranks
from plait.spec.model import load_model

SEQ = 64
STEPS = 4
SWITCH_AFTER = 1  # the switch happens after this step (0-based)
GBS = 8


def _uniform(model: str, text: str, ranks: int = 4) -> Plan:
    return uniform_plan(f"{text},gbs={GBS},precision=fp32", load_model(model), local_ranks(ranks), SEQ)


def _straggler_plan(model: str) -> Plan:
    """What the straggler planner makes of a slow rank 3: two pipelines cut 1|3 and 3|1, micro-batches 6 and 2."""
    pipes = [([((0, 1), (0,)), ((1, 4), (1,))], 6), ([((0, 3), (2,)), ((3, 4), (3,))], 2)]
    return Plan(model=model, seq_len=SEQ, global_batch=GBS, precision="fp32", pipelines=tuple(
        Pipeline(stages=tuple(Stage(layers=lay, ranks=r, strategies=(Strategy(),)) for lay, r in stages),
                 micro_batches=m, micro_batch_sequences=1) for stages, m in pipes))


def _leaving_out_rank_3(model: str) -> Plan:
    """Three one-rank pipelines on ranks 0-2 (rank 3 left out), micro-batches 3, 3 and 2."""
    return Plan(model=model, seq_len=SEQ, global_batch=GBS, precision="fp32", pipelines=tuple(
        Pipeline(stages=(Stage(layers=(0, 4), ranks=(r,), strategies=(Strategy(),)),), micro_batches=m,
                 micro_batch_sequences=1) for r, m in ((0, 3), (1, 3), (2, 2))))


def _zero_across_pipelines(model: str) -> Plan:
    """ZeRO-1 across a one-rank pipeline (rank 0) and a pp2 one (ranks 1, 2), rank 3 left out: every holder
    of a layer keeps half of its AdamW moments (`plait.runtime.replica_zero`)."""
    pipes = [([((0, 4), (0,))], 4), ([((0, 2), (1,)), ((2, 4), (2,))], 4)]
    return Plan(model=model, seq_len=SEQ, global_batch=GBS, precision="fp32", pipelines=tuple(
        Pipeline(stages=tuple(Stage(layers=lay, ranks=r, strategies=(Strategy(zero=1),)) for lay, r in stages),
                 micro_batches=m, micro_batch_sequences=1) for stages, m in pipes))


def _zero_across_three(model: str) -> Plan:
    """ZeRO-1 across three one-rank pipelines on ranks 1-3 (micro-batches 3, 3 and 2), rank 0 left out: each
    holder keeps a third of the AdamW moments."""
    return Plan(model=model, seq_len=SEQ, global_batch=GBS, precision="fp32", pipelines=tuple(
        Pipeline(stages=(Stage(layers=(0, 4), ranks=(r,), strategies=(Strategy(zero=1),)),), micro_batches=m,
                 micro_batch_sequences=1) for r, m in ((1, 3), (2, 3), (3, 2))))


def cases() -> dict[str, tuple[str, Plan, Plan]]:
    return {
        "pp2xdp2 -> tp2xdp2": ("tiny-llama", _uniform("tiny-llama", "pp=2,dp=2,mbs=1"),
                               _uniform("tiny-llama", "tp=2,dp=2")),
        "dp4 zero3 -> pp2 tp2": ("tiny-llama", _uniform("tiny-llama", "dp=4,zero=3"),
                                 _uniform("tiny-llama", "pp=2,tp=2,mbs=1")),
        "pp2xdp2 -> straggler re-plan (uneven layers, tied head split)": (
            "tiny-gpt", _uniform("tiny-gpt", "pp=2,dp=2,mbs=1"), _straggler_plan("tiny-gpt")),
        "rank 3 left out -> dp4 zero1 (recovered)": ("tiny-llama", _leaving_out_rank_3("tiny-llama"),
                                                     _uniform("tiny-llama", "dp=4,zero=1")),
        "ZeRO across pipelines: halves of the moments on ranks 0-2 -> thirds on ranks 1-3": (
            "tiny-llama", _zero_across_pipelines("tiny-llama"), _zero_across_three("tiny-llama")),
    }


def _config(model: str, plan: Plan, **extra) -> TrainConfig:
    return TrainConfig(model=model, plan=json.loads(plan.model_dump_json()), steps=STEPS, lr=0.01, data=DATA[0],
                       **extra)


DATA: list[str | None] = [None]  # the text file training reads (argv)


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def compare_state(model: str, before: Plan, after: Plan, directory: Path) -> dict:
    """One AdamW step under `before` (gradients: half the weights), then `after` filled over the network and
    from DCP; this rank's entries that differ, the entries compared and the model keys held."""
    spec = load_model(model)
    cfg = _config(model, before)
    old = apply_plan(cfg, spec, before, hand_sync=True)
    for p in old.params:
        p.grad = p.detach() * 0.5
    for optimizer in old.optimizers:
        optimizer.step()
    net = apply_plan(cfg, spec, after, hand_sync=True)
    sent = migrate.move(old.chunks, old.optimizers, net.chunks, net.optimizers)
    ref = apply_plan(cfg, spec, after, hand_sync=True)
    checkpoint.load(checkpoint.save(directory, 1, old.chunks, old.optimizers), ref.chunks, ref.optimizers)
    got, _ = checkpoint.local_state(net.chunks, net.optimizers)
    want, _ = checkpoint.local_state(ref.chunks, ref.optimizers)
    unequal, compared = [], 0
    for top in ("model", "optim"):
        assert got[top].keys() == want[top].keys()
        for key, value in want[top].items():
            compared += 1
            same = torch.equal(_local(got[top][key]), _local(value)) if isinstance(value, torch.Tensor) \
                else got[top][key] == value
            if not same:
                unequal.append(f"{top}.{key}")
    sliced = [sum(len(getattr(o, replica_zero.SHARDS, [])) for o in placed.optimizers) for placed in (old, net)]
    return {"unequal": unequal, "compared": compared, "model_keys": sorted(got["model"]), "sent": sent,
            "sliced_groups": sliced,  # before and after: groups of ZeRO across pipelines
            "optim_steps": sorted({float(_local(v)) for k, v in got["optim"].items() if k.endswith(".step")})}


def forced_switch(after: Plan):
    """`Adaptive.after_step` that also switches to `after` after step `SWITCH_AFTER` (every rank)."""
    original = stragglers.Adaptive.after_step

    def after_step(self, step, placed, record):
        original(self, step, placed, record)
        if step != SWITCH_AFTER:
            return None
        record["switch"] = {"to": "forced", "via": self.cfg.switch_via}
        return after
    return after_step


def counting(calls: dict[str, int], name: str, fn):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper


def main(out: str, mode: str, data: str) -> None:
    DATA[0] = data
    init_distributed(300.0)
    rank = dist.get_rank()
    result: dict = {}
    if mode == "reference":
        for model in ("tiny-llama", "tiny-gpt"):
            result[model] = [r["loss"] for r in run(_config(model, _uniform(model, "dp=1", ranks=1)))]
    else:
        box = [tempfile.mkdtemp(prefix="switch-check-") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        scratch = Path(box[0])
        tempfile.tempdir = str(scratch / "tmp")  # where a DCP switch would make its directory
        (scratch / "tmp").mkdir(exist_ok=True)
        calls = {"save": 0, "load": 0}
        dcp.save, dcp.load = counting(calls, "save", dcp.save), counting(calls, "load", dcp.load)
        original = stragglers.Adaptive.after_step
        for name, (model, before, after) in cases().items():
            entry = {"state": compare_state(model, before, after, scratch / name.replace(" ", "_"))}
            states: list[dict | None] = [None] * dist.get_world_size()
            dist.all_gather_object(states, entry["state"])
            entry["state"] = states
            stragglers.Adaptive.after_step = forced_switch(after)
            for via in ("network", "dcp"):
                dist.barrier()
                calls.update(save=0, load=0)
                records = run(_config(model, before, inject_slow="0:1@0", switch_via=via))
                entry[via] = {"losses": [r["loss"] for r in records], "dcp_calls": dict(calls),
                              "switches": [r["switch"] for r in records if "switch" in r],
                              "switch_dirs": sorted(p.name for p in (scratch / "tmp").glob("plait-switch-*"))}
            stragglers.Adaptive.after_step = original
            result[name] = entry
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
