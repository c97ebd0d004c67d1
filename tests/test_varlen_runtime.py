"""Variable-length training: packing, document masks, the zigzag split, ring and Ulysses attention over
groups of ranks that change per call (4 real gloo ranks against one process, forward and backward), and
whole `plait train --varlen` runs whose losses equal a single process's whatever the layout method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.planner.varlen import BatchPlan, Group, MicroBatch
from plait.runtime.packing import IGNORE, contiguous, document_mask, pack, zigzag
from plait.runtime.train import TrainConfig
from plait.runtime.varlen import DocumentSource, check_config, layout_of
from plait.spec.model import load_model
from tests.helpers import expect_error, ranks_command

HERE = Path(__file__).parent
MODEL = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=300,seq=512"


def test_pack_restarts_positions_and_pads_with_a_document_of_its_own() -> None:
    p = pack([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7])], multiple=4)
    assert p.tokens.tolist() == [1, 2, 4, 5, 6, 0, 0, 0]
    assert p.targets.tolist() == [2, 3, 5, 6, 7, IGNORE, IGNORE, IGNORE]
    assert p.documents.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert p.positions.tolist() == [0, 1, 0, 1, 2, 0, 1, 2]
    i = torch.arange(p.length)
    mask = document_mask(p.documents, i, p.documents, i)
    assert mask[3].tolist() == [False, False, True, True, False, False, False, False]
    assert bool(mask.diagonal().all())  # every token sees itself: no empty softmax row


def test_zigzag_and_contiguous_splits_cover_the_row_once() -> None:
    for ranks in (1, 2, 3, 4):
        z = zigzag(8 * ranks, ranks)
        assert sorted(torch.cat(z).tolist()) == list(range(8 * ranks))
        assert z[0][0] == 0 and z[0][-1] == 8 * ranks - 1  # rank 0 has the first and the last piece
        assert torch.cat(contiguous(8 * ranks, ranks)).tolist() == list(range(8 * ranks))


def test_layout_maps_planned_lengths_back_to_documents() -> None:
    plan = BatchPlan([MicroBatch((Group(2, (9, 5), 1.0, (0, 1)), Group(1, (5,), 0.5, (2,)))),
                      MicroBatch((Group(1, (3,), 0.1, (3,)),))])
    layout = layout_of(plan, [5, 3, 9, 5])
    assert [[(w.ranks, w.documents) for w in mb] for mb in layout.micro_batches] == [
        [((0, 1), (2, 0)), ((2,), (3,))], [((3,), (1,))]]
    assert layout.summary() == "2x1 1x1 | 1x1"


def test_documents_are_the_same_for_any_world_and_clipped_to_the_model() -> None:
    pool = np.array([3, 700, 40])
    a = DocumentSource(pool, 6, 1, 300, 512)
    b = DocumentSource(pool, 6, 1, 300, 512)
    assert a.lengths(4) == b.lengths(4) and max(a.lengths(4)) <= 512
    assert all(torch.equal(x, y) for x, y in zip(a.documents(4), b.documents(4)))
    assert [len(d) - 1 for d in a.documents(4)] == a.lengths(4)


def test_bad_varlen_configs_say_what_to_change() -> None:
    spec = load_model(MODEL)

    def cfg(**kw):
        base = {"model": MODEL, "plan": {}, "varlen": "flexsp", "lengths": "x", "global_batch": 8,
                "capacity": 128}
        return TrainConfig(**{**base, **kw})

    expect_error(lambda: check_config(cfg(varlen="dynamic"), spec, 4), "--varlen")
    expect_error(lambda: check_config(cfg(capacity=64), spec, 4), "--capacity 64", "128")
    expect_error(lambda: check_config(cfg(sp=2), spec, 4), "--sp")
    expect_error(lambda: check_config(cfg(cp_mode="zigzag"), spec, 4), "--cp-mode")
    odd = load_model("llama:layers=2,hidden=96,heads=3,kv_heads=1,ffn=128,vocab=300,seq=512")
    expect_error(lambda: check_config(cfg(), odd, 4), "heads", "ring")
    check_config(cfg(cp_mode="ring"), odd, 4)
    check_config(cfg(varlen="bytescale"), odd, 4)


def _torchrun(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = ranks_command(4, *args)
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)})


def test_ring_and_ulysses_on_changing_groups_equal_one_process(tmp_path) -> None:
    out = tmp_path / "errors.json"
    proc = _torchrun(str(HERE / "packed_check.py"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(out.read_text())
    assert len(errors) == 34, sorted(errors)  # ring alone, Llama with Ulysses and ring, per group; Llama alone
    assert max(errors.values()) < 1e-5, {k: v for k, v in errors.items() if v >= 1e-5}


def _train(tmp: Path, name: str, nproc: int, *extra: str, model: str = MODEL, steps: int = 3, documents: int = 8,
           env: dict[str, str] | None = None) -> list[dict]:
    metrics = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", model, "--nproc", str(nproc),
           "--steps", str(steps), "--global-batch", str(documents), "--lr", "0.01", "--metrics-out", str(metrics), *extra]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("varlen"), "single", 1, "--varlen", "flexsp", "--capacity", "512")


@pytest.mark.parametrize("method", [("flexsp",), ("bytescale",), ("static",), ("static", "--cp-mode", "ring"),
                                    ("bytescale", "--offload-above", "200", "--varlen-states", "replicated")],
                         ids=lambda m: " ".join(m))
def test_every_layout_method_trains_like_one_process(tmp_path, single, method) -> None:
    runs = _train(tmp_path, method[0], 4, "--varlen", *method, "--capacity", "128")
    assert len(runs) == 3
    for a, b in zip(single, runs):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5, (a["step"], a["loss"], b["loss"])
    if "--offload-above" in method:  # the documents of 200+ tokens went to host memory and back, exactly
        assert all(r["swap"]["swapped_bytes"] > 0 for r in runs), runs
    else:
        assert all("swap" not in r for r in runs)
    groups = {len(part.split()[0]) for r in runs for part in r["layout"].split(" | ")}
    assert groups, runs  # a layout was reported every step
    if method == ("flexsp",):  # groups of more than one rank appear when documents outgrow one rank
        assert any(not part.startswith("1x") for r in runs for part in r["layout"].split(" | ")), runs


@pytest.mark.parametrize("method", [("flexsp", "--varlen-states", "sharded"),
                                    ("bytescale", "--varlen-states", "replicated")], ids=lambda m: " ".join(m))
def test_pipeline_stages_run_sequence_parallel_groups_like_one_process(tmp_path, single, method) -> None:
    """pp2 x 2 ranks per stage: every micro-batch's groups (some of 2 ranks: FlexSP's with Ulysses, ByteScale's
    with ring attention) run on each stage's ranks, hidden states handed from stage to stage in 1F1B order;
    the losses equal one process's over 3 steps."""
    runs = _train(tmp_path, "stages", 4, "--varlen", *method, "--capacity", "256", "--varlen-stages", "2")
    assert len(runs) == 3 and all(r["stages"] == 2 for r in runs)
    assert any(part.startswith("2x") for r in runs for mb in r["layout"].split(" | ") for part in mb.split()), runs
    for a, b in zip(single, runs):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5, (a["step"], a["loss"], b["loss"])
    from plait.models import build_model

    whole = sum(p.numel() for p in build_model(load_model(MODEL)).parameters()) * 4  # fp32 bytes
    held = [t["weights"] for t in runs[0]["memory_terms"]]
    # each parameter on one stage: sharded over its 2 ranks (held once in all) or whole on both
    assert sum(held) == whole * (1 if "sharded" in method else 2)
    assert held[0] + held[1] != held[2] + held[3]  # the stages hold different layers (embedding, head)


