"""Mixture-of-experts models: presets and Hugging Face configs match their published totals, and the cost
model prices expert parallelism term by term (experts' memory over ep and etp, token exchange, expert
data-parallel gradients)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
from helpers import expect_error

from plait.cost import experts
from plait.cost.calibration import calibration_for
from plait.cost.pipeline import paired_share
from plait.cost.layer import BlockContext, block_time
from plait.cost.precision import PRECISIONS
from plait.errors import PlaitError
from plait.executable import unsupported
from plait.cost.price import Held, price
from plait.plan import Strategy, uniform_plan
from plait.planner.baselines import run_baseline
from plait.planner.engine import search
from plait.simulate import simulate
from plait.spec.cluster import dgx
from plait.spec.layers import OPTIONAL_FIELDS, Gating, fields_hash
from plait.spec.model import PRESETS, from_hf_config

# (total, active) parameters as published: model cards and papers. GPT-OSS counts active parameters without
# the input embedding (its model card: 116.8B total, 5.1B active; 20.9B, 3.6B).
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),  # Mistral AI, Mixtral of Experts (Jiang et al. 2024): 46.7B, 12.9B active
    "mixtral-8x22b": (141e9, 39e9),  # Mistral AI release notes: 141B, 39B active
    "qwen3-30b-a3b": (30.5e9, 3.3e9),  # Qwen3 technical report, Table 2
    "qwen3-235b-a22b": (235e9, 22e9),
    "deepseek-v3": (671e9, 37e9),  # DeepSeek-V3 technical report: 671B total, 37B activated per token
    "kimi-k2": (1.04e12, 32e9),  # Kimi K2 technical report: 1.04 trillion total, 32 billion activated
    "gpt-oss-20b": (20.9e9, 3.6e9),
    "gpt-oss-120b": (116.8e9, 5.1e9),
}
ROUNDING = 0.03
"""Relative tolerance: published figures are rounded to two or three significant digits."""


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_presets_match_published_totals_and_active_parameters(name: str) -> None:
    m = PRESETS[name]
    total, active = PUBLISHED[name]
    counted_active = m.active_params - (m.embedding_params if name.startswith("gpt-oss") else 0)
    assert m.params == pytest.approx(total, rel=ROUNDING)
    assert counted_active == pytest.approx(active, rel=ROUNDING)


DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (the fields plait reads)
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "intermediate_size": 18432, "vocab_size": 129280, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "max_position_embeddings": 163840, "tie_word_embeddings": False, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
QWEN3_30B = {  # Qwen/Qwen3-30B-A3B config.json
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False, "norm_topk_prob": True,
}
KIMI_K2 = {  # moonshotai/Kimi-K2-Base config.json (the fields plait reads)
    "model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "intermediate_size": 18432, "vocab_size": 163840, "moe_intermediate_size": 2048,
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "max_position_embeddings": 131072, "tie_word_embeddings": False, "n_group": 1,
    "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
}
GPT_OSS_120B = {  # openai/gpt-oss-120b config.json
    "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 128,
    "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128, "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(("config", "preset"), [(DEEPSEEK_V3, "deepseek-v3"), (QWEN3_30B, "qwen3-30b-a3b"),
                                                (GPT_OSS_120B, "gpt-oss-120b"), (KIMI_K2, "kimi-k2")])
def test_hf_configs_load_as_their_presets(config: dict, preset: str) -> None:
    m = from_hf_config(config, preset)
    assert m.params == PRESETS[preset].params and m.active_params == PRESETS[preset].active_params
    assert m.kind_counts() == PRESETS[preset].kind_counts()
    assert m.stack == PRESETS[preset].stack  # every layer's shape, DeepSeek-V3's router groups included


def test_latent_attention_shapes() -> None:
    """DeepSeek-V3's attention: q through a 1536-wide latent, k/v from a 512-wide latent plus a 64-dim shared
    rotary key; 128 heads of 128+64 query/key dims and 128 value dims."""
    b = PRESETS["deepseek-v3"].stack[0]
    gemms = {g.name: (g.k, g.n, g.split) for g in b.gemms}
    assert gemms["q_down"] == (7168, 1536, "none") and gemms["q_up"] == (1536, 128 * 192, "col")
    assert gemms["kv_down"] == (7168, 512 + 64, "none") and gemms["kv_up"] == (512, 128 * 256, "col")
    assert gemms["attn_out"] == (128 * 128, 7168, "row")
    assert b.attention_flops_per_token(4096) == 4096 * 2 * (128 * 192 + 128 * 128)


def _context(model, s: Strategy, nodes: int = 1, seqs: int = 1, load: float = 1.0) -> BlockContext:
    cluster = dgx(nodes, 8, "H100-80GB")
    ranks = tuple(range(s.devices))
    return BlockContext.for_ranks(model, cluster, calibration_for(cluster.gpu.name), PRECISIONS["bf16"], 4096, seqs,
                                  s, ranks, s.degrees.group(ranks, "data"), load)


def test_expert_parallelism_divides_the_experts_states_and_moves_routed_tokens() -> None:
    m = PRESETS["mixtral-8x7b"]
    b = m.stack[0]
    routed = experts.expert_params(b)
    assert routed == 8 * 3 * 4096 * 14336
    plain = price(b, Strategy(dp=8), _context(m, Strategy(dp=8)))
    ep8 = price(b, Strategy(dp=8, ep=8), _context(m, Strategy(dp=8, ep=8)))
    assert plain.params - ep8.params == pytest.approx(routed * 7 / 8)
    assert block_time(b, Strategy(dp=8), _context(m, Strategy(dp=8))).ep_comm == 0.0
    t = block_time(b, Strategy(dp=8, ep=8), _context(m, Strategy(dp=8, ep=8)))
    assert t.ep_comm > 0  # dispatch and combine in forward and in backward
    # all-to-all bytes: each routed copy of the rank's 4096 tokens, hidden wide, twice per pass
    ctx = _context(m, Strategy(dp=8, ep=8))
    one = experts.dispatch_time(b, Strategy(dp=8, ep=8), 4096, ctx)
    two = experts.dispatch_time(b, Strategy(dp=8, ep=8), 4096, _context(m, Strategy(dp=8, ep=8), load=2.0))
    fixed = 2 * ctx.cal.moe_exchange_overhead_s  # the dispatchers' sync and wait, a dispatch and a combine
    assert two - fixed > 1.9 * (one - fixed)  # bytes double with the load (latency aside)


def test_expert_tensor_parallelism_and_the_expert_data_parallel_group() -> None:
    m = PRESETS["mixtral-8x7b"]
    b = m.stack[0]
    s = Strategy(dp=2, tp=4, sp=True, ep=2, etp=4)  # 8 ranks: experts edp1 x ep2 x etp4
    ctx = _context(m, s)
    assert (ctx.ep_group.size, ctx.etp_group.size, ctx.edp_group.size) == (2, 4, 1)
    assert experts.expert_params_per_rank(b, s) == experts.expert_params(b) / 8
    zero = price(b, s.model_copy(update={"zero": 1}), _context(m, s.model_copy(update={"zero": 1})))
    # experts have no replica to shard over: their optimizer states stay whole; the attention's shard over dp 2
    assert zero.optimizer > experts.expert_params(b) / 8 * 12 * 0.99


def test_expert_layout_is_validated() -> None:
    m = PRESETS["mixtral-8x7b"]
    cluster = dgx(1, 8, "H100-80GB")
    expect_error(lambda: uniform_plan("dp=8,ep=16", m, cluster, 4096), "ep*etp = 16")
    expect_error(lambda: uniform_plan("dp=8,ep=4,etp=3", m, cluster, 4096), "ep*etp = 4*3")
    plan = uniform_plan("dp=8,ep=8,gbs=64,expert_load=1.2", m, cluster, 4096)
    assert plan.expert_load == 1.2
    expect_error(lambda: uniform_plan("dp=8,expert_load=0.5", m, cluster, 4096), "expert_load must be")


def test_the_optimizer_steps_each_part_over_its_own_shard_group() -> None:
    m = PRESETS["mixtral-8x7b"]
    b = m.stack[0]
    s = Strategy(dp=8, ep=8, zero=1)  # experts: ep 8, edp 1 (whole on each rank); the rest sharded over dp 8
    c = price(b, s, _context(m, s))
    dense = b.params - experts.expert_params(b)
    assert c.updated == pytest.approx(dense / 8 + experts.expert_params(b) / 8)
    assert c.optimizer == pytest.approx(c.updated * PRECISIONS["bf16"].optimizer)  # the state kept is stepped
    held = Held(c, 4, s, replicas=8)
    assert held.local_params == pytest.approx(4 * c.updated)
    # without ZeRO every rank steps all it holds
    whole = price(b, Strategy(dp=8, ep=8), _context(m, Strategy(dp=8, ep=8)))
    assert whole.updated == pytest.approx(whole.params)


def test_expert_load_slows_the_experts() -> None:
    m = PRESETS["mixtral-8x7b"]
    cluster = dgx(1, 8, "H100-80GB")
    even = simulate(uniform_plan("dp=8,ep=8,gbs=64,zero=1", m, cluster, 4096), m, cluster)
    skew = simulate(uniform_plan("dp=8,ep=8,gbs=64,zero=1,expert_load=1.5", m, cluster, 4096), m, cluster)
    assert skew.iteration_time_s > even.iteration_time_s and skew.breakdown["ep_comm"] > even.breakdown["ep_comm"]
    assert skew.mfu < even.mfu and even.model_tflops_per_gpu == pytest.approx(
        skew.model_tflops_per_gpu * skew.iteration_time_s / even.iteration_time_s)


def test_search_lays_experts_out_and_beats_or_matches_the_grid() -> None:
    m = PRESETS["deepseek-moe-16b"]
    cluster = dgx(2, 8, "H100-80GB")
    result = search(m, cluster, 4096, 256)
    grid, _ = run_baseline("megatron-grid", m, cluster, 4096, 256)
    assert result.report is not None and grid is not None
    assert result.report.iteration_time_s <= grid.report.iteration_time_s
    moe = [s for st in result.plan.pipelines[0].stages for s in st.strategies if s.ep > 1]
    assert moe, "16 H100 should spread DeepSeekMoE's 64 experts"
    assert "ep=" in grid.label


def test_plan_command_takes_the_expert_load_and_lets_moe_layers_use_lsh() -> None:
    from typer.testing import CliRunner

    from plait.cli import app

    runner = CliRunner()
    args = ["plan", "--model", "deepseek-moe-16b", "--cluster", "2x8xH100-80GB", "--seq-len", "4096",
            "--global-batch", "256", "--json"]
    plain = runner.invoke(app, args)
    skewed = runner.invoke(app, [*args, "--expert-load", "1.5"])
    lsh = runner.invoke(app, [*args, "--lsh"])
    assert plain.exit_code == skewed.exit_code == lsh.exit_code == 0, (plain.output, skewed.output, lsh.output)
    time = {name: json.loads(r.stdout)["report"]["iteration_time_s"] for name, r in
            (("plain", plain), ("skewed", skewed), ("lsh", lsh))}
    assert time["skewed"] > time["plain"] > time["lsh"]
    assert json.loads(skewed.stdout)["plan"]["expert_load"] == 1.5
    strategies = [s for st in json.loads(lsh.stdout)["plan"]["pipelines"][0]["stages"] for s in st["strategies"]]
    assert any(s["moe_comm"] == "lsh" for s in strategies)
    refused = runner.invoke(app, [*args, "--expert-load", "0.5"])
    assert refused.exit_code == 2 and "--expert-load must be a number >= 1" in refused.output


def test_expert_gathers_overlap_the_token_exchange_only_on_other_links() -> None:
    """ZeRO-3 over the expert data-parallel group across nodes runs beside an all-to-all kept inside the node
    (the whole exchange joins its window); with the exchange across nodes too, or for the dense part, it does not."""
    m = PRESETS["qwen3-235b-a22b"]
    b = m.stack[0]
    inside = Strategy(dp=16, ep=8, zero=3)  # 16 ranks on 2 nodes: ep inside a node, edp 2 across the nodes
    ctx = _context(m, inside, nodes=2)
    assert (ctx.ep_group.nodes, ctx.edp_group.nodes) == (1, 2)
    assert experts.expert_sync_window(b, inside, ctx, ctx.edp_group, 0.25) == 0.25
    assert experts.expert_sync_window(b, inside, ctx, ctx.dp_group, 0.25) == 0.0
    across = Strategy(dp=32, ep=16, zero=3)  # 4 nodes: the exchange crosses nodes too, one network for both
    ctx = _context(m, across, nodes=4)
    assert (ctx.ep_group.nodes, ctx.edp_group.nodes) == (2, 2)
    assert experts.expert_sync_window(b, across, ctx, ctx.edp_group, 0.25) == 0.0


def test_destinations_of_a_token_by_routing() -> None:
    """Random top-8 of 128 experts over 8 ranks reaches 8 * (1 - C(112,8)/C(128,8)) = 5.34 ranks; AutoModel's
    contiguous blocks of 8 reach one rank of 16 experts, and two of DeepSeek-V3's 64 ranks of 4 experts."""
    qwen = next(x for x in PRESETS["qwen3-30b-a3b"].stack if x.kind == "moe")
    v3 = next(x for x in PRESETS["deepseek-v3"].stack if x.kind == "moe")
    ungrouped = v3.with_(expert_groups=0, group_top_k=0)
    assert experts.destinations(qwen, 8) == pytest.approx(8 * (1 - math.comb(112, 8) / math.comb(128, 8)))
    assert round(experts.destinations(qwen, 8), 2) == 5.34
    assert experts.destinations(qwen, 8, "contiguous") == 1.0
    assert experts.destinations(v3, 64, "contiguous") == 2.0
    assert experts.remote_nodes_per_token(v3, 8, "contiguous") == pytest.approx(7 / 8)
    assert experts.remote_nodes_per_token(ungrouped, 8) == pytest.approx(7 * (1 - math.comb(224, 8) / math.comb(256, 8)))


