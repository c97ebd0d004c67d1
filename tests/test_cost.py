"""Cost terms against hand-computed values."""

from __future__ import annotations

import math

import pytest

from plait.cost import comm
from plait.cost.calibration import DEFAULT_CALIBRATION as CAL
from plait.cost.comm import GroupShape
from plait.cost.compute import (TRITON_FLASH_BWD_SLOWDOWN, TRITON_FLASH_FWD_SLOWDOWN, elementwise_time,
                                flash_attention_time, gemm_time)
from plait.cost.layer import BlockContext, block_activation_bytes, block_time
from plait.cost.memory import model_state_bytes
from plait.cost.precision import PRECISIONS
from plait.plan import Strategy
from plait.spec.cluster import GB, dgx
from plait.spec.model import ModelSpec

A100 = dgx(2, 8, "A100-80GB")
BF16 = PRECISIONS["bf16"]
PEAK = A100.gpu.peak_flops


def test_large_gemm_runs_at_calibrated_efficiency() -> None:
    m, n, k = 108 * 128 * 4, 128 * 8, 8192  # exactly 32 full waves of 128x128 tiles
    t = gemm_time(m, n, k, A100.gpu, CAL, PEAK, 2)
    expected = 2 * m * n * k / (PEAK * CAL.gemm_efficiency * k / (k + CAL.gemm_k_overhead)) + CAL.kernel_overhead_s
    assert t == pytest.approx(expected, rel=1e-12)


def test_gemm_efficiency_falls_for_small_matrices() -> None:
    def tflops(m: int, n: int, k: int) -> float:
        return 2 * m * n * k / gemm_time(m, n, k, A100.gpu, CAL, PEAK, 2) / 1e12

    sizes = [64, 256, 1024, 4096, 16384]
    rates = [tflops(s, s, s) for s in sizes]
    assert rates == sorted(rates)
    assert rates[0] < 0.1 * rates[-1]
    assert rates[-1] < PEAK / 1e12 * CAL.gemm_efficiency
    # A partial last wave costs a whole wave: 112 tiles on 108 SMs take two waves.
    one_wave = gemm_time(27 * 128, 4 * 128, 8192, A100.gpu, CAL, PEAK, 2)
    two_waves = gemm_time(27 * 128 + 1, 4 * 128, 8192, A100.gpu, CAL, PEAK, 2)
    assert two_waves - CAL.kernel_overhead_s == pytest.approx(2 * (one_wave - CAL.kernel_overhead_s), rel=1e-3)


def test_tiny_gemm_is_memory_bound() -> None:
    # [1, 8192] @ [8192, 8192]: the weight read dominates.
    t = gemm_time(1, 8192, 8192, A100.gpu, CAL, PEAK, 2)
    bytes_moved = 2 * (8192 + 8192 * 8192 + 8192)
    assert t == pytest.approx(bytes_moved / (A100.gpu.hbm_bandwidth * CAL.memory_efficiency) + CAL.kernel_overhead_s)


def test_elementwise_is_bandwidth_bound() -> None:
    assert elementwise_time(1e9, A100.gpu, CAL, kernels=0) == pytest.approx(1e9 / (2039e9 * 0.8))


def test_group_shape_of_ranks() -> None:
    assert GroupShape.of(range(8), 8) == GroupShape(8, 1, 8)
    assert GroupShape.of(range(0, 64, 8), 8) == GroupShape(8, 8, 1)
    assert GroupShape.of([0, 1, 8, 9, 16], 8) == GroupShape(5, 3, 2)


def test_all_reduce_inside_a_node_uses_nvlink() -> None:
    g = GroupShape(8, 1, 8)
    nbytes = 1e9
    bus = 300 * GB * CAL.nvlink_efficiency
    latency = 2 * 7 * A100.intra.latency
    assert comm.all_reduce(nbytes, g, A100, CAL) == pytest.approx(2 * 7 / 8 * nbytes / bus + latency)
    assert comm.all_gather(nbytes, g, A100, CAL) == pytest.approx(7 / 8 * nbytes / bus + latency / 2)
    assert comm.all_reduce(nbytes, GroupShape(1, 1, 1), A100, CAL) == 0.0


