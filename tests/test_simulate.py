"""The simulator: whole-plan behaviour that any correct cost model must show."""

from __future__ import annotations

import pytest

from plait.cost.calibration import calibration_for
from plait.plan import Pipeline, Plan, Stage, Strategy, uniform_plan
from plait.simulate import BREAKDOWN_KEYS, BUSY_KEYS, _stage_cost, simulate
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS

GPT13 = PRESETS["gpt3-13b"]
LLAMA8 = PRESETS["llama3-8b"]
C32 = dgx(4, 8, "A100-80GB")


def run(strategy: str, model=GPT13, cluster=C32, seq: int = 2048, **kw):
    plan = uniform_plan(strategy, model, cluster, seq)
    return plan, simulate(plan, model, cluster, **kw)


def test_breakdown_adds_up_to_iteration_time() -> None:
    for s in ("tp=8,pp=2,dp=2,mbs=2,gbs=64", "tp=4,pp=4,dp=2,mbs=1,gbs=64,vpp=2,recompute=full",
              "dp=32,zero=3,mbs=1", "tp=2,dp=16,zero=1,sp=1,recompute=selective,mbs=2"):
        _, r = run(s)
        assert set(r.breakdown) == set(BREAKDOWN_KEYS)
        assert sum(r.breakdown.values()) == pytest.approx(r.iteration_time_s, rel=1e-9)
        assert all(v >= 0 for v in r.breakdown.values())


def test_report_units_and_definitions() -> None:
    plan, r = run("tp=8,pp=2,dp=2,mbs=2,gbs=64,recompute=full")
    tokens = plan.global_batch * plan.seq_len
    assert r.tokens_per_s == pytest.approx(tokens / r.iteration_time_s)
    model_flops = GPT13.model_flops_per_token(2048) * tokens
    assert r.model_tflops_per_gpu == pytest.approx(model_flops / r.iteration_time_s / 32 / 1e12)
    assert r.mfu == pytest.approx(r.model_tflops_per_gpu * 1e12 / 312e12)
    # Full recompute repeats the forward of every block: hardware FLOPs = model + 1/3 of block FLOPs.
    block = GPT13.layers * GPT13.block_flops_per_token(2048) * tokens
    assert r.hardware_tflops_per_gpu * 1e12 * r.iteration_time_s * 32 == pytest.approx(model_flops + block)
    assert r.hfu > r.mfu


def test_more_micro_batches_shrink_the_bubble() -> None:
    """With equal stages the first device idles exactly (p-1)/(m+p-1) of its pipeline time (p2p is kept out of
    the bubble); the real plan's first and last stages also carry the embedding and the head, so it idles
    more."""
    from plait.cost.pipeline import ideal_bubble_fraction
    from plait.simulate import finish, price_plan

    fractions = []
    for gbs in (16, 32, 128):
        plan = uniform_plan(f"tp=8,pp=4,dp=1,mbs=1,gbs={gbs}", GPT13, C32, 2048)
        priced = price_plan(plan, GPT13, C32)
        priced.costs[0][:] = [priced.costs[0][1]] * 4  # every stage costs what a middle stage costs
        parts = finish(priced).breakdown
        idle = ("pp_bubble", "p2p", "dp_comm_exposed", "optimizer")
        busy = sum(v for k, v in parts.items() if k not in idle)
        fraction = parts["pp_bubble"] / (busy + parts["pp_bubble"])
        assert fraction == pytest.approx(ideal_bubble_fraction(4, gbs), rel=1e-9)
        _, r = run(f"tp=8,pp=4,dp=1,mbs=1,gbs={gbs}")
        fractions.append(r.breakdown["pp_bubble"] / r.iteration_time_s)
        assert fractions[-1] > ideal_bubble_fraction(4, gbs)
    assert fractions[0] > fractions[1] > fractions[2]


def test_interleaving_shrinks_the_bubble() -> None:
    _, plain = run("tp=8,pp=4,dp=1,mbs=1,gbs=16")
    _, inter = run("tp=8,pp=4,dp=1,mbs=1,gbs=16,vpp=2")
    assert inter.breakdown["pp_bubble"] < plain.breakdown["pp_bubble"]
    assert inter.peak_memory_gib > plain.peak_memory_gib  # more micro-batches in flight on device 0


def test_gpipe_keeps_all_micro_batches_in_flight() -> None:
    _, f1b = run("tp=8,pp=4,dp=1,mbs=1,gbs=32")
    _, gpipe = run("tp=8,pp=4,dp=1,mbs=1,gbs=32,schedule=gpipe")
    assert gpipe.devices[0].memory.activations > 4 * f1b.devices[0].memory.activations
    # 1F1B: stage d holds p - d micro-batches.
    acts = [d.memory.activations for d in f1b.devices]
    assert acts[0] > acts[1] > acts[2]


