"""Multi-head latent attention (DeepSeek-V2/V3) in the runtime: the module equals Hugging Face's
DeepseekV3Attention on the same weights, the built model has the parameters the cost model counts, and
tensor (with and without sp), context (Ulysses and ring), pipeline, data and expert parallelism, ZeRO-3 and
selective recomputation train tiny-deepseek (latent attention, group-limited routed and shared experts) to
the single-process losses (gloo, real torchrun launches, fp32; see tests/test_runtime.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import expect_error
from test_runtime import _losses, assert_same, reference_losses, text, train_together  # noqa: F401 (fixture)
from test_runtime_kinds import _plan

from plait.executable import unbuildable, unsupported
from plait.models import build_model
from plait.models.llama import rope_theta
from plait.models.mla import LatentAttention
from plait.plan import Strategy
from plait.spec.layers import Block
from plait.spec.model import PRESETS, parse_inline

S = Strategy
MODEL = "tiny-deepseek"
GBS = 4


def _hf_attention(att: LatentAttention, b: Block, theta: float) -> tuple:
    """Hugging Face's DeepseekV3Attention of the block's shape (rotate_half rotary layout), holding `att`'s
    weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = DeepseekV3Config(hidden_size=b.hidden, num_attention_heads=b.heads, num_key_value_heads=b.heads,
                              q_lora_rank=b.q_lora or None, kv_lora_rank=b.kv_lora, qk_nope_head_dim=b.head_dim,
                              qk_rope_head_dim=b.rope_head_dim, v_head_dim=b.v_head_dim, rope_interleave=False,
                              rope_theta=theta, rms_norm_eps=att.kv_norm.eps, attention_bias=False,
                              max_position_embeddings=256)
    config._attn_implementation = "eager"
    ref = hf.DeepseekV3Attention(config, 0)
    names = [("kv_a_proj_with_mqa", "wkv_a"), ("kv_a_layernorm", "kv_norm"), ("kv_b_proj", "wkv_b"), ("o_proj", "wo")]
    names += [("q_a_proj", "wq_a"), ("q_a_layernorm", "q_norm"), ("q_b_proj", "wq_b")] if b.q_lora else \
        [("q_proj", "wq")]
    with torch.no_grad():
        for theirs, ours in names:
            getattr(ref, theirs).weight.copy_(getattr(att, ours).weight)
    return ref, hf.DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("q_lora", [32, 0])
def test_latent_attention_equals_hugging_face_deepseek_v3(q_lora: int) -> None:
    """Outputs and input gradients of plait's latent attention and Hugging Face's on the same weights (with and
    without a query latent)."""
    spec = PRESETS[MODEL] if q_lora else parse_inline(
        "llama:layers=1,hidden=64,heads=4,vocab=128,head_dim=16,kv_lora=16,rope_head_dim=8,v_head_dim=24")
    model = build_model(spec, seed=3)
    att = model.layers["0"].attention
    assert isinstance(att, LatentAttention)
    ref, rotary = _hf_attention(att, spec.stack[0], rope_theta(spec))
    torch.manual_seed(0)
    x = torch.randn(2, 12, spec.hidden, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    cos, sin = rotary(x_ref, torch.arange(12)[None].expand(2, -1))
    mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
    got, want = att(x, model.freqs_cis), ref(x_ref, (cos, sin), mask)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    upstream = torch.randn_like(got)
    got.backward(upstream)
    want.backward(upstream)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=5e-5)  # fp32 sums in another order


