"""GPT-OSS's layer in the runtime: attention sinks (a logit per query head in every softmax's denominator),
a router with a bias, experts with biases and the clamped SwiGLU. The sink core equals Hugging Face's eager
attention with its gradients, and tiny-gpt-oss (sliding-window and full layers alternating) trains to the
single-process losses under tensor (sinks split by heads, the down bias split over etp), Ulysses context
(sinks split by head group) and ring (the sinks merged as one more block), pipeline, data and expert
parallelism, ZeRO and selective recomputation (gloo, real torchrun launches, fp32; see tests/test_runtime.py),
and a checkpoint saved under tp2 resumes under dp4 ep4; a Hugging Face checkpoint loaded under tp2+sp etp2
starts from its own loss (its logits: tests/test_models.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from helpers import expect_error
from test_moe import GPT_OSS_120B
from test_runtime import text  # noqa: F401 (a fixture)
from test_runtime import SEQ, _losses, assert_resumed, assert_same, reference_losses, train_saved_then_resumed

from plait.executable import unbuildable, unsupported
from plait.models import build_model
from plait.models.hf_weights import save_hf_safetensors
from plait.models.llama import causal_mask, sdpa_with_sinks, swiglu
from plait.plan import uniform_plan
from plait.runtime.data import TokenSource
from plait.spec.cluster import local_ranks
from plait.spec.hf_config import from_hf_config
from plait.spec.model import PRESETS, parse_inline

MODEL = "tiny-gpt-oss"
GBS = 4


def _eager_with_sinks(q, k, v, sinks, mask):  # noqa: ANN001, ANN202
    """Hugging Face's GPT-OSS eager attention (modeling_gpt_oss.eager_attention_forward) on q, k, v [B, h, T, D]."""
    scores = q @ k.transpose(2, 3) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)
    return probs[..., :-1] @ v


@pytest.mark.parametrize("window", [0, 5])
def test_sink_core_equals_hugging_face_eager_attention(window: int) -> None:
    """Outputs and the gradients of q, k, v and the sinks equal Hugging Face's eager GPT-OSS attention (causal
    and sliding-window), and the sinks change the output (they are not a no-op)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, requires_grad=True)
    place = torch.arange(12)
    mask = causal_mask(place, place, window)
    got = sdpa_with_sinks(q, k, v, sinks, mask if window else None, causal=True)
    want = _eager_with_sinks(q, k, v, sinks, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v, sinks), upstream)
    for a, b in zip(grads, torch.autograd.grad(want, (q, k, v, sinks), upstream), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (plain - got).abs().max() > 1e-2


def test_packed_rows_core_applies_the_sinks() -> None:
    """The variable-length runtime's document-masked core gets the layer's sinks and window: over one document
    it equals the layer's own core (and not the core without sinks)."""
    from plait.runtime.varlen import masked

    model = build_model(PRESETS[MODEL], seed=1)
    torch.nn.init.normal_(model.layers["0"].attention.sinks, std=1.0)
    attention, x = model.layers["0"].attention, torch.randn(1, 24, 64)
    place = torch.arange(24)
    whole = masked(causal_mask(place, place))
    own = attention(x, model.freqs_cis)
    torch.testing.assert_close(attention(x, model.freqs_cis, whole), own)
    attention.sinks = None
    assert (attention(x, model.freqs_cis, whole) - own).abs().max() > 1e-3


def test_clamped_swiglu_is_gpt_oss_formula() -> None:
    """GPT-OSS's experts: gate clamped above at the limit, up clamped both ways, gate * sigmoid(1.702 gate) *
    (up + 1); without a limit, SwiGLU."""
    gate, up = torch.tensor([-9.0, -1.0, 0.5, 8.0]), torch.tensor([-8.0, 2.0, 0.5, 9.0])
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(swiglu(gate, up, 7.0), g * torch.sigmoid(1.702 * g) * (u + 1))
    torch.testing.assert_close(swiglu(gate, up), torch.nn.functional.silu(gate) * up)


def test_the_built_model_has_the_parameters_priced() -> None:
    """tiny-gpt-oss and gpt-oss-20b's layers hold what the cost model counts: sinks per head, the router's bias,
    the experts' biases."""
    spec = PRESETS[MODEL]
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.params
    layer = model.layers["0"]
    assert layer.attention.sinks.shape == (4,) and layer.feed_forward.router.bias.shape == (8,)
    assert layer.feed_forward.experts.w2_bias.shape == (8, 64) and layer.feed_forward.experts.limit == 7.0
    assert [layer.attention.window for layer in model.layers.values()] == [16, 0, 16, 0]
    b = PRESETS["gpt-oss-20b"].stack[0]
    assert (b.sinks, b.swiglu_limit, b.gating.router_bias) == (True, 7.0, True)


