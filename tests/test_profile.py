"""`plait profile` end to end (quick), and the profile file's round trip and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import expect_error

from plait.cost import comm
from plait.cost.comm import GroupShape
from plait.cost.head import head_time
from plait.cost.layer import BlockContext, block_activation_bytes, block_time, measured_ep
from plait.cost.measured import calibrate, profiled_cluster
from plait.cost.precision import PRECISIONS
from plait.cost.profile_file import (
    PROFILE_VERSION,
    CollectiveCurve,
    Curve,
    Device,
    EdgeProfile,
    LayerProfile,
    OptimizerCurve,
    Profile,
    StrategyProfile,
    load_profile,
)
from plait.errors import PlaitError
from plait.plan import Strategy, uniform_plan
from plait.simulate import simulate
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "profile", "--model", "tiny-llama", "--nproc", "2",
                           "--quick", "--out", str(path)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path, proc.stdout


def test_profile_measures_and_round_trips(measured) -> None:
    path, stdout = measured
    p = load_profile(path)
    assert p.version == PROFILE_VERSION and p.device.kind == "cpu" and p.device.gpu_type == "CPU"
    assert p.device.peak_flops > 1e8 and p.process_bytes > 50 * 2**20
    assert {(lp.tp, lp.recompute) for lp in p.layers} == {(t, r) for t in (1, 2) for r in ("none", "selective", "full")}
    assert {(e.part, e.tp) for e in p.edges} == {("embedding", 1), ("head", 1), ("embedding", 2), ("head", 2)}
    assert {c.op for c in p.collectives} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert all(lp.samples for lp in p.layers) and all(c.samples for c in p.collectives)
    assert {(sp.kind, sp.group, sp.ranks) for sp in p.strategies} == \
        {("none", 1, 2)} | {(k, 2, 2) for k in ("tp", "tp_sp", "cp", "zero3")}
    for sp in p.strategies:  # wall time of a block under the runtime's parallelisation: more than nothing
        assert len(sp.samples) == 3 and sp.forward.at(128, 64) > 0 and sp.backward.at(128, 64) > 0, sp
        assert sp.embedding is not None and sp.head is not None and len(sp.head.samples) == 3
        assert sp.optimizer is not None and len(sp.optimizer.samples) == 2 and sp.optimizer.at(1e6) > 0
    assert p.optimizer is not None and p.optimizer.at(1e6) > 0 and len(p.optimizer.samples) == 3
    assert load_profile(path) == p  # the file is the whole profile
    for words in ("layers", "collectives", "overlap", "parallel strategy", "optimizer step", "written to"):
        assert words in stdout


def test_a_profile_applies_to_its_device_type_only(measured) -> None:
    p = load_profile(measured[0])
    expect_error(lambda: calibrate(p, dgx(1, 8, "A100-80GB")), "'CPU'", "'A100-80GB'")


@pytest.mark.parametrize("content,needle", [
    (None, "cannot read profile"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a profile object"),
    (json.dumps({"version": 99}), "schema version 99"),
    (json.dumps({"version": PROFILE_VERSION, "device": {"kind": "tpu"}}), "device"),
])
def test_bad_profiles_are_one_line_errors(tmp_path, content, needle) -> None:
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    expect_error(lambda: load_profile(path), needle)


def test_profile_needs_two_ranks() -> None:
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "profile", "--model", "tiny-llama", "--nproc", "1"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "--nproc" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "profile", "--model", "tiny-llama", "--dtype",
                           "fp16"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "--dtype must be fp32 or bf16" in proc.stderr
    assert "Traceback" not in proc.stderr


def _synthetic() -> Profile:
    device = Device(kind="cpu", gpu_type="CPU", name="test", cores=2, memory_bytes=8 * 2**30, peak_flops=1e11,
                    memory_bandwidth=1e10, torch="2.13")
    curve = Curve(intercept_s=1e-4, per_token_s=1e-6, per_token_seq_s=1e-9)
    block = LayerProfile(model="tiny-llama", tp=1, forward=curve, backward=curve.model_copy(
        update={"per_token_s": 2e-6}), activation_bytes_per_token=1000.0)
    full = block.model_copy(update={"recompute": "full", "backward": curve.model_copy(update={"per_token_s": 3e-6}),
                                    "activation_bytes_per_token": 512.0})
    ar = CollectiveCurve(op="all_reduce", ranks=2, latency_s=1e-4, bandwidth=1e9)
    return Profile(device=device, process_bytes=300 * 2**20, layers=(block, full), collectives=(ar,))


def test_the_cost_model_prefers_measured_costs() -> None:
    p = _synthetic()
    cluster, cal = calibrate(p, profiled_cluster(p, "1x2xCPU"))
    assert cluster.gpu.name == "CPU" and cluster.gpu.peak_flops == 1e11
    spec = PRESETS["tiny-llama"]
    prec = PRECISIONS["fp32"]
    ctx = BlockContext.for_ranks(spec, cluster, cal, prec, 64, 2, Strategy(), (0,), (0,))
    bt = block_time(ctx.model.block, Strategy(), ctx)
    tokens = 2 * 64
    assert bt.forward == pytest.approx(1e-4 + 1e-6 * tokens + 1e-9 * tokens * 64)
    assert bt.backward == pytest.approx(1e-4 + 2e-6 * tokens + 1e-9 * tokens * 64)
    full = block_time(ctx.model.block, Strategy(recompute="full"), ctx)
    assert full.recompute == pytest.approx(1e-6 * tokens)  # measured backward with recompute less without
    assert block_activation_bytes(ctx.model.block, Strategy(recompute="full"), ctx) == pytest.approx(512 * tokens)
    group = GroupShape.of((0, 1), 2)
    assert comm.all_reduce(1e6, group, cluster, cal) == pytest.approx(1e-4 + 1e6 / 1e9)
    assert comm.all_gather(1e6, group, cluster, cal) > 0  # not measured: the analytic model on the fitted link
    report = simulate(uniform_plan("dp=2,gbs=4,precision=fp32", spec, cluster, 64), spec, cluster, cal=cal)
    assert all(d.memory.reserve >= 300 * 2**20 for d in report.devices)
    # four ranks on two cores: each computes at half speed
    crowded, crowded_cal = calibrate(p, profiled_cluster(p, "1x4xCPU"))
    ctx4 = BlockContext.for_ranks(spec, crowded, crowded_cal, prec, 64, 2, Strategy(), (0,), (0,))
    assert block_time(ctx4.model.block, Strategy(), ctx4).forward == pytest.approx(2 * bt.forward)
    assert crowded.gpu.peak_flops == 0.5e11
    with pytest.raises(PlaitError, match="one node"):
        profiled_cluster(p, "2x2xCPU")
    assert profiled_cluster(p, "1x8xA100-80GB") is None


def test_mixture_of_experts_layers_are_priced_from_their_measured_shards() -> None:
    """tiny-moe: its dense first layer is the trunk (shape ""), its MoE layers are found by their fingerprint
    and expert-parallel width; the busiest rank's extra load is priced on top, unmeasured widths fall back."""
    spec = PRESETS["tiny-moe"]
    dense, moe = spec.stack[0], spec.stack[1]
    assert dense == spec.block and moe.kind == "moe" and moe.fingerprint != dense.fingerprint
    base = _synthetic()
    curve = Curve(intercept_s=2e-4, per_token_s=3e-6)
    moe_layers = tuple(LayerProfile(model="tiny-moe", tp=1, shape=moe.fingerprint, ep=ep, forward=curve,
                                    backward=curve.model_copy(update={"per_token_s": 5e-6 / ep}),
                                    activation_bytes_per_token=2000.0 / ep) for ep in (1, 2))
    trunk = tuple(lp.model_copy(update={"model": "tiny-moe"}) for lp in base.layers)
    p = base.model_copy(update={"layers": trunk + moe_layers})
    cluster, cal = calibrate(p, profiled_cluster(p, "1x2xCPU"))
    prec = PRECISIONS["fp32"]
    tokens = 2 * 64

    def ctx(s: Strategy, load: float = 1.0) -> BlockContext:
        return BlockContext.for_ranks(spec, cluster, cal, prec, 64, 2, s, (0, 1), (0, 1), expert_load=load)

    for ep in (1, 2):
        s = Strategy(dp=2, ep=ep)
        t = block_time(moe, s, ctx(s))
        assert t.forward == pytest.approx(2e-4 + 3e-6 * tokens)
        assert t.backward == pytest.approx(2e-4 + 5e-6 / ep * tokens)
        assert block_activation_bytes(moe, s, ctx(s)) == pytest.approx(2000.0 / ep * tokens)
        assert (t.ep_comm > 0) == (ep > 1)  # the token exchange stays priced from the collectives
    assert block_time(dense, Strategy(dp=2), ctx(Strategy(dp=2))).forward == pytest.approx(
        1e-4 + 1e-6 * tokens + 1e-9 * tokens * 64)
    s = Strategy(dp=2, ep=2)
    loaded = block_time(moe, s, ctx(s, load=1.5))
    assert loaded.forward > block_time(moe, s, ctx(s)).forward  # the busiest rank's extra rows, analytic
    assert block_activation_bytes(moe, s, ctx(s, load=1.5)) > 2000.0 / 2 * tokens
    unmeasured = Strategy(tp=2, sp=True)  # no tp=2 shard of the MoE layer in this profile
    assert block_time(moe, unmeasured, ctx(unmeasured)).forward != pytest.approx(2e-4 + 3e-6 * tokens)
    # with its tp=2 shard and the trunk timed under tp=2: the MoE layer's attention machinery is the trunk's
    trunk_tp = trunk[0].model_copy(update={"tp": 2})
    moe_tp = moe_layers[0].model_copy(update={"tp": 2})
    timed = Curve(intercept_s=5e-3, per_token_s=2e-5)
    tp_run = StrategyProfile(model="tiny-moe", kind="tp", group=2, ranks=2, forward=timed, backward=timed)
    p2 = p.model_copy(update={"layers": (*p.layers, trunk_tp, moe_tp), "strategies": (tp_run,)})
    cluster2, cal2 = calibrate(p2, profiled_cluster(p2, "1x2xCPU"))
    s = Strategy(tp=2)
    c2 = BlockContext.for_ranks(spec, cluster2, cal2, prec, 64, 2, s, (0, 1), (0,))
    dense_t, moe_t = block_time(dense, s, c2), block_time(moe, s, c2)
    assert moe_t.forward == pytest.approx(2e-4 + 3e-6 * tokens)
    assert moe_t.tp_comm == pytest.approx(dense_t.tp_comm) and moe_t.tp_comm > 0
    # the MoE layer timed under ep=2 as the runtime runs it: the exchange is that wall time less the ep=2
    # shard's compute, in place of the collectives' price; not with another layer's timing
    ep_timed = Curve(intercept_s=3e-3, per_token_s=1e-5)
    ep_run = StrategyProfile(model="tiny-moe", kind="ep", group=2, ranks=2, shape=moe.fingerprint,
                             forward=ep_timed, backward=ep_timed.model_copy(update={"per_token_s": 2e-5}))
    s = Strategy(dp=2, ep=2)
    for run, measured in ((ep_run, True), (ep_run.model_copy(update={"shape": "other"}), False)):
        p3 = p.model_copy(update={"strategies": (run,)})
        cluster3, cal3 = calibrate(p3, profiled_cluster(p3, "1x2xCPU"))
        t = block_time(moe, s, BlockContext.for_ranks(spec, cluster3, cal3, prec, 64, 2, s, (0, 1), (0, 1)))
        added = (3e-3 + 1e-5 * tokens - (2e-4 + 3e-6 * tokens),
                 3e-3 + 2e-5 * tokens - (2e-4 + 5e-6 / 2 * tokens))
        assert (t.ep_comm == pytest.approx(sum(added))) == measured
        assert (t.forward_comm == pytest.approx(added[0])) == measured
        assert t.forward == pytest.approx(2e-4 + 3e-6 * tokens)  # the compute stays the measured shard's
    # experts split otherwise than the attention: the shard of the same rows per expert and FLOPs
    assert [measured_ep(Strategy(**kw)) for kw in ({"dp": 2, "ep": 2}, {"dp": 2, "tp": 2, "ep": 2},
                                                  {"dp": 2, "tp": 2, "ep": 4, "etp": 1},
                                                  {"dp": 4, "tp": 4, "ep": 2, "etp": 1})] == [2, 2, 2, 0]


