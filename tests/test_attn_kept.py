"""recompute=attn_kept (MEMO's layer plan): everything in a layer is recomputed but the attention core, whose
output and log-sum-exp are kept (or swapped) with the layer input. Cost terms, search, runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_workers
from test_memory_hierarchy import _swapped_run
from plait.spec.cluster import load_cluster, local_ranks
from plait.spec.model import PRESETS, load_model

TINY_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=97,max_seq_len=48"


def _layer(text: str, model=None, cluster=None, seq: int = 131072):  # noqa: ANN001, ANN202
    from plait.plan import uniform_plan
    from plait.simulate import price_plan

    model, cluster = model or PRESETS["llama2-7b"], cluster or load_cluster("1x8xA800-80GB")
    return price_plan(uniform_plan(text, model, cluster, seq), model, cluster).costs[0][0].priced[0][0]


# ---- cost model ------------------------------------------------------------------------------------

def test_saved_bytes_are_the_input_the_attention_output_and_its_lse() -> None:
    block = PRESETS["llama2-7b"].block  # hidden 4096, 32 heads, flash attention
    a = block.activation_bytes("attn_kept")
    assert (a.replicated, a.sharded, a.quadratic_per_seq_token) == (2 * 4096, 2 * 4096 + 4 * 32, 0)
    assert block.activation_bytes("attn_kept").replicated == block.activation_bytes("full").replicated
    # tp=8 with sp: every term split over 8 ranks; 131072 tokens, bf16
    layer = _layer("tp=8,sp=1,zero=1,recompute=attn_kept,gbs=1")
    assert layer.activation == pytest.approx(131072 * (2 * 4096 + 2 * 4096 + 4 * 32) / 8)
    swapped = _layer("tp=8,sp=1,zero=1,recompute=attn_kept,swap=1,gbs=1")
    assert swapped.activation == 0 and swapped.swapped == pytest.approx(layer.activation)


def test_recompute_time_is_the_forward_less_the_attention_core() -> None:
    from plait.cost.price import recompute_flops_per_token

    kept, full, sel = (_layer(f"tp=8,sp=1,recompute={rc},gbs=1") for rc in ("attn_kept", "full", "selective"))
    assert kept.time.recompute == pytest.approx(full.time.forward - sel.time.recompute)
    # at 128K tokens the attention core is 75% of a Llama-2-7B layer's forward at tp=8: a quarter is repeated
    assert kept.time.recompute == pytest.approx(0.03032, rel=1e-3)
    assert full.time.recompute == pytest.approx(0.12126, rel=1e-3)
    assert kept.time.tp_comm == pytest.approx(full.time.tp_comm)  # the collectives come again
    block = PRESETS["llama2-7b"].block
    assert recompute_flops_per_token(block, "attn_kept", 4096) == block.gemm_flops_per_token(4096)


def test_shorthand_and_search_space_take_it() -> None:
    from plait.planner.space import SpaceLimits, block_strategies
    from plait.plan import uniform_plan
    from plait.spec.layers import RECOMPUTE_MODES

    model = PRESETS["llama2-7b"]
    plan = uniform_plan("tp=8,recompute=attn_kept", model, load_cluster("1x8xA800-80GB"), 4096)
    assert plan.pipelines[0].stages[0].strategies[0].short() == "dp1 tp8 rc=attn_kept"
    modes = {s.recompute for s in block_strategies(model.block, load_cluster("1x8xA800-80GB"), 8, 1, 4096)}
    assert modes == {"none", "selective", "attn_kept", "full"}  # gemm_kept only when asked for
    every = block_strategies(model.block, load_cluster("1x8xA800-80GB"), 8, 1, 4096,
                             SpaceLimits(recompute=RECOMPUTE_MODES))
    assert "gemm_kept" in {s.recompute for s in every}
    assert uniform_plan("tp=8,recompute=gemm_kept", model, load_cluster("1x8xA800-80GB"), 4096).pipelines[0] \
        .stages[0].strategies[0].short() == "dp1 tp8 rc=gemm_kept"
    projector = next(b for b in load_model("llava-llama3-8b").stack if b.kind == "projector")
    assert "attn_kept" not in {s.recompute for s in block_strategies(projector, load_cluster("1x8xA800-80GB"),
                                                                      8, 1, 4096)}


def test_runtime_runs_it_with_every_context_parallelism() -> None:
    from plait.executable import unsupported
    from plait.plan import uniform_plan

    model = load_model("tiny-llama")
    for text in ("dp=2,recompute=attn_kept,swap=1", "tp=2,sp=1,recompute=attn_kept,swap=0.5",
                 "cp=2,recompute=attn_kept", "cp=2,cp_mode=ring,recompute=attn_kept,swap=1"):
        assert unsupported(uniform_plan(text, model, local_ranks(2), 64), model) is None, text


def test_ring_keeps_its_queries_keys_values_output_and_lse() -> None:
    block = PRESETS["llama2-7b"].block  # hidden 4096, 32 heads of 128, bf16
    a = block.activation_bytes("attn_kept", ring=True)
    assert (a.replicated, a.sharded, a.sharded_fp32) == (2 * 4096, 3 * 2 * 4096, 4 * 4096 + 4 * 32)
    assert block.activation_bytes("full", ring=True) == block.activation_bytes("full")
    # cp=2 ring and tp=2: each rank holds half the tokens, and half the heads of what the core keeps
    ring = _layer("tp=2,cp=2,cp_mode=ring,zero=1,recompute=attn_kept,gbs=2", seq=8192)
    assert ring.activation == pytest.approx(4096 * (2 * 4096 + (3 * 2 * 4096 + 4 * 4096 + 4 * 32) / 2))
    # recomputation repeats the forward less the attention core, and none of the ring's K/V passes
    full = _layer("tp=2,cp=2,cp_mode=ring,zero=1,recompute=full,gbs=2", seq=8192)
    core = _layer("tp=2,cp=2,cp_mode=ulysses,zero=1,recompute=selective,gbs=2", seq=8192).time.recompute
    plain = _layer("tp=2,cp=2,cp_mode=ring,zero=1,gbs=2", seq=8192)
    assert ring.time.recompute == pytest.approx(full.time.forward - core)
    # selective leaves ring attention (its own autograd function) as it is: nothing runs again
    assert _layer("tp=2,cp=2,cp_mode=ring,zero=1,recompute=selective,gbs=2", seq=8192).time.recompute == 0
    assert ring.time.cp_comm == plain.time.cp_comm


# ---- runtime -----------------------------------------------------------------------------------------

def _run(share: float, recompute: str):  # noqa: ANN202
    """One fp32 forward and backward of a tiny Llama: its gradients, the swap meter's bytes, and how many
    times the attention kernel ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from plait.runtime.recompute import KEPT_OPS

    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            calls.extend([func] if func in KEPT_OPS else [])
            return func(*args, **(kwargs or {}))

    grads, meter = _swapped_run(share, "fp32", recompute, around=Count)
    return grads, meter, len(calls)