def test_all_reduce_across_nodes_uses_one_nic_per_member() -> None:
    cluster = dgx(8, 8, "A100-80GB")
    one_per_node = GroupShape(8, 8, 1)  # e.g. a data-parallel group when tp = 8
    nic = 25 * GB * CAL.network_efficiency
    lat = 2 * math.ceil(math.log2(8)) * cluster.inter.latency
    assert comm.all_reduce(1e9, one_per_node, cluster, CAL) == pytest.approx(2 * 7 / 8 * 1e9 / nic + lat)
    # Eight members per node drive eight NICs: bus bandwidth 8 x NIC (below NVLink's).
    full = GroupShape(64, 8, 8)
    assert comm.bus_bandwidth(full, cluster, CAL) == pytest.approx(8 * nic)
    assert comm.all_reduce(1e9, full, cluster, CAL) < comm.all_reduce(1e9, one_per_node, cluster, CAL)


def test_all_to_all_and_p2p() -> None:
    g = GroupShape(16, 2, 8)  # half of each rank's data leaves the node
    nic = 25 * GB * CAL.network_efficiency
    assert comm.all_to_all(1e9, g, A100, CAL) == pytest.approx(8 / 16 * 1e9 / nic + A100.inter.latency)
    assert comm.p2p(1e6, True, A100, CAL) == pytest.approx(1e6 / nic + A100.inter.latency)
    assert comm.p2p(1e6, False, A100, CAL) < comm.p2p(1e6, True, A100, CAL)


GPT22B = ModelSpec(name="22b", family="gpt", layers=48, hidden=6144, heads=64, vocab=51200, attention="eager")


def _ctx(model: ModelSpec, s: Strategy, seqs: int = 1, seq: int = 2048, prec: str = "fp16") -> BlockContext:
    tp = GroupShape(s.tp, 1, s.tp) if s.tp > 1 else comm.SINGLE
    dp = GroupShape(s.dp, s.dp, 1) if s.dp > 1 else comm.SINGLE
    return BlockContext(model, A100, CAL, PRECISIONS[prec], seq, seqs, tp, comm.SINGLE, dp)


