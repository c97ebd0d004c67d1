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
    from plait.planner.space import block_strategies
    from plait.plan import uniform_plan

    model = PRESETS["llama2-7b"]
    plan = uniform_plan("tp=8,recompute=attn_kept", model, load_cluster("1x8xA800-80GB"), 4096)
    assert plan.pipelines[0].stages[0].strategies[0].short() == "dp1 tp8 rc=attn_kept"
    modes = {s.recompute for s in block_strategies(model.block, load_cluster("1x8xA800-80GB"), 8, 1, 4096)}
    assert modes == {"none", "selective", "attn_kept", "full"}
    projector = next(b for b in load_model("llava-llama3-8b").stack if b.kind == "projector")
    assert "attn_kept" not in {s.recompute for s in block_strategies(projector, load_cluster("1x8xA800-80GB"),
                                                                      8, 1, 4096)}


def test_runtime_refuses_it_with_ring_attention_only() -> None:
    from plait.executable import unsupported
    from plait.plan import uniform_plan

    model = load_model("tiny-llama")
    for text in ("dp=2,recompute=attn_kept,swap=1", "tp=2,sp=1,recompute=attn_kept,swap=0.5",
                 "cp=2,recompute=attn_kept"):
        assert unsupported(uniform_plan(text, model, local_ranks(2), 64), model) is None, text
    ring = uniform_plan("cp=2,cp_mode=ring,recompute=attn_kept", model, local_ranks(2), 64)
    reason = unsupported(ring, model)
    assert reason is not None and "ring" in reason and "\n" not in reason


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


def test_trains_with_tp_sp_and_ulysses_on_two_ranks_with_the_same_losses(tmp_path: Path) -> None:
    import json

    from plait.plan import uniform_plan
    from plait.runtime.train import TrainConfig

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"plait keeps the attention output of tokens {i}." for i in range(200)))
    model = load_model("tiny-llama")
    cases = {"one": "dp=1", "two": "dp=1,mbs=2,gbs=2", "dp": "dp=2,recompute=attn_kept,swap=1",
             "sp": "tp=2,sp=1,recompute=attn_kept,swap=0.5", "cp": "cp=2,recompute=attn_kept",
             "sp_plain": "tp=2,sp=1,swap=0.5"}
    paths, outs = [], {}
    for key, strategy in cases.items():
        plan = uniform_plan(strategy, model, local_ranks(1 if key in ("one", "two") else 2), 64)
        outs[key] = tmp_path / f"metrics-{key}.jsonl"
        cfg = TrainConfig(model="tiny-llama", plan=json.loads(plan.model_dump_json()), steps=4, lr=0.01,
                          data=str(text), metrics_out=str(outs[key]))
        paths.append(tmp_path / f"config-{key}.json")
        paths[-1].write_text(cfg.to_json())
    run_workers(paths[:2], nproc=1)
    run_workers(paths[2:])
    records = {k: [json.loads(line) for line in out.read_text().splitlines()] for k, out in outs.items()}
    base = {k: [r["loss"] for r in records[k]] for k in ("one", "two")}
    assert len(base["one"]) == len(base["two"]) == 4
    for key, ref in (("dp", "two"), ("cp", "one")):  # two sequences a step over dp=2
        assert [r["loss"] for r in records[key]] == pytest.approx(base[ref], abs=1e-5), key
    # tp2+sp: the same losses as tp2+sp without recomputation, to the bit; both differ from one process by
    # up to 1.0e-5 (2e-6 relative) at the third step with this corpus (tp+sp's own fp32 reduction order)
    assert [r["loss"] for r in records["sp"]] == [r["loss"] for r in records["sp_plain"]]
    assert [r["loss"] for r in records["sp"]] == pytest.approx(base["one"], rel=1e-5)
    for r in records["dp"]:  # everything kept is swapped
        assert r["swap"]["resident_peak_bytes"] == 0 and r["swap"]["host_peak_bytes"] > 0
    for r in records["sp"]:  # local shards cut token-wise, half each way
        assert r["swap"]["resident_peak_bytes"] == pytest.approx(r["swap"]["host_peak_bytes"], rel=0.05)