def test_what_the_runtime_refuses_for_gpt_oss_names_the_cause() -> None:
    """The layer is built in llama stacks without latent attention only, and a config's SwiGLU factor other than
    GPT-OSS's is not applied: refused in one line; every parallelism runs it."""
    spec, ranks = PRESETS[MODEL], local_ranks(2)
    for strategy in (*TWO_RANKS.values(), "cp=2,cp_mode=ring,recompute=attn_kept,gbs=4"):
        assert unsupported(uniform_plan(strategy, spec, ranks, SEQ), spec) is None, strategy
    latent = parse_inline("llama:layers=1,hidden=64,heads=4,vocab=128,kv_lora=16")
    assert "without latent attention" in unbuildable(replace(latent, mixed=(latent.stack[0].with_(sinks=True),)))
    expect_error(lambda: spec.stack[0].with_(gated_mlp=False), "swiglu_limit", "gated MLP")
    expect_error(lambda: from_hf_config({**GPT_OSS_120B, "swiglu_alpha": 1.5}, "gpt-oss"), "swiglu_alpha 1.5")


TWO_RANKS = {  # name: --strategy text
    "tp2+sp etp2": "tp=2,sp=1,gbs=4",  # sinks split by heads, the experts' down bias over etp
    "tp2+sp ep2": "tp=2,sp=1,ep=2,etp=1,gbs=4",
    "cp2 ulysses ep2": "cp=2,ep=2,gbs=4",  # sinks split by head group
    "cp2 ring ep2": "cp=2,cp_mode=ring,ep=2,gbs=4",  # the sinks a block of the ring's merge
    "cp2 ring attn_kept": "cp=2,cp_mode=ring,recompute=attn_kept,gbs=4",  # the ring kept outside recompute
    "dp2 ep2 zero3 selective": "dp=2,ep=2,zero=3,recompute=selective,gbs=4",  # the sink core recomputed
}
FOUR_RANKS = {
    "pp2 x ep2": "pp=2,dp=2,ep=2,mbs=1,gbs=4",
    "tp2+sp x ep2 etp2 zero1": "dp=2,tp=2,sp=1,ep=2,zero=1,gbs=4",
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text) -> list[float]:  # noqa: F811
    return reference_losses(tmp_path_factory.mktemp("reference"), text, [(MODEL, GBS)])[(MODEL, GBS)]


SAVE, RESUME = "tp2+sp etp2 saved", "dp4 ep4 resumed"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> dict[int, tuple]:  # noqa: F811
    """Every case in one torchrun job per rank count; the 2-rank job also saves the checkpoint that the 4-rank
    job resumes."""
    return train_saved_then_resumed(tmp_path_factory, text, {name: (MODEL, plan) for name, plan in TWO_RANKS.items()},
                                    {name: (MODEL, plan) for name, plan in FOUR_RANKS.items()},
                                    (SAVE, (MODEL, TWO_RANKS["tp2+sp etp2"])), (RESUME, (MODEL, "dp=4,ep=4,gbs=4")))


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_gpt_oss_plans_match_single_process(runs, reference, name) -> None:
    """Each plan of tiny-gpt-oss trains to the single-process losses."""
    assert_same(_losses(runs[2 if name in TWO_RANKS else 4], name), reference)


def test_a_tp2_checkpoint_resumes_under_ep4(runs) -> None:
    """A checkpoint of tp2+sp etp2 (each rank computing half the heads' sinks, whose gradients are summed over
    the group so that every rank holds the same whole vector) resumes under dp4 ep4 with the losses the saved run
    went on with."""
    assert_resumed(runs, SAVE, RESUME)


def test_starts_from_a_gpt_oss_checkpoint_under_tp_and_etp(tmp_path, text) -> None:  # noqa: F811
    """--hf-checkpoint of a GPT-OSS model (sinks, router and expert biases set) under tp2+sp with etp2: the first
    loss is that of the saved weights on one process."""
    spec = PRESETS[MODEL]
    model = build_model(spec, seed=7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    save_hf_safetensors(model, tmp_path / "hf")
    batch = TokenSource(spec.vocab, SEQ, 4, 0, str(text)).batch(0)
    with torch.no_grad():
        logits = model.eval()(batch.inputs)
        expected = float(torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab), batch.targets.reshape(-1)))
    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", MODEL, "--strategy", "tp=2,sp=1,gbs=4", "--nproc",
           "2", "--steps", "1", "--seq-len", str(SEQ), "--data", str(text), "--metrics-out", str(tmp_path / "m.jsonl"),
           "--hf-checkpoint", str(tmp_path / "hf")]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(first - expected) / expected < 1e-5, (first, expected)