def test_zero_stages_cut_model_state_memory() -> None:
    mems = [run(f"dp=32,zero={z},mbs=1,gbs=32", model=LLAMA8)[1].devices[0].memory for z in range(4)]
    assert mems[1].optimizer < mems[0].optimizer and mems[1].gradients == mems[0].gradients
    assert mems[2].gradients < mems[1].gradients and mems[2].weights == mems[1].weights
    assert mems[3].weights < mems[2].weights
    assert mems[0].optimizer == pytest.approx(32 * mems[1].optimizer)


def test_recompute_trades_time_for_memory() -> None:
    _, none = run("tp=8,dp=4,mbs=4,gbs=64")
    _, sel = run("tp=8,dp=4,mbs=4,gbs=64,sp=1,recompute=selective")
    _, full = run("tp=8,dp=4,mbs=4,gbs=64,recompute=full")
    assert full.devices[0].memory.activations < sel.devices[0].memory.activations < none.devices[0].memory.activations
    assert full.iteration_time_s > none.iteration_time_s
    assert full.breakdown["recompute"] > sel.breakdown["recompute"] > 0 == none.breakdown["recompute"]


def test_not_fitting_is_reported_not_raised() -> None:
    small = C32.with_memory(8)
    _, r = run("dp=32,mbs=1,gbs=32", model=LLAMA8, cluster=small)
    assert not r.fits
    assert r.over_memory_gib == pytest.approx(r.peak_memory_gib - 8)


def test_tensor_parallel_across_nodes_is_slower() -> None:
    two_nodes = dgx(2, 4, "A100-80GB")
    _, inside = run("tp=4,dp=2,mbs=1,gbs=16", cluster=two_nodes)
    # Ranks 0..7 on nodes of 4: a tp=8 group must cross the network.
    _, across = run("tp=8,dp=1,mbs=1,gbs=16", cluster=two_nodes)
    assert across.breakdown["tp_comm"] > 4 * inside.breakdown["tp_comm"]


def test_a_straggler_slows_its_stage_and_the_iteration() -> None:
    plan, healthy = run("tp=8,pp=4,dp=1,mbs=1,gbs=32")
    slow = simulate(plan, GPT13, C32.with_slow({9: 2.0}))
    assert slow.iteration_time_s > 1.3 * healthy.iteration_time_s
    busy = slow.pipelines[0].busy_s
    assert busy[1] == max(busy) and busy[1] > 1.9 * busy[2]


def _layered_plan() -> Plan:
    """Galvatron-style: one stage of 8 ranks whose layers use three different strategies."""
    strategies = [Strategy(dp=8, zero=3)] * 10 + [Strategy(dp=2, tp=4, sp=True)] * 20 + \
        [Strategy(dp=4, tp=2, recompute="full")] * 10
    stage = Stage(layers=(0, 40), ranks=tuple(range(8)), strategies=tuple(strategies))
    return Plan(model=GPT13.name, seq_len=2048, global_batch=16,
                pipelines=(Pipeline(stages=(stage,), micro_batches=2, micro_batch_sequences=8),))


def test_per_layer_strategies_pay_for_relayout() -> None:
    cluster = dgx(1, 8, "A100-80GB")
    r = simulate(_layered_plan(), GPT13, cluster)
    assert r.breakdown["relayout"] > 0
    assert sum(r.breakdown.values()) == pytest.approx(r.iteration_time_s)


def _two_stages(first: Strategy, second: Strategy) -> Plan:
    stages = (Stage(layers=(0, 20), ranks=tuple(range(4)), strategies=(first,)),
              Stage(layers=(20, 40), ranks=tuple(range(4, 8)), strategies=(second,)))
    return Plan(model=GPT13.name, seq_len=2048, global_batch=32,
                pipelines=(Pipeline(stages=stages, micro_batches=8, micro_batch_sequences=4),))


def test_stages_laid_out_differently_pay_for_relayout_where_they_meet() -> None:
    cluster = dgx(1, 8, "A100-80GB")

    def relayout(first: Strategy, second: Strategy) -> float:  # paid by the receiving stage
        return simulate(_two_stages(first, second), GPT13, cluster).devices[1].parts["relayout"]

    assert relayout(Strategy(tp=4), Strategy(tp=4)) == 0
    # tp4 -> dp2 x tp2: each rank keeps half of its copy going forward but gathers the gradient back
    assert relayout(Strategy(tp=4), Strategy(dp=2, tp=2)) > 0
    # splitting further is cheaper than gathering copies (a quarter vs three quarters received forward)
    assert 0 < relayout(Strategy(dp=4), Strategy(dp=2, tp=2)) < relayout(Strategy(dp=4), Strategy(tp=4))