MOE = "tiny-moe"
"""Llama with MoE layers (8 experts, top-2, a shared expert) after a dense first layer."""


def test_moe_balancing_loss_takes_each_packed_document_as_a_sequence() -> None:
    """A packed row's balancing loss is the sum of its documents' losses, each as if alone; padding counts in
    none of them, and the row taken as one sequence gives another value."""
    from plait.models.moe import Documents, MoE

    block = next(b for b in load_model(MOE).stack if b.kind == "moe")
    torch.manual_seed(0)
    moe = MoE(block)
    lengths = (5, 9, 3)
    docs = [torch.randn(n, block.hidden) for n in lengths]
    row = torch.cat([*docs, torch.zeros(3, block.hidden)])  # 3 padding tokens
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate((*lengths, 3))])
    with torch.no_grad():
        probs, chosen, _ = moe.route(row)
        packed = moe.document_aux_loss(probs, chosen, Documents(ids, len(lengths)))
        alone = sum(moe.aux_loss(*moe.route(d)[:2], 1) for d in docs)
    assert float(packed) == pytest.approx(float(alone), rel=1e-6)
    assert abs(float(moe.aux_loss(probs[:17], chosen[:17], 1)) - float(alone)) > 0.1


@pytest.fixture(scope="module")
def single_moe(tmp_path_factory) -> list[dict]:
    return _train(tmp_path_factory.mktemp("varlen_moe"), "single", 1, "--varlen", "flexsp",
                  "--capacity", "256", model=MOE)


