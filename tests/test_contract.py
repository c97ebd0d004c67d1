"""The planners' contract with the runtime (`plait.planner.contract`): every output of every planner for the
tiny models of every family on 4 ranks is either refused for one of the KNOWN_REFUSED reasons of its shape
class, or trains to the single-process losses (gloo, 4 ranks, one torchrun launch, fp32, 2 steps).

Plans are judged by `plait.executable.unsupported`; variable-length runs and multitask plans by the
runtime's load-time checks (`plait.runtime.varlen.check_config`, `plait.runtime.multitask.check_units`).
`python tests/test_contract.py` prints the sweep and what KNOWN_REFUSED should now say."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from collections import Counter
from dataclasses import asdict, replace
from importlib.resources import files
from pathlib import Path

import pytest
from helpers import ranks_command
from test_runtime import text  # noqa: F401

from plait.errors import PlaitError
from plait.executable import unbuildable
from plait.plan import Plan, uniform_plan
from plait.planner.contract import (MODELS, RANKS, TaskRun, VarlenRun, atoms, emitted, refused_classes,
                                    sample, spec, summary)
from plait.runtime.loop import lr_at
from plait.runtime.multitask import MultitaskConfig, check_units, units_of
from plait.runtime.multitask_model import reference_losses
from plait.runtime.train import TrainConfig
from plait.runtime.varlen import check_config
from plait.spec.cluster import local_ranks

STEPS = 2
LR = 0.01
TOLERANCE = 1e-5
"""Largest relative difference from the single-process loss at any step."""
LENGTHS = str(files("plait") / "data" / "wikipedia-lengths-10k.txt")
"""The document lengths `train --varlen` draws from by default."""

REFUSED_BY_REASON: dict[str, tuple[str, ...]] = {}
"""Refusal class -> the shape classes whose outputs the runtime refuses for it (output counts in comments)."""
KNOWN_REFUSED = frozenset((shape, reason) for reason, shapes in REFUSED_BY_REASON.items() for shape in shapes)
"""Every (shape class, refusal class) the runtime refuses among the planners' outputs
(`plait.planner.contract.refused_classes`); it shrinks as the runtime grows, and a new refusal fails the
test. The counts, one full refusal line of each and this list as it now stands:
`python tests/test_contract.py`."""


def varlen_refusal(run: VarlenRun) -> str | None:
    """Why `plait train --varlen` refuses `run` on `RANKS` ranks (one line), or None."""
    cfg = TrainConfig(model=run.model, plan={}, varlen=run.method, lengths=LENGTHS,
                      global_batch=run.global_batch, capacity=run.capacity, cp_mode=run.cp_mode,
                      varlen_states=run.states, offload_above=run.offload_above)
    try:
        check_config(cfg, spec(run.model), RANKS)
    except PlaitError as exc:
        return str(exc)
    return unbuildable(spec(run.model))


def task_refusal(run: TaskRun) -> str | None:
    """Why `plait train --tasks` refuses the multitask plan `run` on `RANKS` ranks (one line), or None."""
    try:
        check_units(run.plan.tasks, units_of(run.plan), RANKS)
    except PlaitError as exc:
        return str(exc)
    return None


JUDGES = {VarlenRun: varlen_refusal, TaskRun: task_refusal}


@pytest.fixture(scope="module")
def sweep():
    return emitted(JUDGES)


def _difference(refused: set[tuple[str, str]]) -> str:
    gone = sorted(KNOWN_REFUSED - refused)
    new = sorted(refused - KNOWN_REFUSED)
    return "\n".join([f"{len(gone)} KNOWN_REFUSED entries no longer refused (drop them):", *map(repr, gone),
                      f"{len(new)} refusals not in KNOWN_REFUSED:", *map(repr, new)])


def test_refused_classes_are_the_known_ones(sweep) -> None:
    outputs, declined = sweep
    print(summary(outputs, declined))
    refused = set(refused_classes(outputs))
    assert refused == KNOWN_REFUSED, _difference(refused)


def test_every_planner_and_model_family_is_swept(sweep) -> None:
    outputs, declined = sweep
    # `search --lsh` and `baseline dp` price only plans the search prices too (an output keeps its first
    # source): LSH-MoE never pays on 4 ranks of one node for tiny-moe
    assert {e.source for e in outputs} == {"search", "search --host-memory", "baseline zero3", "straggler",
                                           "varlen", "multitask"}
    assert {getattr(e.output, "model", None) for e in outputs} == {*MODELS, None}  # None: the task files
    kinds = {e.parts[0].split()[0] for e in outputs}
    assert kinds == {"gpt", "llama", "llama+moe", "t5", "llava", "llama+window(all)", "llama+window(some)",
                     "multitask"}, kinds
    # what the planners themselves decline: straggler planning of mixed stacks, varlen of non-decoders
    assert sorted((d.source, d.model) for d in declined) == sorted(
        [("straggler", m) for m in MODELS[2:]] + [("varlen", "tiny-t5"), ("varlen", "tiny-llava")])
    features = {p for e in outputs for p in e.parts[1:]}
    for wanted in ("vpp2", "2 pipelines", "mixed", "tied apart", "zero", "tp", "sp", "cp", "ep", "etp",
                   "swap", "offload=params", "uneven widths"):
        assert wanted in features, wanted


def test_the_sweep_holds_stages_of_different_widths(sweep) -> None:
    """The straggler planner's shrunk tensor-parallel units beside whole ones give pipelines whose stages
    differ in width: such plans are in the sweep, all from the straggler planner, none refused, and the
    training sample runs some."""
    outputs, _ = sweep
    uneven = [e for e in outputs if isinstance(e.output, Plan) and not all(p.even_widths for p in e.plan.pipelines)]
    assert uneven and {e.source for e in uneven} == {"straggler"}
    assert all(e.refusal is None for e in uneven)
    assert any("uneven widths" in e.parts for e in sample(outputs))


def _job(tmp: Path, nproc: int, configs: dict[str, TrainConfig | MultitaskConfig]
         ) -> tuple[subprocess.CompletedProcess, dict[str, list[dict]]]:
    """Run every config one after the other in ONE torchrun job of `nproc` ranks; each finished config's
    metrics records."""
    paths, outs = [], {}
    for i, (key, cfg) in enumerate(configs.items()):
        outs[key] = tmp / f"metrics-{i}.jsonl"
        paths.append(tmp / f"config-{i}.json")
        paths[-1].write_text(replace(cfg, metrics_out=str(outs[key])).to_json())
    cmd = ranks_command(nproc, "-m", "plait.runtime.worker", *map(str, paths))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, {key: [json.loads(line) for line in out.read_text().splitlines()]
                  for key, out in outs.items() if out.exists()}


def _plan_config(plan: Plan, data: Path) -> TrainConfig:
    return TrainConfig(model=plan.model, plan=json.loads(plan.model_dump_json()), steps=STEPS, lr=LR,
                       data=str(data))


def _varlen_config(run: VarlenRun, data: Path, world: int) -> TrainConfig:
    """`run` on `world` ranks; on one rank FlexSP holding the longest document (the reference)."""
    one = world == 1
    return TrainConfig(model=run.model, plan={}, steps=STEPS, lr=LR, data=str(data),
                       varlen="flexsp" if one else run.method, lengths=LENGTHS, global_batch=run.global_batch,
                       capacity=spec(run.model).max_seq_len if one else run.capacity, cp_mode=run.cp_mode,
                       varlen_states=run.states, offload_above=run.offload_above)


def _task_config(run: TaskRun) -> MultitaskConfig:
    return MultitaskConfig(tasks=str(run.tasks), units=[{**asdict(u), "ranks": list(u.ranks)}
                                                        for u in units_of(run.plan)], steps=STEPS, lr=LR)


def _reference_key(e) -> str:
    out = e.output
    if isinstance(out, Plan):
        return f"plan {out.model} {out.global_batch}"
    return f"varlen {out.model} {out.global_batch}"


@pytest.fixture(scope="module")
def contract_runs(tmp_path_factory, text, sweep):  # noqa: F811
    """The single-process references (one job), then every sampled output in one torchrun job of 4 ranks."""
    chosen = sample(sweep[0])
    refs: dict[str, TrainConfig] = {}
    for e in chosen:
        if isinstance(e.output, Plan):
            m = spec(e.output.model)
            refs[_reference_key(e)] = _plan_config(
                uniform_plan(f"dp=1,gbs={e.output.global_batch}", m, local_ranks(1), e.output.seq_len), text)
        elif isinstance(e.output, VarlenRun):
            refs[_reference_key(e)] = _varlen_config(e.output, text, 1)
    ref_proc, ref = _job(tmp_path_factory.mktemp("reference"), 1, refs)
    assert set(ref) == set(refs) and all(len(r) == STEPS for r in ref.values()), ref_proc.stderr[-3000:]
    cases: dict[str, TrainConfig | MultitaskConfig] = {}
    for i, e in enumerate(chosen):
        out = e.output
        cases[f"case {i}"] = _plan_config(out, text) if isinstance(out, Plan) else \
            _varlen_config(out, text, RANKS) if isinstance(out, VarlenRun) else _task_config(out)
    t0 = time.perf_counter()
    proc, losses = _job(tmp_path_factory.mktemp("contract"), RANKS, cases)
    print(f"{len(cases)} outputs trained in one {RANKS}-rank launch of {time.perf_counter() - t0:.0f} s")
    return chosen, ref, cases, proc, losses


def test_sampled_outputs_match_single_process(contract_runs) -> None:
    chosen, ref, cases, proc, records = contract_runs
    assert len(records) == len(chosen), proc.stderr[-3000:]
    worst = {}
    for i, e in enumerate(chosen):
        got = records[f"case {i}"]
        assert len(got) == STEPS, proc.stderr[-3000:]
        if isinstance(e.output, TaskRun):
            cfg = cases[f"case {i}"]
            want = reference_losses(e.output.plan.tasks, STEPS, cfg.seed, lambda step, c=cfg: lr_at(step, c))
            tasks = e.output.plan.tasks.tasks
            pairs = [(r["losses"][t.name], w) for r, ws in zip(got, want) for t, w in zip(tasks, ws)]
        else:
            pairs = [(r["loss"], w["loss"]) for r, w in zip(got, ref[_reference_key(e)])]
        worst[i] = max(abs(a - b) / abs(b) for a, b in pairs)
    bad = {i: (chosen[i].source, chosen[i].shape, w) for i, w in worst.items() if w > TOLERANCE}
    assert not bad, bad
    print(f"{len(chosen)} outputs, worst relative loss difference {max(worst.values()):.2e}")


def test_the_sample_exercises_every_atom_of_what_runs(sweep) -> None:
    runs = [e for e in sweep[0] if e.refusal is None]
    chosen = sample(sweep[0])
    assert set().union(*map(atoms, chosen)) == set().union(*map(atoms, runs))
    assert {type(e.output) for e in chosen} == {Plan, VarlenRun, TaskRun}


def main() -> None:
    """Print the sweep, what changed against KNOWN_REFUSED, and the list as it now stands."""
    outputs, declined = emitted(JUDGES)
    print(summary(outputs, declined))
    refused = refused_classes(outputs)
    print(_difference(set(refused)))
    print("REFUSED_BY_REASON as it now stands:\n" + known_literal(refused))


def known_literal(refused: Counter[tuple[str, str]]) -> str:
    """`REFUSED_BY_REASON` for `refused` as Python source (shape classes with their output counts)."""
    by_reason: dict[str, list[str]] = {}
    for shape, reason in sorted(refused):
        by_reason.setdefault(reason, []).append(shape)
    lines = ["REFUSED_BY_REASON: dict[str, tuple[str, ...]] = {"]
    for reason, shapes in sorted(by_reason.items()):
        pieces = textwrap.wrap(reason, 96, drop_whitespace=False)
        lines += [f"    {json.dumps(piece)}" for piece in pieces]
        lines[-1] += ": ("
        lines += [f"        {json.dumps(shape)},  # {refused[shape, reason]}" for shape in shapes]
        lines.append("    ),")
    return "\n".join(lines + ["}"])


if __name__ == "__main__":
    main()