@pytest.mark.parametrize("parts", [2, 4, 8, 16, 64])
def test_group_limited_routing_reaches_fewer_nodes_as_sampled(parts: int) -> None:
    """DeepSeek-V3's router picks 4 of 8 groups of 32 experts, then its top 8 experts among those 128: over 8
    nodes (a group each) a token reaches 8 * (1/2) * (1 - C(96,8)/C(128,8)) = 3.64 nodes, not 5.27 as without
    groups. The closed forms (parts of whole groups, and parts inside a group) match 20,000 sampled tokens."""
    v3 = next(x for x in PRESETS["deepseek-v3"].stack if x.kind == "moe")
    rng = random.Random(parts)
    per_part, per_group, reached = 256 // parts, 32, 0
    for _ in range(20_000):
        groups = rng.sample(range(8), 4)
        picks = rng.sample([g * per_group + i for g in groups for i in range(per_group)], 8)
        reached += len({e // per_part for e in picks})
    assert experts.destinations(v3, parts) == pytest.approx(reached / 20_000, rel=0.01)
    assert experts.destinations(v3, parts) < experts.destinations(v3.with_(expert_groups=0, group_top_k=0), parts)
    if parts == 8:
        assert experts.destinations(v3, 8) == pytest.approx(4 * (1 - math.comb(96, 8) / math.comb(128, 8)))


def test_router_groups_are_checked_and_keep_older_layer_names() -> None:
    v3 = next(x for x in PRESETS["deepseek-v3"].stack if x.kind == "moe")
    with pytest.raises(PlaitError, match="group-limited routing"):
        v3.with_(expert_groups=8, group_top_k=9)
    with pytest.raises(PlaitError, match="group-limited routing"):
        v3.with_(expert_groups=7)
    with pytest.raises(PlaitError, match="group-limited routing"):
        v3.with_(expert_groups=0)  # group_top_k without groups
    assert v3.with_(group_top_k=1).group_top_k == 1  # top 8 of one group of 32 experts
    ungrouped = v3.with_(expert_groups=0, group_top_k=0, gating=Gating())
    assert ungrouped.fingerprint != v3.fingerprint != v3.with_(gating=Gating()).fingerprint
    assert ungrouped.fingerprint == fields_hash(ungrouped, 12, skip=OPTIONAL_FIELDS)


def test_deepep_sends_a_token_once_per_destination_rank_and_permutes_twice() -> None:
    """Qwen3-30B-A3B on 8 H100 (ep8): the all-to-all dispatcher moves 8 copies of each token, DeepEP 5.34 (random
    routing) or 1 (contiguous); the all-to-all dispatcher permutes 4 times (16 local experts), DeepEP twice."""
    from dataclasses import replace as _replace

    m = PRESETS["qwen3-30b-a3b"]
    b = next(x for x in m.stack if x.kind == "moe")
    s = Strategy(dp=8, ep=8)
    ctx = _context(m, s)
    tokens = 4096.0
    times = {(d, r): experts.dispatch_time(b, s, tokens, _replace(ctx, dispatcher=d, routing=r))
             for d in ("alltoall", "deepep") for r in ("random", "contiguous")}
    assert times[("alltoall", "random")] == times[("alltoall", "contiguous")]
    assert times[("deepep", "contiguous")] < times[("deepep", "random")] < times[("alltoall", "random")]
    assert experts.permute_passes(b, s, ctx) == 4
    assert experts.permute_passes(b, s, _replace(ctx, dispatcher="deepep")) == 2
    assert experts.permute_passes(b, Strategy(dp=8), ctx) == 2
    f, bwd = experts.permute_time(b, s, tokens, ctx)
    moved = 4 * 2 * tokens * 8 * 2048 * 2
    assert f == bwd == pytest.approx(moved / (ctx.cluster.gpu.hbm_bandwidth * ctx.cal.memory_efficiency)
                                     + 4 * ctx.cal.kernel_overhead_s)


def test_across_nodes_the_all_to_all_dispatcher_sends_every_copy_and_deepep_one_per_node() -> None:
    """Qwen3-30B-A3B with ep16 over two nodes: NCCL's all-to-all sends each of a token's 8 routed copies that go to
    the other node over the NIC (8 x 1/2 = 4 token-sizes), DeepEP/HybridEP the token once to each other node its
    experts fall on (1 - C(64,8)/C(128,8) ~ 1): about 4x fewer network bytes, and the exchange is network-bound."""
    from dataclasses import replace as _replace

    m = PRESETS["qwen3-30b-a3b"]
    b = next(x for x in m.stack if x.kind == "moe")
    s = Strategy(dp=16, ep=16)
    ctx = _context(m, s, nodes=2)
    assert ctx.ep_group.nodes == 2
    tokens = 4096.0
    sent = tokens * b.top_k * b.hidden * 2
    network = ctx.cluster.inter.bandwidth * ctx.cal.network_efficiency
    a2a = experts.token_exchange_time(b, sent, ctx)
    assert a2a == pytest.approx(8 / 16 * sent / network + ctx.cluster.inter.latency)
    deepep = experts.token_exchange_time(b, sent, _replace(ctx, dispatcher="deepep"))
    once = tokens * b.hidden * 2 * experts.remote_nodes_per_token(b, 2)
    assert deepep == pytest.approx(once / network + ctx.cluster.inter.latency)
    assert 3.9 < (a2a - ctx.cluster.inter.latency) / (deepep - ctx.cluster.inter.latency) < 4.1


def test_shorthand_takes_the_dispatcher_and_routing() -> None:
    m = PRESETS["qwen3-30b-a3b"]
    cluster = dgx(1, 8, "H100-80GB")
    plan = uniform_plan("dp=8,ep=8,gbs=8,dispatcher=deepep,routing=contiguous", m, cluster, 4096)
    assert (plan.dispatcher, plan.routing) == ("deepep", "contiguous")
    assert (uniform_plan("dp=8,ep=8,gbs=8", m, cluster, 4096).dispatcher) == "alltoall"
    with pytest.raises(PlaitError, match="dispatcher must be alltoall or deepep"):
        uniform_plan("dp=8,ep=8,gbs=8,dispatcher=nccl", m, cluster, 4096)


def test_expert_output_bias_is_priced_only_for_biased_experts() -> None:
    """GPT-OSS 120B on 8 H100 (ep8, 16 local experts, 4096 tokens, top 4): Megatron's unfused fc2 bias moves 28
    bytes forward and 40 backward per routed pair and hidden element (16384 pairs x 2880), in 34 and 82 kernels;
    Mixtral's experts have no biases, so nothing."""
    m = PRESETS["gpt-oss-120b"]
    b = next(x for x in m.stack if x.kind == "moe")
    s = Strategy(dp=8, ep=8)
    ctx = _context(m, s)
    rate = ctx.cluster.gpu.hbm_bandwidth * ctx.cal.memory_efficiency
    f, bwd = experts.expert_bias_time(b, s, 4096.0, ctx)
    elements = 4096 * 4 * 2880
    assert experts.EXPERT_BIAS_FORWARD_BYTES == 28 and experts.EXPERT_BIAS_BACKWARD_BYTES == 40
    assert f == pytest.approx(28 * elements / rate + 34 * ctx.cal.kernel_overhead_s)
    assert bwd == pytest.approx(40 * elements / rate + 82 * ctx.cal.kernel_overhead_s)
    assert round(f * 1e3, 3) == 0.629 and round(bwd * 1e3, 3) == 1.032
    mixtral = PRESETS["mixtral-8x7b"]
    mb = next(x for x in mixtral.stack if x.kind == "moe")
    assert experts.expert_bias_time(mb, s, 4096.0, _context(mixtral, s)) == (0.0, 0.0)


def test_expert_parallel_overlap_hides_a_share_of_each_paired_exchange() -> None:
    """Megatron's --overlap-moe-expert-parallel-comm (`Plan.ep_overlap`): the token exchange of every paired pass
    hides `Calibration.ep_overlap_hidden` of itself; nothing else changes. Qwen3-30B-A3B on 16 H100 (the A/B it
    was read from): 24.73 s off, 21.00 s on (published 24.71 s and 20.99 s)."""
    m, cluster = PRESETS["qwen3-30b-a3b"], dgx(2, 8, "H100-80GB")
    base = "dp=16,ep=16,mbs=1,gbs=1024,zero=1,dispatcher=deepep,grad_reduce=bf16"
    off, on = (simulate(uniform_plan(base + extra, m, cluster, 4096), m, cluster) for extra in ("", ",ep_overlap=1"))
    hidden = calibration_for("H100-80GB").ep_overlap_hidden * paired_share("1f1b", 1, 64)
    assert on.breakdown["ep_comm"] == pytest.approx(off.breakdown["ep_comm"] * (1 - hidden))
    assert on.breakdown["compute"] == pytest.approx(off.breakdown["compute"])
    assert round(off.iteration_time_s, 2) == 24.73 and round(on.iteration_time_s, 2) == 21.00
    dense = PRESETS["llama2-7b"]  # no experts: nothing to hide
    assert simulate(uniform_plan("dp=8,gbs=8,ep_overlap=1", dense, dgx(1, 8, "H100-80GB"), 4096), dense,
                    dgx(1, 8, "H100-80GB")).iteration_time_s == pytest.approx(
        simulate(uniform_plan("dp=8,gbs=8", dense, dgx(1, 8, "H100-80GB"), 4096), dense,
                 dgx(1, 8, "H100-80GB")).iteration_time_s)


@pytest.mark.parametrize(("schedule", "pp", "m", "chunks", "share"), [
    ("1f1b", 1, 64, 1, 63 / 64),  # every micro-batch but the first forward and the last backward
    ("1f1b", 4, 16, 1, 12 / 16),  # 3 warm-up forwards and the first steady one
    ("interleaved", 8, 128, 4, (512 - 38 - 1) / 512),  # Megatron's first-rank warm-up: 2 (8 - 1) + 3 x 8
    ("1f1b", 8, 4, 1, 0.0),  # all warm-up
    ("gpipe", 4, 64, 1, 0.0),  # every forward before any backward
])
def test_paired_share_of_a_schedule(schedule: str, pp: int, m: int, chunks: int, share: float) -> None:
    assert paired_share(schedule, pp, m, chunks) == pytest.approx(share)


def test_the_runtime_refuses_the_expert_parallel_overlap_in_one_line() -> None:
    m, cluster = PRESETS["qwen3-30b-a3b"], dgx(1, 8, "H100-80GB")
    plan = uniform_plan("dp=8,ep=8,gbs=8,ep_overlap=1", m, cluster, 4096)
    assert plan.ep_overlap and not uniform_plan("dp=8,ep=8,gbs=8", m, cluster, 4096).ep_overlap
    reason = unsupported(plan, m)
    assert reason is not None and reason.startswith("ep_overlap:") and "\n" not in reason
    with pytest.raises(PlaitError, match="ep_overlap must be 0 or 1"):
        uniform_plan("dp=8,ep=8,gbs=8,ep_overlap=yes", m, cluster, 4096)


def test_deepseek_v3_multi_token_prediction_module() -> None:
    """DeepSeek-V3's MTP module is one more MoE layer with a 2h -> h projection and three norms; with the
    module's own copies of the embedding and head (as its checkpoint stores them) the total is the model card's
    685B. The plain preset's layers keep their names; the runtime refuses the module in one line."""
    plain, mtp = PRESETS["deepseek-v3"], PRESETS["deepseek-v3-mtp"]
    last = mtp.stack[-1]
    assert mtp.mtp_layers == 1 and plain.mtp_layers == 0 and mtp.stack[:-1] == plain.stack and last.mtp
    assert last.with_(mtp=False, norms=plain.stack[-1].norms) == plain.stack[-1]
    h = plain.hidden
    assert mtp.params - plain.params == plain.stack[-1].params + 2 * h * h + 3 * h
    assert mtp.params + 2 * mtp.vocab * h == pytest.approx(685e9, rel=0.005)  # model card: 671B + 14B MTP
    assert mtp.fingerprint != plain.fingerprint and last.fingerprint != plain.stack[-1].fingerprint
    # the names the plain model and its layers had before the flag and the router's gating existed (profiles
    # and plans refer to them): a model without them keeps them
    older = replace(plain, mixed=tuple(b.with_(gating=Gating()) if b.kind == "moe" else b for b in plain.stack))
    assert (older.fingerprint, older.stack[-1].fingerprint) == ("5e5fa63c3360ce10", "e8d504416490")
    assert plain.fingerprint != older.fingerprint
    # Megatron's FLOP count: the module's layer and projection, and a second pass through the head
    extra = mtp.model_flops_per_token(4096) - plain.model_flops_per_token(4096)
    assert extra == pytest.approx(3 * (last.flops_per_token(4096) + 2 * h * mtp.vocab))
    cluster = dgx(1, 8, "H100-80GB")
    assert unsupported(uniform_plan("dp=8,ep=8,gbs=8", mtp, cluster, 4096), mtp) is None  # the runtime builds it
    for refused in ("dp=4,cp=2,ep=8,gbs=8", "tp=2,sp=1,dp=4,ep=8,etp=1,gbs=8"):  # cp anywhere, tp on the module
        reason = unsupported(uniform_plan(refused, mtp, cluster, 4096), mtp)
        assert reason is not None and "multi-token-prediction" in reason and "\n" not in reason


def test_multi_token_prediction_prices_a_head_pass_a_lookup_and_the_table_on_the_last_stage() -> None:
    from plait.cost.head import head_activation_bytes, head_time
    from plait.cost.price import edge_params

    plain, mtp = PRESETS["deepseek-v3"], PRESETS["deepseek-v3-mtp"]
    s = Strategy(dp=8, ep=8)
    one, two = head_time(s, _context(plain, s)), head_time(s, _context(mtp, s))
    assert 2 * one.forward < two.forward < 2.05 * one.forward  # a second pass and the next tokens' lookup
    assert 2 * one.backward < two.backward < 2.05 * one.backward
    assert head_activation_bytes(s, _context(mtp, s)) == 2 * head_activation_bytes(s, _context(plain, s))
    table = plain.vocab * plain.hidden  # the last stage looks tokens up: it holds the table when pipelined
    assert edge_params("head", _context(mtp, s), copy=True) - edge_params("head", _context(plain, s), copy=True) \
        == table
    assert edge_params("head", _context(mtp, s), copy=False) == edge_params("head", _context(plain, s), copy=False)
    cluster = dgx(4, 8, "H100-80GB")
    shorthand = "pp=4,dp=8,ep=8,gbs=64,recompute=full"
    a, b = (simulate(uniform_plan(shorthand, m, cluster, 4096), m, cluster) for m in (plain, mtp))
    assert b.iteration_time_s > a.iteration_time_s
    assert b.devices[-1].memory.weights > a.devices[-1].memory.weights  # the module's layer and the table
    assert b.devices[0].memory.weights == a.devices[0].memory.weights


def test_inline_models_take_multi_token_prediction_modules() -> None:
    from plait.spec.model import parse_inline

    m = parse_inline("llama:layers=4,hidden=256,heads=4,vocab=1000,experts=8,top_k=2,expert_ffn=128,mtp=2")
    assert [b.mtp for b in m.stack] == [False] * 4 + [True] * 2 and m.mtp_layers == 2 and m.layers == 6
    with pytest.raises(PlaitError, match="mtp"):
        parse_inline("t5:encoder_layers=2,decoder_layers=2,hidden=64,heads=2,vocab=100,mtp=1")


def test_megatron_recompute_modules_are_priced_where_they_apply(tmp_path) -> None:
    """Each of Megatron's named recompute modules re-runs its part's forward in backward and drops what it kept,
    in the layers it belongs to only, and not under a recompute that repeats the part already."""
    from plait.cost.recompute_modules import changed_by, dropped_bytes, modules_time
    from plait.plan import load_plan

    v3 = PRESETS["deepseek-v3"]
    dense, moe = v3.stack[0], v3.stack[-1]
    base = Strategy(dp=8, tp=2, sp=True, ep=8, etp=1)
    ctx = _context(v3, base)
    tokens = 4096.0

    def s(*mods: str) -> Strategy:
        return Strategy.model_validate({**base.model_dump(), "recompute_modules": mods})

    # mla_up_proj: every latent layer's queries, keys and values (q 128 x 192, k 128 x 192, v 128 x 128 per token)
    assert dropped_bytes(moe, s("mla_up_proj"), tokens, ctx) == tokens * 128 * (192 + 192 + 128) / 2 * 2
    assert dropped_bytes(dense, s("mla_up_proj"), tokens, ctx) == dropped_bytes(moe, s("mla_up_proj"), tokens, ctx)
    assert modules_time(moe, s("mla_up_proj"), tokens, ctx) > 0
    # mlp: the dense layers' MLP only (SwiGLU keeps four ffn-wide tensors)
    assert dropped_bytes(dense, s("mlp"), tokens, ctx) == tokens * 4 * 18432 / 2 * 2
    assert dropped_bytes(moe, s("mlp"), tokens, ctx) == 0 and modules_time(moe, s("mlp"), tokens, ctx) == 0
    # moe_act: the routed experts' activation output and the product (two expert-wide tensors a routed row)
    pairs = experts.routed_pairs(moe, base, tokens, ctx)
    assert dropped_bytes(moe, s("moe_act"), tokens, ctx) == pytest.approx(pairs * 2 * 2048 * 2)
    assert dropped_bytes(dense, s("moe_act"), tokens, ctx) == 0
    # layernorm: both norm outputs, sharded by sequence parallelism
    assert dropped_bytes(moe, s("layernorm"), tokens, ctx) == tokens * 2 * 7168 / 2 * 2
    assert changed_by(moe) == ("mla_up_proj", "moe_act", "layernorm") and \
        changed_by(dense) == ("mla_up_proj", "mlp", "layernorm")
    # a recompute that repeats the parts already takes none
    with pytest.raises(ValueError, match="recompute none or selective"):
        Strategy(dp=8, tp=2, recompute="full", recompute_modules=("layernorm",))
    assert s("layernorm", "mlp") == s("mlp", "layernorm") and s("layernorm", "mlp").recompute_modules == \
        ("mlp", "layernorm") and s("mlp", "layernorm").short().endswith("rcm=mlp+layernorm")
    # in a whole plan: slower, smaller; the shorthand and the plan file; the runtime takes it as it takes the plan
    cluster = dgx(32, 8, "H100-80GB")
    shorthand = "tp=2,sp=1,pp=8,dp=16,ep=32,etp=1,gbs=512,zero=1"
    plain = uniform_plan(shorthand, v3, cluster, 4096)
    plan = uniform_plan(shorthand + ",recompute_modules=mlp+mla_up_proj", v3, cluster, 4096)
    assert plan.pipelines[0].stages[0].strategies[0].recompute_modules == ("mla_up_proj", "mlp")
    assert plain.pipelines[0].stages[0].strategies[0].recompute_modules == ()
    a, b = simulate(plain, v3, cluster), simulate(plan, v3, cluster)
    assert b.iteration_time_s > a.iteration_time_s and b.peak_memory_gib < a.peak_memory_gib - 5
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert load_plan(path) == plan
    # a version-9 file gave them once for the plan: read onto the strategies that keep their activations
    raw = json.loads(uniform_plan(shorthand + ",vpp=2", v3, cluster, 4096).to_json())
    stages = raw["pipelines"][0]["stages"]
    stages[1]["strategies"][0]["recompute"] = "full"
    raw.update(version=9, recompute_modules=["mlp", "mla_up_proj"])
    path.write_text(json.dumps(raw))
    read = load_plan(path)
    assert [st.strategies[0].recompute_modules for st in read.pipelines[0].stages][:3] == \
        [("mla_up_proj", "mlp"), (), ("mla_up_proj", "mlp")]
    assert unsupported(plan, v3) == unsupported(plain, v3)  # run: tests/test_runtime_recompute_modules.py
    for bad, why in (("recompute_modules=core_attn", "recompute=selective"), ("recompute_modules=moe", "is not one of"),
                     ("recompute_modules=mlp+mlp", "twice"),
                     ("recompute=full,recompute_modules=mlp", "need recompute none or selective")):
        with pytest.raises(PlaitError, match=why):
            uniform_plan(f"{shorthand},{bad}", v3, cluster, 4096)