@pytest.mark.parametrize("method", ["flexsp", "bytescale"])
def test_moe_layers_train_like_one_process(tmp_path, single_moe, method) -> None:
    """Experts sharded with the states, every rank routing its own packed tokens, the balancing loss taken
    per document (counts summed over a group's ranks): 4 ranks' losses equal one process's over 3 steps."""
    runs = _train(tmp_path, method, 4, "--varlen", method, "--capacity", "64", model=MOE)
    assert len(runs) == 3
    assert any(not part.startswith("1x") for r in runs for part in r["layout"].split(" | ")), runs
    for a, b in zip(single_moe, runs):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5, (a["step"], a["loss"], b["loss"])


def test_deepseek_choice_biases_move_as_one_process_s(tmp_path) -> None:
    """tiny-deepseek's routers' choice biases move after every step by the step's choices of real tokens (not
    the padding of packed rows, not the filler passes of ranks without work), summed over the ranks: FlexSP's
    and ByteScale's 4 ranks give one process's losses over 4 steps, whose checkpoint holds the moved biases
    (each step +-0.001 or 0 where an expert got exactly the mean)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    single = _train(tmp_path, "single", 1, "--varlen", "flexsp", "--capacity", "256", "--checkpoint-dir",
                    str(tmp_path / "ckpt"), "--checkpoint-every", "4", model="tiny-deepseek", steps=4)
    dcp_to_torch_save(tmp_path / "ckpt" / "step-4", tmp_path / "state.pt")
    layers = torch.load(tmp_path / "state.pt", weights_only=False)["model"]
    biases = torch.stack([t for name, t in layers.items() if name.endswith("choice_bias")])
    assert biases.shape == (3, 8) and biases.abs().max() <= 4e-3 + 1e-9 and (biases != 0).any()
    assert torch.allclose(biases * 1e3, (biases * 1e3).round(), atol=1e-4)
    for method in ("flexsp", "bytescale"):
        runs = _train(tmp_path, method, 4, "--varlen", method, "--capacity", "64", model="tiny-deepseek", steps=4)
        for a, b in zip(single, runs, strict=True):
            assert a["tokens"] == b["tokens"]
            assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5, (method, a["step"], a["loss"], b["loss"])


def test_gpt_oss_layers_train_like_one_process(tmp_path) -> None:
    """tiny-gpt-oss's attention sinks in packed rows (each document's queries see their keys and the sink) under
    FlexSP's Ulysses groups and ByteScale's ring attention: 4 ranks' losses equal one process's over 3 steps."""
    single = _train(tmp_path, "single", 1, "--varlen", "flexsp", "--capacity", "256", model="tiny-gpt-oss")
    for method in ("flexsp", "bytescale"):
        runs = _train(tmp_path, method, 4, "--varlen", method, "--capacity", "64", model="tiny-gpt-oss")
        assert any(not part.startswith("1x") for r in runs for part in r["layout"].split(" | ")), runs
        for a, b in zip(single, runs, strict=True):
            assert a["tokens"] == b["tokens"]
            assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5, (method, a["step"], a["loss"], b["loss"])


STATES_MODEL = "llama:layers=4,hidden=512,heads=8,kv_heads=4,ffn=1376,vocab=512,seq=256"
"""Big enough that model states (12.1M parameters: 46 MiB of weights, 185 MiB with gradients and Adam)
outweigh one step's activations on 4 ranks."""
FREED_BUFFERS_LEAVE = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc: allocations over 64 KiB mapped on their own, so a freed buffer (a gathered layer) leaves the resident
set, as it leaves a GPU's caching allocator for reuse; otherwise the CPU high-water mark keeps every one."""