def test_non_uniform_pipelines_wait_for_the_slowest() -> None:
    """Malleus-style: two data-parallel pipelines with different cuts and micro-batch counts, rank 15 unused."""
    s = Strategy(tp=2)
    fast = Pipeline(stages=(Stage(layers=(0, 20), ranks=(0, 1), strategies=(s,)),
                            Stage(layers=(20, 40), ranks=(2, 3), strategies=(s,))), micro_batches=10,
                    micro_batch_sequences=1)
    slow = Pipeline(stages=(Stage(layers=(0, 25), ranks=(4, 5), strategies=(s,)),
                            Stage(layers=(25, 40), ranks=(6, 7), strategies=(s,))), micro_batches=6,
                    micro_batch_sequences=1)
    plan = Plan(model=GPT13.name, seq_len=2048, global_batch=16, pipelines=(fast, slow))
    cluster = dgx(2, 8, "A100-80GB")
    r = simulate(plan, GPT13, cluster)
    assert len(r.pipelines) == 2
    assert all(d.end_s == pytest.approx(r.iteration_time_s, rel=0.05) for d in r.devices)
    assert r.pipelines[0].makespan_s > r.pipelines[1].makespan_s  # more micro-batches


def test_record_gives_a_timeline() -> None:
    _, r = run("tp=8,pp=4,dp=1,mbs=1,gbs=8", record=True)
    ops = r.pipelines[0].ops
    assert len(ops) == 2 * 4 * 8
    assert {o.kind for o in ops} == {"F", "B"}


def test_context_parallel_ranks_share_and_shard_weights() -> None:
    """cp ranks hold the same weights: ZeRO shards over dp x cp and gradients are reduced across cp."""
    cluster = dgx(1, 8, "H100-80GB")
    _, plain = run("dp=1,cp=8,mbs=1,gbs=8", model=LLAMA8, cluster=cluster, seq=32768)
    _, sharded = run("dp=1,cp=8,mbs=1,gbs=8,zero=1", model=LLAMA8, cluster=cluster, seq=32768)
    assert sharded.devices[0].memory.optimizer == pytest.approx(plain.devices[0].memory.optimizer / 8)
    assert plain.breakdown["dp_comm_exposed"] > 0  # gradients are all-reduced over the 8 cp ranks


def test_busy_keys_are_every_term_a_stage_spends_computing_or_communicating() -> None:
    """BUSY_KEYS (what a rank's compute clock covers, read by the adaptive runtime) are exactly the per-micro-
    batch terms of a stage; the rest of the breakdown is the schedule's and the step's."""
    m, c = PRESETS["llama2-7b"], dgx(1, 8, "A100-80GB")
    plan = uniform_plan("tp=2,pp=2,dp=2,gbs=16,swap=0.5", m, c, 2048)
    stage = _stage_cost(plan, 0, 0, m, c, calibration_for(c.gpu.name))
    assert tuple(stage.parts) == BUSY_KEYS
    assert set(BREAKDOWN_KEYS) - set(BUSY_KEYS) == {"pp_bubble", "p2p", "dp_comm_exposed", "optimizer"}


def test_megatron_p2p_scatters_replicated_activations_over_the_tensor_parallel_ranks() -> None:
    """Without sequence parallelism every tp rank holds the whole activation: Megatron-LM sends 1/tp of it from
    each rank and all-gathers on arrival (SC21, Sec. 4.1); plait's runtime sends the whole of it from each."""
    plan = uniform_plan("tp=8,pp=4,dp=1,mbs=1,gbs=16", GPT13, C32, 2048)
    cal = calibration_for("A100-80GB")
    whole = _stage_cost(plan, 0, 0, GPT13, C32, cal).send
    split = _stage_cost(plan.model_copy(update={"p2p": "megatron"}), 0, 0, GPT13, C32, cal).send
    assert split < whole / 4
    sp = uniform_plan("tp=8,pp=4,dp=1,mbs=1,gbs=16,sp=1", GPT13, C32, 2048)  # already split: nothing changes
    assert _stage_cost(sp.model_copy(update={"p2p": "megatron"}), 0, 0, GPT13, C32, cal).send == \
        _stage_cost(sp, 0, 0, GPT13, C32, cal).send