def test_profiling_a_mixture_of_experts_model_measures_each_layer_and_expert_shard(tmp_path) -> None:
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "-m", "plait.cli", "profile", "--nproc", "2", "--quick", "--model"]
    proc = subprocess.run([*cmd, "tiny-moe", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    p = load_profile(out)
    spec = PRESETS["tiny-moe"]
    moe = spec.stack[1].fingerprint
    assert {(lp.shape, lp.tp, lp.ep) for lp in p.layers} == {
        (shape, tp, ep) for tp in (1, 2) for shape, ep in (("", 1), (moe, 1), (moe, 2))}
    assert {sp.kind for sp in p.strategies} >= {"none", "tp", "zero3", "ep"}  # on stacks of the trunk layer,
    assert {sp.shape for sp in p.strategies if sp.kind == "ep"} == {moe}  # for ep of the MoE layer
    assert {sp.shape for sp in p.strategies if sp.kind != "ep"} == {""}
    assert f"layer {moe}" in proc.stdout
    cluster, cal = calibrate(p, profiled_cluster(p, "1x2xCPU"))
    plan = uniform_plan("dp=2,ep=2,gbs=4,precision=fp32", spec, cluster, 128)
    report = simulate(plan, spec, cluster, cal=cal)
    assert report.iteration_time_s > 0
    bad = subprocess.run([*cmd, "tiny-t5", "--out", str(tmp_path / "t5.json")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "profile its text model" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "t5.json").exists()


def test_measured_strategies_and_optimizer_replace_the_analytic_terms() -> None:
    """A block under tp/zero3 as the runtime ran it: what the timing adds to the shard's compute is the
    block's tp (zero) communication; measured with other busy-rank counts it is stretched by core sharing;
    the optimizer step is the measured curve at the rank's parameters."""
    spec = PRESETS["tiny-llama"]
    base = _synthetic()
    tp_block = base.layers[0].model_copy(update={"tp": 2})
    timed = Curve(intercept_s=5e-3, per_token_s=2e-5)
    local_head = EdgeProfile(model="tiny-llama", part="head", tp=2, forward=Curve(per_token_s=1e-6),
                             backward=Curve(per_token_s=1e-6))
    head = local_head.model_copy(update={"forward": Curve(intercept_s=2e-3, per_token_s=1e-6)})
    strategies = (StrategyProfile(model="tiny-llama", kind="tp", group=2, ranks=2, forward=timed, backward=timed,
                                  head=head, optimizer=OptimizerCurve(per_param_s=5e-8)),
                  StrategyProfile(model="tiny-llama", kind="zero3", group=2, ranks=2, forward=timed, backward=timed))
    p = base.model_copy(update={"layers": (*base.layers, tp_block), "edges": (local_head,), "strategies": strategies,
                                "optimizer": OptimizerCurve(intercept_s=0.01, per_param_s=1e-8)})
    cluster, cal = calibrate(p, profiled_cluster(p, "1x2xCPU"))
    prec = PRECISIONS["fp32"]
    tokens = 2 * 64
    local = 1e-4 + 1e-6 * tokens + 1e-9 * tokens * 64
    ctx = BlockContext.for_ranks(spec, cluster, cal, prec, 64, 2, Strategy(tp=2), (0, 1), (0,))
    bt = block_time(ctx.model.block, Strategy(tp=2), ctx)
    assert bt.forward == pytest.approx(local)
    assert bt.forward_total == pytest.approx(5e-3 + 2e-5 * tokens)  # the measured wall time
    assert bt.tp_comm == pytest.approx(2 * (5e-3 + 2e-5 * tokens - local) - (2e-6 - 1e-6) * tokens)
    full = block_time(ctx.model.block, Strategy(tp=2, recompute="full"), ctx)  # recompute repeats the forward's communication
    assert full.tp_comm == pytest.approx(bt.tp_comm + (bt.forward_total - bt.forward))
    ctx_z = BlockContext.for_ranks(spec, cluster, cal, prec, 64, 2, Strategy(dp=2, zero=3), (0, 1), (0, 1))
    zt = block_time(ctx_z.model.block, Strategy(dp=2, zero=3), ctx_z)
    assert zt.forward_total == pytest.approx(5e-3 + 2e-5 * tokens) and zt.tp_comm == 0
    # measured with 2 busy ranks, used on a node of 4 ranks sharing 2 cores: twice as slow
    crowded, crowded_cal = calibrate(p, profiled_cluster(p, "1x4xCPU"))
    ctx4 = BlockContext.for_ranks(spec, crowded, crowded_cal, prec, 64, 2, Strategy(tp=2), (0, 1), (0,))
    assert block_time(ctx4.model.block, Strategy(tp=2), ctx4).forward_total == pytest.approx(2 * (5e-3 + 2e-5 * tokens))
    assert head_time(Strategy(tp=2), ctx).tp_comm == pytest.approx(2e-3)  # measured head less its compute
    plan = uniform_plan("dp=2,gbs=4,precision=fp32", spec, cluster, 64)
    report = simulate(plan, spec, cluster, cal=cal)
    assert report.devices[0].parts["optimizer"] == pytest.approx(0.01 + 1e-8 * spec.params, rel=1e-3)
    tp_report = simulate(uniform_plan("tp=2,gbs=4,precision=fp32", spec, cluster, 64), spec, cluster, cal=cal)
    assert tp_report.devices[0].parts["optimizer"] == pytest.approx(5e-8 * spec.params / 2, rel=0.05)  # DTensor rate


def test_a_prediction_is_the_sum_of_the_profiled_terms(measured) -> None:
    """With a real profile, one rank's step time is computed from the profile exactly: micro-batches x (layers x
    the measured block's forward + backward + the measured embedding and head) + the measured optimizer step.
    How close that comes to real runs drifts with this shared machine's load, so it is reported by
    benchmarks/predicted_vs_measured.py, not asserted here."""
    p = load_profile(measured[0])
    spec = PRESETS["tiny-llama"]
    cluster, cal = calibrate(p, profiled_cluster(p, "1x1xCPU"))
    plan = uniform_plan("dp=1,gbs=8,mbs=2,precision=fp32", spec, cluster, 64)
    report = simulate(plan, spec, cluster, cal=cal)
    tokens, seq = 2 * 64, 64
    block = next(lp for lp in p.layers if lp.tp == 1 and lp.recompute == "none")
    edges = [e for e in p.edges if e.tp == 1]
    assert {e.part for e in edges} == {"embedding", "head"}
    per_micro_batch = (spec.layers * (block.forward.at(tokens, seq) + block.backward.at(tokens, seq))
                       + sum(e.forward.at(tokens, seq) + e.backward.at(tokens, seq) for e in edges))
    plain = next(sp for sp in p.strategies if sp.kind == "none")  # a plain block (and step) on each busy rank
    assert plain.optimizer is not None
    optimizer = plain.optimizer.at(spec.params)
    assert plan.pipelines[0].micro_batches == 4
    assert report.breakdown["compute"] == pytest.approx(4 * per_micro_batch, rel=1e-9)
    assert report.breakdown["optimizer"] == pytest.approx(optimizer, rel=1e-9)
    assert report.iteration_time_s == pytest.approx(4 * per_micro_batch + optimizer, rel=1e-9)


def test_a_rank_computes_as_slowly_as_measured_with_its_neighbours_busy() -> None:
    """A plain block timed with every rank of the node busy sets how much slower each rank computes than
    alone; without that timing, the node's core sharing does."""
    spec = PRESETS["tiny-llama"]
    base = _synthetic()
    block = base.layers[0]
    busy = StrategyProfile(model="tiny-llama", kind="none", group=1, ranks=2,
                           forward=block.forward.model_copy(update={"per_token_s": 3e-6}),
                           backward=block.backward.model_copy(update={"per_token_s": 6e-6}))
    p = base.model_copy(update={"strategies": (busy,)})
    prec, tokens = PRECISIONS["fp32"], 2 * 64
    for profile, expected in ((base, 1.0), (p, None)):
        cluster, cal = calibrate(profile, profiled_cluster(profile, "1x2xCPU"))
        ctx = BlockContext.for_ranks(spec, cluster, cal, prec, 64, 2, Strategy(), (0,), (0,))
        bt = block_time(ctx.model.block, Strategy(), ctx)
        alone = block.forward.at(tokens, 64) + block.backward.at(tokens, 64)
        together = busy.forward.at(tokens, 64) + busy.backward.at(tokens, 64)
        factor = expected if expected is not None else together / alone
        assert bt.forward + bt.backward == pytest.approx(factor * alone)


def test_ranks_sharing_cores_compute_faster_while_others_idle_in_bubbles() -> None:
    """Contention is linear in the ranks busy at once between the profile's points (1 alone, 2 and 4 busy);
    a pipeline's stages compute at the contention of its average busy ranks, a plan keeping every rank busy at
    the node's full contention."""
    spec = PRESETS["tiny-llama"]
    base = _synthetic()
    block = base.layers[0]
    tokens = 2 * 64
    alone = block.forward.at(tokens, 64) + block.backward.at(tokens, 64)

    def busy(ranks: int, factor: float) -> StrategyProfile:
        return StrategyProfile(model="tiny-llama", kind="none", group=1, ranks=ranks,
                               forward=Curve(intercept_s=0.0, per_token_s=factor * block.forward.at(tokens, 64) /
                                             tokens),
                               backward=Curve(intercept_s=0.0, per_token_s=factor * block.backward.at(tokens, 64) /
                                              tokens))

    p = base.model_copy(update={"strategies": (busy(2, 1.4), busy(4, 3.6))})
    cluster, cal = calibrate(p, profiled_cluster(p, "1x4xCPU"))
    at = [cal.measured.contention_at("tiny-llama", tokens, 64, b) for b in (1.0, 2.0, 3.0, 4.0, 5.0)]
    assert at == pytest.approx([1.0, 1.4, 2.5, 3.6, 3.6])
    assert cal.measured.contention("tiny-llama", tokens, 64) == pytest.approx(3.6)
    dp = simulate(uniform_plan("dp=4,pp=1,gbs=8,precision=fp32", spec, cluster, 64), spec, cluster, cal=cal)
    assert dp.pipelines[0].busy_s[0] == pytest.approx(dp.pipelines[0].makespan_s)  # every rank busy: no relief
    pp = simulate(uniform_plan("pp=4,mbs=2,gbs=8,precision=fp32,p2p=async", spec, cluster, 64), spec, cluster,
                  cal=cal)  # exchanges that do not hold the device: the busy fraction is compute alone
    # 4 one-layer stages, 4 micro-batches: a device computes in fewer than 4 of 7 slots (the end stages hold
    # the embedding and the head), so a busy rank sees 1 + 3 u busy ranks (u: the mean busy fraction); a
    # middle stage's block runs at that contention instead of the full 3.6
    res = pp.pipelines[0]
    u = sum(res.busy_s) / (4 * res.makespan_s)
    assert 0.4 < u < 4 / 7
    middle = res.busy_s[1] / 4 / alone
    assert middle == pytest.approx(float(np.interp(1 + 3 * u, [1, 2, 4], [1.0, 1.4, 3.6])), rel=0.05)