def test_attention_runs_once_and_the_saved_bytes_are_the_priced_ones() -> None:
    base, _, base_calls = _run(0.0, "none")
    _, _, full_calls = _run(0.0, "full")
    assert (base_calls, full_calls) == (2, 4)  # full recomputation runs each layer's attention again
    model = load_model(TINY_LLAMA)
    layer = _layer("dp=1,mbs=2,gbs=2,recompute=attn_kept,precision=fp32", model, local_ranks(1), 48)
    priced = 2 * layer.activation  # two layers
    # measured: input 2*48*64*4 + output 2*48*64*4 + lse 2*48*4*4 bytes per layer, two layers = 101,376 bytes
    for share in (0.0, 0.5, 1.0):
        grads, m, calls = _run(share, "attn_kept")
        assert calls == 2  # the attention forward is not run again in backward
        assert max((grads[n] - base[n]).abs().max().item() for n in base) <= 1e-6
        assert m["resident_peak_bytes"] + m["host_peak_bytes"] == 101376
        assert m["resident_peak_bytes"] == pytest.approx((1 - share) * priced, rel=0.05)
        assert m["host_peak_bytes"] == pytest.approx(share * priced, rel=0.05)


def _train_cases(tmp_path: Path, line: str, cases: dict[str, str], steps: int,
                 single: tuple[str, ...]) -> dict[str, list[dict]]:
    """Train tiny-llama on a corpus of `line` (with a counter) once per case, `single` cases on one process and the
    rest on two ranks in one launch; each case's metrics records."""
    import json

    from plait.plan import uniform_plan
    from plait.runtime.train import TrainConfig

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"{line} {i}." for i in range(200)))
    model = load_model("tiny-llama")
    paths, outs = {}, {}
    for key, strategy in cases.items():
        plan = uniform_plan(strategy, model, local_ranks(1 if key in single else 2), 64)
        outs[key] = tmp_path / f"metrics-{key}.jsonl"
        cfg = TrainConfig(model="tiny-llama", plan=json.loads(plan.model_dump_json()), steps=steps, lr=0.01,
                          data=str(text), metrics_out=str(outs[key]))
        paths[key] = tmp_path / f"config-{key}.json"
        paths[key].write_text(cfg.to_json())
    run_workers([paths[k] for k in cases if k in single], nproc=1)
    run_workers([paths[k] for k in cases if k not in single])
    return {k: [json.loads(r) for r in out.read_text().splitlines()] for k, out in outs.items()}


