"""Layer profiling (plait.profile.layers): block, embedding and head costs measured by differences of
models, their fitted curves, and the activation bytes saved for backward. CPU, quick settings."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import pytest
import torch
from helpers import expect_error

from plait.cost.profile_file import EdgeProfile, LayerProfile
from plait.profile.layers import fit_curve, measure_layers
from plait.runtime.memory import resident_bytes
from plait.spec.model import ModelSpec, load_model

QUICK_BUDGET_S = 30.0
"""The quick measurement of tiny-llama (2 shard widths x 3 recompute modes) must stay under this."""
FP32 = 4


class Measured(NamedTuple):
    layers: list[LayerProfile]
    edges: list[EdgeProfile]
    calls: list[tuple[int, int]]
    seconds: float
    threads: int


@pytest.fixture(scope="module")
def tiny_llama() -> Measured:
    """One quick measurement of tiny-llama, shared by the tests below, with its progress calls and time."""
    calls: list[tuple[int, int]] = []
    threads = torch.get_num_threads()
    start = time.perf_counter()
    layers, edges = measure_layers(load_model("tiny-llama"), quick=True,
                                   progress=lambda done, total: calls.append((done, total)))
    return Measured(layers, edges, calls, time.perf_counter() - start, threads)


def _layer(result: Measured, tp: int, mode: str) -> LayerProfile:
    (found,) = [p for p in result.layers if p.tp == tp and p.recompute == mode]
    return found


def _fwd_bwd(profile: LayerProfile) -> float:
    """Forward + backward seconds of a block summed over the micro-batches measured."""
    return sum(s.forward_s + s.backward_s for s in profile.samples)


def analytic_llama_bytes_per_token(spec: ModelSpec) -> int:
    """Bytes one Llama block saves for backward per token without recomputation, fp32, counted from the
    tensors autograd saves (SDPA's CPU flash kernel, GQA's repeat_interleave, RMSNorm decomposed):

        4 * (6 H            block input x, x * rstd, norm1 output; residual h, h * rstd, norm2 output
             + q_dim        q after RoPE
             + 2 heads D    k and v after repeat_interleave to every query head
             + q_dim        attention output (= wo input, the same storage)
             + heads        SDPA's log-sum-exp
             + 4 ffn        w1 output, w3 output, silu(w1 x), their product (= w2 input)
             + 2)           the two rstd

    tiny-llama (H=128, q_dim=128, heads=4, D=32, ffn=384): 4 * 2822 = 11288 bytes.
    """
    h, heads, d = spec.hidden, spec.heads, spec.head_dim
    return FP32 * (6 * h + spec.q_dim + 2 * heads * d + spec.q_dim + heads + 4 * spec.ffn + 2)


def test_measures_every_width_and_mode_quickly(tiny_llama: Measured) -> None:
    layers, edges = tiny_llama.layers, tiny_llama.edges
    assert {(p.tp, p.recompute) for p in layers} == {(tp, m) for tp in (1, 2)
                                                     for m in ("none", "selective", "full")}
    assert {(e.part, e.tp) for e in edges} == {(p, tp) for p in ("embedding", "head")
                                               for tp in (1, 2)}
    for profile in [*layers, *edges]:
        assert isinstance(profile, (LayerProfile, EdgeProfile)) and profile.model == "tiny-llama"
        assert len(profile.samples) == 3
    assert tiny_llama.calls == [(i, 11) for i in range(1, 12)]  # 1 warm-up + 9 timed rounds, bytes
    assert torch.get_num_threads() == tiny_llama.threads, "the thread count must be restored"
    assert tiny_llama.seconds < QUICK_BUDGET_S


def test_fit_curve_recovers_coefficients_and_stays_non_negative() -> None:
    points = [(1, 64), (4, 64), (1, 128), (2, 128), (1, 256), (2, 256)]
    tokens = [float(b * s) for b, s in points]
    seqs = [float(s) for _, s in points]
    truth = (2e-4, 3e-6, 5e-9)
    seconds = [truth[0] + truth[1] * t + truth[2] * t * s for t, s in zip(tokens, seqs)]
    curve = fit_curve(tokens, seqs, seconds)
    assert curve.intercept_s == pytest.approx(truth[0], rel=1e-6)
    assert curve.per_token_s == pytest.approx(truth[1], rel=1e-6)
    assert curve.per_token_seq_s == pytest.approx(truth[2], rel=1e-6)
    falling = fit_curve(tokens, seqs, [1e-3 - 1e-6 * t for t in tokens])
    assert min(falling.intercept_s, falling.per_token_s, falling.per_token_seq_s) >= 0.0


def test_block_curves_reproduce_their_samples(tiny_llama: Measured) -> None:
    for profile in tiny_llama.layers:
        for curve, field in ((profile.forward, "forward_s"), (profile.backward, "backward_s")):
            values = [getattr(s, field) for s in profile.samples]
            for s, y in zip(profile.samples, values):
                fit = curve.at(s.seqs * s.seq_len, s.seq_len)
                assert abs(fit - y) <= 0.25 * abs(y) + 0.05 * max(values), (profile.tp, profile.recompute, field,
                                                                            s, fit)


def test_doubling_tokens_roughly_doubles_block_forward() -> None:
    ratios = []
    for _ in range(3):  # the median of three profiles: one slow spell of this shared machine must not decide
        (profile,), _ = measure_layers(load_model("tiny-llama"), tps=(1,), recompute=("none",),
                                       points=((1, 128), (2, 128)), quick=True)
        small, large = profile.samples
        ratios.append(large.forward_s / small.forward_s)
        assert large.activation_bytes == 2 * small.activation_bytes
    assert 1.4 <= statistics.median(ratios) <= 3.0, ratios


def test_tp2_blocks_are_faster(tiny_llama: Measured) -> None:
    """Half the heads and half the MLP: less work per rank (a tiny block is partly per-op overhead, so the
    margin is modest: about 0.6-0.75 here)."""
    assert _fwd_bwd(_layer(tiny_llama, 2, "none")) < _fwd_bwd(_layer(tiny_llama, 1, "none"))


def test_full_recompute_backward_is_slower(tiny_llama: Measured) -> None:
    for tp in (1, 2):
        none, full = _layer(tiny_llama, tp, "none"), _layer(tiny_llama, tp, "full")
        assert sum(s.backward_s for s in full.samples) > 1.3 * sum(s.backward_s for s in none.samples)


def test_activation_bytes(tiny_llama: Measured) -> None:
    spec = load_model("tiny-llama")
    per_token = {(p.tp, p.recompute): p.activation_bytes_per_token for p in tiny_llama.layers}
    analytic = analytic_llama_bytes_per_token(spec)
    assert per_token[1, "none"] == pytest.approx(analytic, rel=0.25)
    # selective (Megatron-LM's) runs the attention core again from q, k, v: all is kept but the core's
    # fp32 log-sum-exp (one per head), which the profiler's count may already leave out
    assert per_token[1, "none"] - FP32 * spec.heads <= per_token[1, "selective"] <= per_token[1, "none"]
    for tp in (1, 2):
        assert per_token[tp, "full"] < 0.1 * per_token[tp, "none"]
        assert per_token[tp, "full"] == FP32 * spec.hidden  # only the block input survives
        assert per_token[tp, "full"] < per_token[tp, "selective"] <= per_token[tp, "none"]
    assert per_token[2, "none"] < per_token[1, "none"]
    for profile in tiny_llama.layers:
        for s in profile.samples:
            assert s.activation_bytes == pytest.approx(profile.activation_bytes_per_token * s.seqs * s.seq_len)


def test_edges_have_curves_and_bytes(tiny_llama: Measured) -> None:
    for edge in tiny_llama.edges:
        for curve in (edge.forward, edge.backward):
            assert min(curve.intercept_s, curve.per_token_s, curve.per_token_seq_s) >= 0.0
        assert all(s.activation_bytes > 0 for s in edge.samples)
    head = next(e for e in tiny_llama.edges if e.part == "head" and e.tp == 1)
    assert sum(s.forward_s + s.backward_s for s in head.samples) > 0.0


def test_gpt_with_tied_head_and_learned_positions() -> None:
    spec = load_model("tiny-gpt")
    layers, edges = measure_layers(spec, tps=(1,), recompute=("none", "full"),
                                   points=((1, 32), (2, 32), (1, 64)), quick=True)
    full = next(p for p in layers if p.recompute == "full")
    none = next(p for p in layers if p.recompute == "none")
    assert full.activation_bytes_per_token == FP32 * spec.hidden
    assert none.activation_bytes_per_token > 10 * full.activation_bytes_per_token
    assert {e.part for e in edges} == {"embedding", "head"}


def test_bf16_layers_keep_half_the_bytes_and_price_bf16_plans_as_measured() -> None:
    """`--dtype bf16`: the layers in bf16 keep about 60% of fp32's bytes for backward (RMSNorm computes in fp32
    and keeps fp32 tensors, attention's log-sum-exp is fp32); a bf16 plan takes a bf16 profile's bytes as they are, an fp32 one
    twice."""
    from plait.cost.layer import BlockContext, block_activation_bytes
    from plait.cost.measured import calibrate, profiled_cluster
    from plait.cost.precision import PRECISIONS
    from plait.cost.profile_file import CollectiveCurve, Device, Profile
    from plait.plan import Strategy

    spec = load_model("tiny-llama")
    kw = {"tps": (1,), "recompute": ("none",), "points": ((1, 32), (2, 32), (1, 64)), "quick": True}
    (fp32,), _ = measure_layers(spec, **kw)
    (bf16,), edges = measure_layers(spec, dtype="bf16", **kw)
    assert 0.5 < bf16.activation_bytes_per_token / fp32.activation_bytes_per_token < 0.7
    device = Device(kind="cpu", gpu_type="CPU", name="test", memory_bytes=2**33, peak_flops=1e11,
                    memory_bandwidth=1e10, torch="2.13")
    link = CollectiveCurve(op="all_reduce", ranks=2, latency_s=1e-4, bandwidth=1e9)
    profile = Profile(dtype="bf16", device=device, layers=(bf16,), edges=tuple(edges), collectives=(link,))
    cluster, cal = calibrate(profile, profiled_cluster(profile, "1x2xCPU"))
    assert cal.measured.element_bytes == 2
    for precision, factor in (("bf16", 1.0), ("fp32", 2.0)):
        ctx = BlockContext.for_ranks(spec, cluster, cal, PRECISIONS[precision], 64, 2, Strategy(), (0,), (0,))
        assert block_activation_bytes(spec.block, Strategy(), ctx) == pytest.approx(
            factor * 2 * 64 * bf16.activation_bytes_per_token)


def test_skips_widths_that_do_not_divide_the_heads() -> None:
    assert measure_layers(load_model("tiny-llama"), tps=(3,)) == ([], [])  # heads=4, kv_heads=2


def test_rejects_bad_modes_and_points() -> None:
    spec = load_model("tiny-llama")
    expect_error(lambda: measure_layers(spec, recompute=("some",)), "recompute mode", "selective")
    expect_error(lambda: measure_layers(spec, points=((1, 1024),)), "max_seq_len=256")
    expect_error(lambda: measure_layers(spec, points=((0, 64),)), "seqs >= 1")


_RESIDENT = """
import torch
from plait.runtime.memory import resident_bytes
before = resident_bytes()
block = torch.ones(16 * 2**20)  # 64 MiB, touched
print(before, resident_bytes() - before)
"""


def test_resident_bytes_follows_resident_memory() -> None:
    # A fresh process: in this one, memory that earlier tests freed may still be resident and be reused.
    out = subprocess.run([sys.executable, "-c", _RESIDENT], check=True, capture_output=True, text=True, timeout=120)
    before, grown = map(float, out.stdout.split())
    assert 10 * 2**20 < before < 2**40
    assert grown > 32 * 2**20, grown
    assert 10 * 2**20 < resident_bytes() < 2**40