@pytest.mark.parametrize("sp,recompute,formula", [
    (False, "none", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (True, "none", lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    (True, "selective", lambda s, b, h, a, t: 34 * s * b * h / t),
    (False, "full", lambda s, b, h, a, t: 2 * s * b * h),
    (True, "full", lambda s, b, h, a, t: 2 * s * b * h / t),
    # gemm_kept: the input 2h (/t with sp), qkv 6h/t and MLP-up 8h/t sharded, the two row-parallel outputs
    # 2h each whole on every rank (partial sums before the reduce)
    (True, "gemm_kept", lambda s, b, h, a, t: s * b * h * (16 / t + 4)),
    (False, "gemm_kept", lambda s, b, h, a, t: s * b * h * (2 + 14 / t + 4)),
])
def test_activation_bytes_match_korthikanti(sp: bool, recompute: str, formula) -> None:
    t, b, s = 8, 4, 2048
    st = Strategy(tp=t, sp=sp, recompute=recompute)
    got = block_activation_bytes(GPT22B.block, st, _ctx(GPT22B, st, seqs=b, seq=s))
    assert got == pytest.approx(formula(s, b, GPT22B.hidden, GPT22B.heads, t), rel=1e-9)


def test_flash_attention_stores_no_scores() -> None:
    flash = GPT22B.with_(attention="flash")
    st = Strategy(tp=8, sp=True)
    eager_bytes = block_activation_bytes(GPT22B.block, st, _ctx(GPT22B, st))
    flash_bytes = block_activation_bytes(flash.block, st, _ctx(flash, st))
    assert flash_bytes < eager_bytes
    # Doubling the sequence doubles flash activations per sequence (no s^2 term).
    assert block_activation_bytes(flash.block, st, _ctx(flash, st, seq=4096)) == pytest.approx(2 * flash_bytes, rel=0.01)


def test_triton_flash_attention_is_slower_and_pads_the_head_dimension() -> None:
    """The Triton FlashAttention: forward 1.4x, backward 2x FlashAttention-2's time (Dao 2023, Section 4.1);
    a head_dim of 112 is computed as 128."""
    peak = 312e12
    args = (64, 8192, 8192, 128, True, CAL, peak)
    (ff, fb), (tf, tb) = flash_attention_time(*args), flash_attention_time(*args, "triton")
    k = CAL.kernel_overhead_s
    assert (tf - k) / (ff - k) == pytest.approx(TRITON_FLASH_FWD_SLOWDOWN) == pytest.approx(1.4)
    assert (tb - k) / (fb - k) == pytest.approx(TRITON_FLASH_BWD_SLOWDOWN) == pytest.approx(2.0)
    padded, _ = flash_attention_time(64, 8192, 8192, 112, True, CAL, peak, "triton")
    assert padded == tf
    unpadded, _ = flash_attention_time(64, 8192, 8192, 112, True, CAL, peak)
    assert (unpadded - k) / (ff - k) == pytest.approx(112 / 128)
    # Same activations as FlashAttention-2: no score matrix, one log-sum-exp per query and head.
    st = Strategy(tp=8, sp=True)
    flash, triton = GPT22B.with_(attention="flash"), GPT22B.with_(attention="triton")
    assert block_activation_bytes(triton.block, st, _ctx(triton, st)) == \
        block_activation_bytes(flash.block, st, _ctx(flash, st))
    assert block_time(triton.block, st, _ctx(triton, st)).backward > block_time(flash.block, st, _ctx(flash, st)).backward


def test_model_state_bytes_per_zero_stage() -> None:
    p, dp = 1e9, 8
    assert model_state_bytes(p, dp, 0, BF16) == (2e9, 4e9, 12e9)
    assert model_state_bytes(p, dp, 1, BF16) == (2e9, 4e9, 12e9 / 8)
    assert model_state_bytes(p, dp, 2, BF16) == (2e9, 4e9 / 8, 12e9 / 8)
    # ZeRO-3 (FSDP): the sharded weights are the fp32 master copy; 16 bytes per parameter in all, not 18.
    assert model_state_bytes(p, dp, 3, BF16) == (4e9 / 8, 4e9 / 8, 8e9 / 8)
    assert sum(model_state_bytes(p, 1, 3, BF16)) == 16e9
    # Offloaded, the master copy goes to the host with the moments and the 16-bit shard stays.
    assert model_state_bytes(p, dp, 3, BF16, offload=True) == (2e9 / 8, 4e9 / 8, 12e9 / 8)
    fp32 = PRECISIONS["fp32"]
    assert model_state_bytes(p, dp, 3, fp32) == (4e9 / 8, 4e9 / 8, 8e9 / 8)
    # Pure bf16 (AutoModel): no master copy; bf16 weights, gradients and Adam moments, 8 bytes per parameter.
    pure = PRECISIONS["bf16-pure"]
    assert model_state_bytes(p, dp, 0, pure) == (2e9, 2e9, 4e9)
    assert model_state_bytes(p, dp, 1, pure) == (2e9, 2e9, 4e9 / 8)
    assert model_state_bytes(p, dp, 2, pure) == (2e9, 2e9 / 8, 4e9 / 8)
    assert model_state_bytes(p, dp, 3, pure) == (2e9 / 8, 2e9 / 8, 4e9 / 8)


def test_block_time_terms() -> None:
    base = block_time(GPT22B.block, Strategy(), _ctx(GPT22B, Strategy()))
    assert base.tp_comm == 0 and base.cp_comm == 0 and base.zero_comm == 0 and base.recompute == 0
    assert base.backward == pytest.approx(2 * base.forward, rel=0.15)  # backward is about twice forward
    tp = Strategy(tp=8)
    t8 = block_time(GPT22B.block, tp, _ctx(GPT22B, tp))
    assert t8.forward < base.forward / 6  # 8-way split, a little efficiency lost
    one = comm.all_reduce(2048 * 6144 * 2, GroupShape(8, 1, 8), A100, CAL)
    assert t8.tp_comm == pytest.approx(4 * one)  # 2 forward + 2 backward all-reduces
    full = Strategy(tp=8, recompute="full")
    tf = block_time(GPT22B.block, full, _ctx(GPT22B, full))
    assert tf.recompute == pytest.approx(tf.forward)
    assert tf.tp_comm == pytest.approx(6 * one)
    sel = Strategy(tp=8, sp=True, recompute="selective")
    ts = block_time(GPT22B.block, sel, _ctx(GPT22B, sel))
    assert 0 < ts.recompute < 0.3 * ts.forward  # Korthikanti Table 4: ~17% for 22B
    assert ts.forward < t8.forward  # sequence parallelism shards norms and dropout


def test_zero3_gathers_are_hidden_by_compute_when_cheap() -> None:
    """Hidden gathers and reduce-scatters cost only the compute they slow (overlap_contention) and the
    runtime's fixed overhead per collective; a starved layer also waits for the transfer."""
    small_dp = Strategy(dp=2, zero=3)
    ctx = _ctx(GPT22B, small_dp, seqs=8)
    t = block_time(GPT22B.block, small_dp, ctx)
    params = GPT22B.block.params
    gather = comm.all_gather(params * ctx.prec.param, ctx.dp_group, A100, CAL)
    rs = comm.reduce_scatter(params * ctx.prec.grad, ctx.dp_group, A100, CAL)
    assert gather + rs < t.forward  # 2 x 450 MB over 2 nodes fits inside 8 sequences of compute
    hidden = CAL.overlap_contention * (2 * gather + rs) + 3 * CAL.fsdp_collective_overhead_s
    assert t.zero_comm == pytest.approx(hidden)
    starved = Strategy(dp=64, zero=3)
    ctx = BlockContext(GPT22B, dgx(64, 8, "A100-80GB"), CAL, BF16, 2048, 1, comm.SINGLE, comm.SINGLE,
                       GroupShape(64, 64, 1))
    assert block_time(ctx.model.block, starved, ctx).zero_comm > 0.0


def test_hsdp_shards_inside_the_node_and_all_reduces_the_shards_across_replicas() -> None:
    from plait.cost.layer import hsdp_all_reduce
    from plait.cost.precision import plan_precision
    from plait.cost.price import price

    m = ModelSpec(name="m", family="gpt", layers=4, hidden=4096, heads=32, vocab=32000, max_seq_len=2048)
    ranks = tuple(range(16))  # two nodes of 8

    def ctx(s: Strategy, prec=BF16) -> BlockContext:
        return BlockContext.for_ranks(m, A100, CAL, prec, 2048, 1, s, ranks, s.degrees.group(ranks, "data"))

    hsdp, fsdp, shard8 = Strategy(dp=16, zero=3, shard=8), Strategy(dp=16, zero=3), Strategy(dp=8, zero=3)
    c = ctx(hsdp)
    assert c.dp_group == GroupShape(8, 1, 8) and c.replica_group == GroupShape(2, 2, 1)
    assert ctx(fsdp).dp_group == GroupShape(16, 2, 8) and ctx(fsdp).replica_group == comm.SINGLE
    block, params = m.block, m.block.params
    h, f = price(block, hsdp, c), price(block, fsdp, ctx(fsdp))
    # The weights are the fp32 master shard (cost/memory.py), the optimizer the Adam moments.
    assert h.weights == pytest.approx(params * 4 / 8) and f.weights == pytest.approx(params * 4 / 16)
    assert h.optimizer == pytest.approx(params * 8 / 8)
    # The shard of 1/8 of the fp32 gradients, all-reduced over the two replicas across the network.
    assert hsdp_all_reduce(params, c) == pytest.approx(comm.all_reduce(params / 8 * 4, GroupShape(2, 2, 1), A100, CAL))
    # HSDP's collectives: a single node's FSDP ones plus that all-reduce (the same compute beside them).
    alone = BlockContext.for_ranks(m, A100, CAL, BF16, 2048, 1, shard8, ranks[:8], ranks[:8])
    assert h.time.zero_comm > price(block, shard8, alone).time.zero_comm
    # A bf16 reduce halves the bytes of every gradient reduction.
    half = ctx(hsdp, plan_precision("bf16", "bf16"))
    assert half.prec.reduce_bytes == 2 and BF16.reduce_bytes == 4
    assert hsdp_all_reduce(params, half) < hsdp_all_reduce(params, c)
    assert price(block, hsdp, half).time.zero_comm < h.time.zero_comm


def test_gemm_kept_reruns_the_core_the_elementwise_kernels_and_the_forward_collectives() -> None:
    """gemm_kept keeps the GEMM outputs: backward reruns the attention core and the elementwise kernels (the
    forward less its GEMMs) and the forward's tensor-parallel collectives; HFU counts the cores' FLOPs."""
    from plait.cost.price import recompute_flops_per_token

    st = {rc: Strategy(tp=8, sp=True, recompute=rc) for rc in ("none", "selective", "gemm_kept", "full")}
    t = {rc: block_time(GPT22B.block, s, _ctx(GPT22B, s)) for rc, s in st.items()}
    # 22B at tp8+sp, one 2048-token sequence: the core 0.308 ms and the elementwise kernels 0.076 ms of a
    # 1.493 ms forward (full recompute)
    assert t["selective"].recompute == pytest.approx(0.3076e-3, rel=1e-3)
    assert t["gemm_kept"].recompute == pytest.approx(0.3839e-3, rel=1e-3)
    assert t["full"].recompute == pytest.approx(1.4935e-3, rel=1e-3)
    assert t["gemm_kept"].tp_comm == t["full"].tp_comm == pytest.approx(1.5 * t["none"].tp_comm)
    assert recompute_flops_per_token(GPT22B.block, "gemm_kept", 2048) == \
        GPT22B.block.attention_flops_per_token(2048)