def _above_reserve(record: dict) -> float:
    """The largest peak over the ranks of what the run added to the process (bytes): states, activations,
    buffers (`plait.runtime.memory` terms without the interpreter's reserve)."""
    return max(t["total"] - t["reserve"] for t in record["memory_terms"])


def test_sharded_states_hold_under_0_6x_the_replicated_peak_at_equal_losses(tmp_path) -> None:
    args = ("--varlen", "flexsp", "--capacity", "128")
    runs = {states: _train(tmp_path, states, 4, *args, "--varlen-states", states, model=STATES_MODEL, steps=2,
                           documents=4, env=FREED_BUFFERS_LEAVE) for states in ("sharded", "replicated")}
    sharded, replicated = runs["sharded"], runs["replicated"]
    for a, b in zip(sharded, replicated):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5, (a["step"], a["loss"], b["loss"])
    states = [sum(r["memory_terms"][0][k] for k in ("weights", "grads", "optim"))
              for r in (sharded[0], replicated[0])]
    assert states[0] == pytest.approx(states[1] / 4, rel=0.01)  # each rank holds a quarter of the states
    ratio = _above_reserve(sharded[0]) / _above_reserve(replicated[0])
    assert ratio <= 0.6, (ratio, sharded[0]["memory_terms"], replicated[0]["memory_terms"])


def test_train_varlen_resumes_from_its_checkpoint(tmp_path) -> None:
    """`plait train --varlen` with --checkpoint-dir: a run stopped after step 1 and started again in the same
    directory trains steps 1-2 on the uninterrupted run's documents to its losses."""
    args = ("--varlen", "flexsp", "--capacity", "256")
    whole = _train(tmp_path, "whole", 2, *args)
    ck = str(tmp_path / "ck")
    first = _train(tmp_path, "first", 2, *args, "--checkpoint-dir", ck, "--checkpoint-every", "1", "--steps", "1")
    resumed = _train(tmp_path, "resumed", 2, *args, "--checkpoint-dir", ck)
    assert [r["step"] for r in first] == [0] and [r["step"] for r in resumed] == [1, 2]
    for a, b in zip(whole[1:], resumed):
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5, (a["step"], a["loss"], b["loss"])


@pytest.mark.parametrize(("extra", "needle"), [
    (["--varlen", "dynamic"], "--varlen must be one of"),
    (["--varlen", "flexsp", "--strategy", "dp=2"], "drop --plan/--strategy"),
    (["--varlen", "flexsp", "--capacity", "16"], "raise it to 128"),
    (["--varlen", "flexsp", "--lengths", "/nonexistent/lengths.txt"], "cannot read lengths file"),
    (["--varlen", "flexsp", "--adaptive"], "do not combine with --varlen"),
    (["--varlen", "flexsp", "--varlen-states", "half"], "--varlen-states must be one of"),
    (["--varlen", "flexsp", "--offload-above", "-1"], "--offload-above is a document length"),
    (["--varlen", "flexsp", "--varlen-stages", "3"], "--varlen-stages must divide the 4 ranks"),
])
def test_train_varlen_bad_input_is_one_line_and_exit_2(extra, needle) -> None:
    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", MODEL, "--nproc", "4", *extra]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
