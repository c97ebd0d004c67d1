"""Spindle's multi-task planner: task files, the continuous allocator, the wavefront scheduler, the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plait.cli import app
from plait.errors import PlaitError
from plait.planner.multitask.allocator import Amdahl, allocate, optimus, split
from plait.planner.multitask.graph import build_graph
from plait.planner.multitask.placement import Slot, map_devices, move_score
from plait.planner.multitask.plan import plan_multitask, proportional_counts
from plait.cost.memory import model_state_bytes
from plait.plan import Strategy
from plait.planner.multitask.scalability import Curve, Pricing, layer_seconds, projection_cost
from plait.planner.multitask.schedule import wavefront
from plait.planner.space import divisors
from plait.spec.cluster import load_cluster
from plait.spec.tasks import load_tasks, parse_tasks

EXAMPLE = Path(__file__).resolve().parents[1] / "src/plait/data/imagebind-tasks.yaml"


@pytest.mark.parametrize("ops,serial,devices", [(4, 0.1, 8), (7, 0.25, 64), (3, 0.0, 5)])
def test_bisection_matches_amdahl_closed_form_for_equal_ops(ops: int, serial: float, devices: int) -> None:
    work = 2.5
    got = allocate([Amdahl(work, serial, devices)] * ops, devices).makespan_s
    exact = work * (serial + ops * (1 - serial) / devices)  # each op on devices/ops
    assert abs(got - exact) <= 1e-6 * exact


def test_bisection_matches_closed_form_for_perfectly_parallel_work() -> None:
    rng = random.Random(1)
    works = [rng.uniform(0.1, 5.0) for _ in range(9)]
    got = allocate([Amdahl(w, 0.0, 64) for w in works], 64).makespan_s
    assert abs(got - sum(works) / 64) <= 1e-6 * got


def test_split_keeps_the_layers_and_brackets_the_count() -> None:
    curve = Curve.amdahl(1.0, 0.1, [1, 2, 4, 8])
    parts = split(curve, 20, 3.0, 20 * curve.layer_s[1])
    assert sum(p.layers for p in parts) == 20 and {p.devices for p in parts} <= {2, 4}


def test_four_equal_ops_on_eight_devices_beat_running_them_in_turn() -> None:
    curve = Curve.amdahl(1.0, 0.1, range(1, 9))
    s = wavefront([10] * 4, [], [curve] * 4, 8, 8)
    assert s.makespan_s / (4 * curve.seconds(8, 10)) <= 0.70


def _random_dag(seed: int, devices: int, dense: bool) -> tuple[list[int], list[tuple[int, int]], list[Curve]]:
    rng = random.Random(seed)
    k = rng.randint(2, 12)
    counts = range(1, devices + 1) if dense else divisors(devices)
    curves = [Curve.amdahl(rng.uniform(0.1, 2.0), rng.uniform(0.0, 0.3), counts) for _ in range(k)]
    layers = [rng.randint(8, 32) for _ in range(k)]
    edges = [(a, b) for b in range(k) for a in range(b) if rng.random() < 0.25]
    return layers, edges, curves


@pytest.mark.parametrize("devices", [8, 32, 64])
@pytest.mark.parametrize("dense", [True, False])
def test_random_dags_stay_within_15_percent_of_the_continuous_optima(devices: int, dense: bool) -> None:
    for seed in range(40):
        layers, edges, curves = _random_dag(seed, devices, dense)
        s = wavefront(layers, edges, curves, devices, 8)
        assert s.makespan_s <= 1.15 * s.bound_s, seed
        for stage in s.stages:
            assert sum(p.devices for p in stage.placements) <= devices
        run = {i: 0 for i in range(len(layers))}
        for stage in s.stages:
            for p in stage.placements:
                run[p.op] += p.layers
        assert list(run.values()) == layers


def test_device_mapping_keeps_a_continuing_op_in_place() -> None:
    previous = [(5, 0, 4), (6, 4, 4)]
    groups = map_devices([Slot(6, 4), Slot(7, 4)], previous, 8, 8)
    assert (6, 4, 4) in groups and move_score(previous, groups, 8) < 0


def test_task_level_allocator_feeds_the_slowest_task() -> None:
    times = [lambda n: 8.0 / n, lambda n: 2.0 / n]
    assert optimus(times, 10) == (8, 2)
    assert proportional_counts([3.0, 1.0], 8) == (6, 2)


@pytest.mark.parametrize("cluster", ["4x8xA100-80GB", "8x8xA100-80GB"])
def test_example_task_file_plans_and_beats_both_baselines(cluster: str) -> None:
    tasks = load_tasks(EXAMPLE)
    plan = plan_multitask(tasks, load_cluster(cluster))
    assert len(tasks.tasks) == 5 and tasks.users("vision") == tuple(t.name for t in tasks.tasks)
    assert plan.schedule.makespan_s <= min(plan.sequential_s, plan.proportional.makespan_s,
                                           plan.task_level.makespan_s)
    assert plan.schedule.makespan_s <= 1.15 * plan.schedule.bound_s


def test_graph_contracts_chains_and_follows_module_inputs() -> None:
    tasks = parse_tasks({"modules": {"img": {"tower": "tiny-vit", "project_to": 128}, "lm": {"model": "tiny-llama"}},
                         "tasks": [{"name": "cap", "batch": 8, "seq_len": 64, "modules": {"img": [], "lm": ["img"]}}]})
    g = build_graph(tasks)
    assert [(op.block.kind, op.layers) for op in g.ops] == [("patch_embed", 1), ("vision", 2), ("projector", 1),
                                                            ("decoder", 4)]
    assert g.predecessors(3) == (2,) and g.predecessors(1) == (0,)


def test_a_module_of_another_width_prices_its_input_projection() -> None:
    tasks = load_tasks(Path(__file__).resolve().parent / "data/widths-tasks.yaml")
    ops = {op.name: op for op in build_graph(tasks).ops}
    projected = [(name, op.project_from) for name, op in ops.items() if op.project_from]
    assert projected == [("caption/trunk", (32,))]
    cap, chat = ops["caption/trunk"], ops["chat/trunk"]  # the same trunk layers, on 8 x 32 tokens each
    assert cap.flops - chat.flops == 2 * 8 * 32 * 32 * 64
    p = Pricing.for_cluster(load_cluster("1x4xA100-80GB"), "fp32")
    s = Strategy(dp=2)
    seconds, states = projection_cost(cap, s, 4, p)
    assert projection_cost(chat, s, 4, p) == (0.0, 0.0) and seconds > 0
    assert states == sum(model_state_bytes(32 * 64 + 64, 1, 0, p.prec))  # Linear(32, 64)'s weights and bias
    assert layer_seconds(cap, 2, p)[0] > layer_seconds(chat, 2, p)[0]


@pytest.mark.parametrize("data,words", [
    ({"modules": {"a": {"kind": "encoder", "layers": 2, "hidden": 64, "heads": 4}},
      "tasks": [{"name": "t", "batch": 4, "seq_len": 8, "modules": {"a": ["b"]}}]}, "does not define"),
    ({"modules": {"a": {"kind": "encoder", "layers": 2, "hidden": 64, "heads": 4},
                  "b": {"kind": "encoder", "layers": 2, "hidden": 64, "heads": 4}},
      "tasks": [{"name": "t", "batch": 4, "seq_len": 8, "modules": {"a": ["b"], "b": ["a"]}}]}, "cycle"),
    ({"modules": {"a": {"tower": "nope"}}, "tasks": [{"name": "t", "batch": 4, "seq_len": 8, "modules": {"a": []}}]},
     "unknown tower"),
    ({"modules": {"a": {"model": "tiny-gpt"}}, "tasks": [{"name": "t", "batch": 0, "seq_len": 8,
                                                         "modules": {"a": []}}]}, "tasks.0.batch"),
])
def test_bad_task_files_say_what_is_wrong(data: dict, words: str) -> None:
    with pytest.raises(PlaitError, match=words):
        parse_tasks(data)


def test_cli_prints_waves_json_and_draws_the_timeline(tmp_path: Path) -> None:
    runner = CliRunner()
    picture = tmp_path / "waves.png"
    r = runner.invoke(app, ["multitask", "--tasks", str(EXAMPLE), "--cluster", "2x8xA100-80GB", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["step_time_s"] <= report["baselines"]["sequential"]
    r = runner.invoke(app, ["multitask", "--tasks", str(EXAMPLE), "--cluster", "2x8xA100-80GB",
                            "--timeline", str(picture)])
    assert r.exit_code == 0 and picture.stat().st_size > 0 and "one after another" in r.stdout


def test_cli_bad_task_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("modules: {}\ntasks: []\n")
    r = CliRunner().invoke(app, ["multitask", "--tasks", str(bad), "--cluster", "1x8xA100-80GB"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