def test_trains_with_tp_sp_and_ulysses_on_two_ranks_with_the_same_losses(tmp_path: Path) -> None:
    """attn_kept, and gemm_kept (op-level selective checkpointing: GEMM outputs kept in checkpoint's cache,
    cut by the swap) in the same launch: the losses of one process."""
    cases = {"one": "dp=1", "two": "dp=1,mbs=2,gbs=2", "dp": "dp=2,recompute=attn_kept,swap=1",
             "sp": "tp=2,sp=1,recompute=attn_kept,swap=0.5", "cp": "cp=2,recompute=attn_kept",
             "sp_plain": "tp=2,sp=1,swap=0.5", "dp_gemm": "dp=2,recompute=gemm_kept,swap=0.5",
             "sp_gemm": "tp=2,sp=1,recompute=gemm_kept,swap=0.5", "cp_gemm": "cp=2,recompute=gemm_kept"}
    records = _train_cases(tmp_path, "plait keeps the attention output of tokens", cases, 4, ("one", "two"))
    base = {k: [r["loss"] for r in records[k]] for k in ("one", "two")}
    assert len(base["one"]) == len(base["two"]) == 4
    # dp=2 holds two sequences a step: "two"
    for key, ref in (("dp", "two"), ("cp", "one"), ("dp_gemm", "two"), ("cp_gemm", "one")):
        assert [r["loss"] for r in records[key]] == pytest.approx(base[ref], abs=1e-5), key
    # tp2+sp: the same losses as tp2+sp without recomputation, to the bit; both differ from one process by
    # up to 1.0e-5 (2e-6 relative) at the third step with this corpus (tp+sp's own fp32 reduction order)
    for key in ("sp", "sp_gemm"):
        assert [r["loss"] for r in records[key]] == [r["loss"] for r in records["sp_plain"]], key
        assert [r["loss"] for r in records[key]] == pytest.approx(base["one"], rel=1e-5), key
    for r in records["dp"]:  # everything kept is swapped
        assert r["swap"]["resident_peak_bytes"] == 0 and r["swap"]["host_peak_bytes"] > 0
    for r in records["sp"] + records["sp_gemm"] + records["dp_gemm"]:  # cut token-wise, half each way
        assert r["swap"]["resident_peak_bytes"] == pytest.approx(r["swap"]["host_peak_bytes"], rel=0.05)


def test_ring_trains_with_the_same_losses_and_the_priced_saved_bytes(tmp_path: Path) -> None:
    """cp=2 ring with attn_kept: ring attention runs once per step (outside the recomputed region), the
    losses are one process's, and the bytes kept for backward (swapped at swap=1, half at 0.5) are the
    priced ones: the layer input and ring attention's q, k, v, fp32 output and log-sum-exp per rank."""
    model = load_model("tiny-llama")
    ring = "cp=2,cp_mode=ring,recompute=attn_kept,precision=fp32"
    cases = {"one": "dp=1,precision=fp32", "plain": "cp=2,cp_mode=ring,precision=fp32", "ring0": ring,
             "ring1": f"{ring},swap=1", "ring5": f"{ring},swap=0.5"}
    records = _train_cases(tmp_path, "plait keeps the ring attention output", cases, 3, ("one",))
    base = [r["loss"] for r in records["one"]]
    assert len(base) == 3
    # the losses of ring attention without recomputation, to the bit; both differ from one process at the
    # third step by the ring's own fp32 merge order, which depends on the CPU's attention kernels: 1.9e-5
    # (3e-6 relative) on one machine, 6.9e-5 (1.1e-5 relative) on an AMD EPYC
    for key in ("ring0", "ring1", "ring5"):
        assert [r["loss"] for r in records[key]] == [r["loss"] for r in records["plain"]], key
        assert [r["loss"] for r in records[key]] == pytest.approx(base, rel=2e-5), key
    priced = model.layers * _layer(ring, model, local_ranks(2), 64).activation
    for r in records["ring1"]:
        assert r["swap"]["resident_peak_bytes"] == 0
        assert r["swap"]["host_peak_bytes"] == pytest.approx(priced, rel=0.05)
    for r in records["ring5"]:
        assert r["swap"]["resident_peak_bytes"] == pytest.approx(priced / 2, rel=0.05)
        assert r["swap"]["host_peak_bytes"] == pytest.approx(priced / 2, rel=0.05)