def test_the_built_model_has_the_parameters_priced() -> None:
    """Every layer of tiny-deepseek (and an inline latent spec) is latent attention, and the model holds the
    parameters the cost model counts (down-projections, latent norms, up-projections, output)."""
    for spec in (PRESETS[MODEL], parse_inline("llama:layers=2,hidden=64,heads=4,vocab=128,kv_lora=16,q_lora=32,"
                                              "rope_head_dim=8,experts=4,top_k=2,expert_ffn=32")):
        model = build_model(spec)
        assert all(isinstance(layer.attention, LatentAttention) for layer in model.layers.values())
        assert sum(p.numel() for p in model.parameters()) == spec.params
    assert model.freqs_cis.shape[-1] == 8  # RoPE over the rotary dims only
    # DeepSeek-V3's router: the choice bias is a buffer that checkpoints hold (zero from the seed), the inline
    # spec's router Mixtral's softmax without one
    deepseek = build_model(PRESETS[MODEL])
    assert [n for n in deepseek.state_dict() if n.endswith("choice_bias")] == \
        [f"layers.{i}.feed_forward.choice_bias" for i in range(1, 4)]
    assert not any(n.endswith("choice_bias") for n in model.state_dict())


def test_what_the_runtime_refuses_for_latent_attention_names_the_cause() -> None:
    """Latent attention on some layers only or outside Llama stacks, and q/k norms beside it, are refused in
    one line."""
    spec = PRESETS[MODEL]
    half = replace(spec, mixed=(spec.stack[0].with_(kv_lora=0, q_lora=0, rope_head_dim=0), *spec.stack[1:]))
    assert "every layer uses latent attention" in unbuildable(half)
    expect_error(lambda: parse_inline("llama:layers=1,hidden=64,heads=4,vocab=128,kv_lora=16,qk_norm=1"),
                 "without latent attention")
    expect_error(lambda: parse_inline("gpt:layers=2,hidden=64,heads=4,vocab=128,kv_lora=16"), "llama stacks")
    expect_error(lambda: parse_inline("llama:layers=2,hidden=64,heads=4,vocab=128,q_lora=16"), "kv_lora too")


TWO_RANKS = {  # name: plan or --strategy text
    "layers tp2|dp2-ep2|tp2-sp-ep2|dp2": _plan(MODEL, [((0, 4), (0, 1), (
        S(tp=2), S(dp=2, ep=2), S(tp=2, sp=True, ep=2, etp=1), S(dp=2)))], 1, 4),
    "tp2+sp ep2": "tp=2,sp=1,ep=2,etp=1,gbs=4",
    "cp2 ulysses": "cp=2,ep=2,gbs=4",
    "cp2 ring": "cp=2,cp_mode=ring,ep=2,gbs=4",
    "dp2 ep2 zero3 selective": "dp=2,ep=2,zero=3,recompute=selective,gbs=4",
}
FOUR_RANKS = {
    "pp2 x ep2": "pp=2,dp=2,ep=2,mbs=1,gbs=4",
    "tp2+sp x dp2 ep2 zero1": "dp=2,tp=2,sp=1,ep=2,etp=1,zero=1,gbs=4",
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text) -> list[float]:  # noqa: F811
    return reference_losses(tmp_path_factory.mktemp("reference"), text, [(MODEL, GBS)])[(MODEL, GBS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> dict[int, tuple]:  # noqa: F811
    """Every case in one torchrun job per rank count."""
    return {n: train_together(tmp_path_factory.mktemp(f"ranks{n}"), text, n,
                              {name: (MODEL, plan) for name, plan in cases.items()})
            for n, cases in ((2, TWO_RANKS), (4, FOUR_RANKS))}


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_latent_attention_plans_match_single_process(runs, reference, name) -> None:
    """tp (whole up-projections split by heads, with and without sp), cp (Ulysses, ring), pp, dp with ZeRO-1/3,
    ep and selective recomputation of tiny-deepseek train to the single-process losses."""
    nproc = 2 if name in TWO_RANKS else 4
    plan = {**TWO_RANKS, **FOUR_RANKS}[name]
    if not isinstance(plan, str):
        assert unsupported(plan, PRESETS[MODEL]) is None and plan.ranks[-1] == nproc - 1
    assert_same(_losses(runs[nproc], name), reference)
