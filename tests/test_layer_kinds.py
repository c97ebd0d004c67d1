"""Models made of different layers: presets, Hugging Face configs and inline specs load each layer as its kind,
their parameter counts match the published totals, and every planner prices a layer through cost/price.py."""

from __future__ import annotations

import json

import pytest
from helpers import expect_error

from plait.cost import comm
from plait.cost.calibration import calibration_for
from plait.cost.layer import BlockContext
from plait.cost.precision import PRECISIONS
from plait.cost.price import price, price_edge
from plait.plan import Strategy, uniform_plan, validate_plan
from plait.planner.engine import _Config, search
from plait.planner.space import SpaceLimits, block_strategies
from plait.planner.straggler import _prices
from plait.planner.varlen import SequenceCost
from plait.simulate import _stage_cost, simulate
from plait.spec.cluster import dgx, load_cluster
from plait.spec.model import PRESETS, from_hf_config, load_model, parse_inline

# Published totals (Hugging Face safetensors totals; papers for MoE active counts) and the tolerance each
# deserves: 0 for exact counts, the rounding of a figure given to one decimal otherwise.
PUBLISHED = {
    "mistral-7b": (7_241_732_096, 0.0, None, 0.0),
    "gemma2-9b": (9_241_705_984, 0.0, None, 0.0),
    "t5-11b": (11_307_321_344, 1e-6, None, 0.0),  # plait leaves out the 8,192 relative-position-bias weights
    "deepseek-moe-16b": (16.4e9, 0.05 / 16.4, 2.8e9, 0.05 / 2.8),  # Dai et al. 2024: 16.4B total, 2.8B activated
    "llava-llama3-8b": (8.355e9, 0.001, None, 0.0),  # LLaVA-NeXT 8B: CLIP-L/14-336, mlp2x projector, Llama-3-8B
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_mixed_presets_match_published_parameter_counts(name: str) -> None:
    total, total_rel, active, active_rel = PUBLISHED[name]
    m = PRESETS[name]
    assert m.params == pytest.approx(total, rel=total_rel, abs=0)
    if active is not None:
        assert m.active_params == pytest.approx(active, rel=active_rel)


def test_presets_hold_their_layer_kinds_in_order() -> None:
    assert PRESETS["t5-11b"].kind_counts() == {"encoder": 24, "cross_decoder": 24}
    assert PRESETS["deepseek-moe-16b"].kind_counts() == {"decoder": 1, "moe": 27}
    llava = PRESETS["llava-llama3-8b"]
    assert [b.kind for b in llava.stack[:2]] + [llava.stack[25].kind, llava.stack[26].kind] == \
        ["patch_embed", "vision", "projector", "decoder"]
    assert llava.stack[1].tokens == 577 and llava.stack[25].tokens == 576  # class token dropped by the projector
    gemma = PRESETS["gemma2-9b"]
    assert [b.window for b in gemma.stack[:4]] == [4096, 0, 4096, 0]
    assert all(b.window == 4096 for b in PRESETS["mistral-7b"].stack)
    assert PRESETS["llama3-8b"].uniform and not gemma.uniform


LLAMA_LIKE = {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
              "intermediate_size": 10944, "vocab_size": 102400}


def test_hf_deepseek_first_k_dense_replace() -> None:
    cfg = {"model_type": "deepseek", **LLAMA_LIKE, "moe_intermediate_size": 1408, "n_routed_experts": 64,
           "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1}
    m = from_hf_config(cfg, "deepseek-moe")
    assert [b.kind for b in m.stack[:3]] == ["decoder", "moe", "moe"]
    assert m.params == PRESETS["deepseek-moe-16b"].params


def test_hf_qwen_moe_sparse_step_and_mlp_only_layers() -> None:
    cfg = {"model_type": "qwen2_moe", **LLAMA_LIKE, "num_hidden_layers": 8, "moe_intermediate_size": 1408,
           "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
           "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    m = from_hf_config(cfg, "qwen-moe")
    # sparse every 2nd layer (1, 3, 5, 7), except 3 which is listed dense
    assert [b.kind for b in m.stack] == ["decoder", "moe", "decoder", "decoder", "decoder", "moe", "decoder", "moe"]
    assert m.stack[1].ffn == 5632 and m.stack[1].qkv_bias


def test_hf_qwen15_moe_totals() -> None:
    cfg = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
           "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
           "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936}
    m = from_hf_config(cfg, "Qwen1.5-MoE-A2.7B")
    assert m.params == pytest.approx(14.3e9, rel=0.01) and m.active_params == pytest.approx(2.7e9, rel=0.02)


def test_hf_t5_encoder_and_decoder_layers() -> None:
    cfg = {"model_type": "t5", "d_model": 1024, "d_kv": 128, "d_ff": 65536, "num_layers": 24,
           "num_decoder_layers": 24, "num_heads": 128, "vocab_size": 32128, "feed_forward_proj": "relu"}
    m = from_hf_config(cfg, "t5-11b")
    assert m.params == PRESETS["t5-11b"].params
    v11 = from_hf_config({**cfg, "num_decoder_layers": 12, "feed_forward_proj": "gated-gelu",
                          "tie_word_embeddings": False}, "t5-v1.1")
    assert v11.kind_counts() == {"encoder": 24, "cross_decoder": 12} and v11.stack[0].gated_mlp


def test_hf_llava_vision_tower_and_text_model() -> None:
    cfg = {"model_type": "llava",
           "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                             "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                             "patch_size": 14},
           "text_config": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                           "vocab_size": 128256, "max_position_embeddings": 8192}}
    m = from_hf_config(cfg, "llava-next")
    assert m.family == "llava" and m.params == PRESETS["llava-llama3-8b"].params
    expect_error(lambda: from_hf_config({"model_type": "llava", "text_config": {}}, "x"), "vision_config")


def test_hf_sliding_windows_mistral_and_gemma2_layer_types() -> None:
    mistral = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": 4096}
    assert from_hf_config(mistral, "m").params == PRESETS["mistral-7b"].params
    assert all(b.window == 4096 for b in from_hf_config(mistral, "m").stack)
    assert all(b.window == 0 for b in from_hf_config({**mistral, "sliding_window": None}, "m").stack)
    gemma = {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336, "vocab_size": 256000,
             "sliding_window": 4096}
    assert from_hf_config(gemma, "g").params == PRESETS["gemma2-9b"].params
    types = ["sliding_attention"] * 5 + ["full_attention"]
    g3 = from_hf_config({**gemma, "num_hidden_layers": 6, "layer_types": types}, "g3")
    assert [b.window for b in g3.stack] == [4096] * 5 + [0]
    expect_error(lambda: from_hf_config({**gemma, "layer_types": types}, "g"), "layer_types", "42")


def test_inline_mixed_stacks() -> None:
    g = parse_inline("llama:layers=6,hidden=256,heads=4,vocab=1000,window=128,global_every=3")
    assert [b.window for b in g.stack] == [128, 128, 0, 128, 128, 0]
    moe = parse_inline("llama:layers=4,hidden=256,heads=4,vocab=1000,experts=8,top_k=2,expert_ffn=128,dense_first=1")
    assert moe.kind_counts() == {"decoder": 1, "moe": 3} and moe.active_params < moe.params
    t5 = parse_inline("t5:encoder_layers=2,decoder_layers=3,hidden=256,heads=4,vocab=1000")
    assert t5.kind_counts() == {"encoder": 2, "cross_decoder": 3}
    vl = load_model("llama:layers=2,hidden=256,heads=4,vocab=1000,vision=clip-l14")
    assert vl.family == "llava" and vl.kind_counts()["vision"] == 24
    expect_error(lambda: parse_inline("llama:layers=2,hidden=256,heads=4,vocab=1000,experts=8"), "top_k")
    expect_error(lambda: parse_inline("llama:layers=2,hidden=256,heads=4,vocab=1000,vision=vit-huge"), "vision tower")
    expect_error(lambda: parse_inline("t5:hidden=256,heads=4,vocab=1000"), "encoder_layers")
    expect_error(lambda: parse_inline("t5:encoder_layers=2,decoder_layers=2,hidden=256,heads=4"), "vocab")
    expect_error(lambda: parse_inline("llama:layers=2,hidden=256,heads=4,vocab=1000,global_every=2"), "window")


def test_windowed_layers_cost_less_than_global_ones_at_long_sequences() -> None:
    gemma = PRESETS["gemma2-9b"]
    local, full = gemma.stack[0], gemma.stack[1]
    assert local.flops_per_token(32768) < full.flops_per_token(32768)
    assert local.flops_per_token(2048) == full.flops_per_token(2048)  # the window covers the sequence
    cluster = dgx(1, 8, "H100-80GB")
    ctx = BlockContext(gemma, cluster, calibration_for("H100-80GB"), PRECISIONS["bf16"], 32768, 1, comm.SINGLE,
                       comm.SINGLE, comm.SINGLE)
    assert price(local, Strategy(), ctx).time.forward < 0.8 * price(full, Strategy(), ctx).time.forward


def test_each_kind_has_its_own_strategy_space() -> None:
    llava = PRESETS["llava-llama3-8b"]
    cluster = dgx(1, 8, "A100-80GB")
    vision = block_strategies(llava.stack[1], cluster, 8, 8, 2048)
    text = block_strategies(llava.stack[-1], cluster, 8, 8, 2048)
    assert not any(s.sp or s.cp > 1 for s in vision)  # 577 patches: no split of the tokens
    assert any(s.sp for s in text) and any(s.cp > 1 for s in text)
    assert not any(s.recompute == "selective" for s in block_strategies(llava.stack[0], cluster, 8, 8, 2048))
    plan = uniform_plan("tp=2,sp=1,dp=4,gbs=8", PRESETS["llama3-8b"], cluster, 2048)
    expect_error(lambda: validate_plan(plan.model_copy(update={"model": llava.name}), llava, cluster), "patch_embed",
                 "577")


def _ctx(model, cluster, s: Strategy, seqs: int, seq: int) -> BlockContext:
    ranks = tuple(range(s.devices))
    return BlockContext.for_ranks(model, cluster, calibration_for(cluster.gpu.name), PRECISIONS["bf16"], seq, seqs,
                                  s, ranks, ranks[:: s.tp])


def test_one_price_for_a_layer_in_every_planner() -> None:
    """The simulator, the search engine, the straggler planner and the variable-length planner all get a
    layer's seconds and bytes from cost/price.py: the same numbers for the same layer and strategy."""
    model, cluster = PRESETS["llama2-7b"], load_cluster("1x8xA100-80GB")
    seq, mb = 2048, 8
    s = Strategy(dp=4, tp=2, zero=1)
    layer = price(model.block, s, _ctx(model, cluster, s, mb // s.dp, seq))
    # simulator: a one-stage plan of that strategy; its stage cost is the layers plus the edges
    plan = uniform_plan(f"dp=4,tp=2,zero=1,mbs={mb // 4},gbs={mb}", model, cluster, seq)
    stage = _stage_cost(plan, 0, 0, model, cluster, calibration_for(cluster.gpu.name))
    edges = [price_edge(e, s, _ctx(model, cluster, s, mb // s.dp, seq)) for e in ("embedding", "head")]
    assert stage.forward == pytest.approx(model.layers * layer.time.forward_total
                                          + sum(e.time.forward_total for e in edges), rel=1e-12)
    assert stage.activation_bytes == pytest.approx(model.layers * layer.activation, rel=1e-12)
    # search engine: the priced strategy of a one-stage configuration
    cfg = _Config(model, cluster, calibration_for(cluster.gpu.name), seq, mb, 1, 1, "1f1b", 1, "bf16",
                  SpaceLimits())
    priced = next(p for p in cfg.priced[0] if p.strategy == s)
    assert (priced.mb_time, priced.states, priced.activation) == (layer.micro_batch_s, layer.states,
                                                                  layer.activation)
    # straggler planner: one unit of tp devices, no replicas
    t = Strategy(tp=2)
    unit = price(model.block, t, _ctx(model, cluster, t, 2, seq))
    pr = _prices(model, cluster, calibration_for(cluster.gpu.name), PRECISIONS["bf16"], seq, 2, t, (0, 1), 1)
    assert (pr.layer_s, pr.layer_states, pr.layer_activation) == (unit.micro_batch_s, unit.states, unit.activation)
    # variable-length planner: a sequence on a context-parallel group of 2
    c = Strategy(cp=2)
    cost = SequenceCost(model, cluster)
    ctx = BlockContext(model, cluster, calibration_for(cluster.gpu.name), PRECISIONS["bf16"], 4096, 1, comm.SINGLE,
                       comm.GroupShape.of((0, 1), 8), comm.SINGLE)
    expected = model.layers * price(model.block, c, ctx).micro_batch_s + sum(
        price_edge(e, c, ctx).time.forward + price_edge(e, c, ctx).time.backward for e in ("embedding", "head"))
    assert cost.seconds(4096, 2) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["t5-11b", "llava-llama3-8b", "deepseek-moe-16b", "mistral-7b", "gemma2-9b"])
def test_search_plans_models_of_several_kinds(name: str) -> None:
    model = PRESETS[name]
    result = search(model, dgx(2, 8, "A100-80GB"), 2048, 64)
    assert result.plan is not None and result.report.fits
    validate_plan(result.plan, model, dgx(2, 8, "A100-80GB"))
    report = simulate(result.plan, model, dgx(2, 8, "A100-80GB"))
    kinds = set(model.kind_counts()) | {"embedding", "head"}
    assert set(report.by_kind) == kinds
    assert sum(k.layers for k in report.by_kind.values()) == model.layers + 2
    assert json.loads(json.dumps(report.to_dict()))["by_kind"][model.stack[-1].kind]["seconds"] > 0
