"""Mixture-of-experts in the runtime: the MoE block's routing and balancing loss on one process, and expert
parallelism (with dp, tp+sp, cp, pp, per-layer mixes, and a checkpoint resharded from ep2 to ep4) training
to the single-process losses (gloo, real torchrun launches, fp32; see tests/test_runtime.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from test_runtime import text  # noqa: F401 (a fixture)
from test_runtime import _losses, assert_resumed, assert_same, reference_losses, train_saved_then_resumed
from helpers import expect_error
from test_runtime_kinds import _plan

from plait.executable import unbuildable, unsupported
from plait.models import build_model
from plait.models.hf_weights import load_hf_safetensors
from plait.models.moe import Experts, MoE
from plait.plan import Strategy, uniform_plan
from plait.runtime.train import TrainConfig
from plait.runtime.varlen import check_config
from plait.spec.cluster import local_ranks
from plait.spec.model import PRESETS, parse_inline

S = Strategy
MODEL = "tiny-moe"
GBS = 4


def _moe_block(seed: int = 0) -> MoE:
    """Layer 1's MoE block of tiny-moe, with every weight drawn at random."""
    torch.manual_seed(seed)
    moe = MoE(PRESETS[MODEL].stack[1])
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def _dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one at a time, weighted, plus the shared experts: x [N, H]."""
    probs = F.softmax(x @ moe.router.weight.t(), dim=-1)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    e = moe.experts
    rows = []
    for n in range(x.shape[0]):
        out = moe.shared(x[n])
        for w, i in zip(weights[n], chosen[n]):
            out = out + w * (F.silu(e.w1[i] @ x[n]) * (e.w3[i] @ x[n])) @ e.w2[i].t()
        rows.append(out)
    return torch.stack(rows)


def test_routed_experts_match_a_dense_reference() -> None:
    """Dispatch (sort by expert), the experts and the weighted combine equal each token's own top-k experts,
    in the outputs and in every gradient."""
    moe = _moe_block()
    moe.eval()  # no auxiliary gradient: compare the routed path alone
    x = torch.randn(3, 5, moe.router.in_features, requires_grad=True)
    got = moe(x)
    x_ref = x.detach().clone().requires_grad_(True)
    ref_moe = _moe_block()
    want = _dense_reference(ref_moe, x_ref.reshape(-1, x.shape[-1])).view_as(got)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    upstream = torch.randn_like(got)
    got.backward(upstream)
    want.backward(upstream)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(moe.named_parameters(), ref_moe.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_router_groups_limit_a_tokens_experts_to_its_best_groups() -> None:
    """DeepSeek-style group-limited routing (8 experts in 4 groups of 2, the best group, top 2; with top_k = 2 two
    best groups never bind): each token's experts lie in the group whose most probable expert is highest, and are
    the 2 most probable there; the same router without groups takes the plain top 2, and the balancing loss still
    sees every probability."""
    spec = parse_inline("llama:layers=1,hidden=16,heads=2,ffn=32,vocab=32,experts=8,top_k=2,expert_ffn=8,"
                        "expert_groups=4,group_top_k=1")
    grouped = MoE(spec.stack[0])
    plain = MoE(spec.stack[0].with_(expert_groups=0, group_top_k=0))
    plain.load_state_dict(grouped.state_dict())
    x = torch.randn(200, 16)
    probs, chosen, weights = grouped.route(x)
    for p, c in zip(probs, chosen, strict=True):
        best = set(p.view(4, 2).amax(dim=1).topk(1).indices.tolist())
        assert {int(e) // 2 for e in c} <= best
        allowed = torch.tensor([e // 2 in best for e in range(8)])
        assert set(c.tolist()) == set(torch.where(allowed, p, torch.zeros_like(p)).topk(2).indices.tolist())
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(200))
    plain_probs, plain_chosen, _ = plain.route(x)
    torch.testing.assert_close(probs, plain_probs)
    assert (plain_chosen.sort(dim=-1).values == probs.topk(2).indices.sort(dim=-1).values).all()
    assert (chosen.sort(dim=-1).values != plain_chosen.sort(dim=-1).values).any(), "groups must bind somewhere"
    expect_error(lambda: parse_inline("llama:layers=1,hidden=16,heads=2,ffn=32,vocab=32,experts=8,top_k=2,"
                                      "expert_ffn=8,expert_groups=3,group_top_k=2"), "group-limited routing")


class _Allocated(TorchDispatchMode):
    """Bytes of every tensor an op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor))
        return out


def _backward_bytes(experts: int, hidden: int = 32, ffn: int = 64, rows: int = 2) -> float:
    """Bytes the backward of `experts` experts (`rows` rows each) allocates over the bytes of their
    weights."""
    layer = Experts(experts, hidden, ffn)
    for w in layer.parameters():
        torch.nn.init.normal_(w)
    x = torch.randn(rows * experts, hidden, requires_grad=True)
    out = layer(x, torch.full((experts,), rows))
    with _Allocated() as allocated:
        out.backward(torch.ones_like(out))
    return allocated.bytes / sum(w.numel() * w.element_size() for w in layer.parameters())


def test_the_choice_bias_moves_towards_balance_after_each_step() -> None:
    """DeepSeek-V3's router (tiny-deepseek): the choice bias shifts which experts a token takes but not their
    weights (the scores', scaled); after a step it moves by the rate towards balance, the counts of the step's
    forwards whose weight gradients were computed (once when recomputed; not for a forward without backward or
    one asked for its input's gradient only), and the counts restart."""
    from torch.utils.checkpoint import checkpoint

    from plait.models.moe import BIAS_UPDATE_RATE
    from plait.runtime.experts import count_choices, update_choice_biases

    spec = PRESETS["tiny-deepseek"]
    model = build_model(spec, seed=1).train()
    moe = model.layers["1"].feed_forward
    x = torch.randn(64, spec.hidden)
    _, chosen, weights = moe.route(x)
    with torch.no_grad():
        moe.choice_bias[chosen[0, 0]] = -10.0  # token 0's first expert is never taken again
    _, rechosen, reweighed = moe.route(x)
    assert (rechosen != chosen[0, 0]).all() and (rechosen != chosen).any()
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), spec.stack[1].gating.scale))
    scores = moe.router(x).float().sigmoid().gather(1, rechosen)
    torch.testing.assert_close(reweighed, scores / scores.sum(-1, keepdim=True) * 2.5)
    with torch.no_grad():
        moe.choice_bias.zero_()
    count_choices([model])
    tokens = torch.randint(0, spec.vocab, (2, 16))
    model(tokens)  # no backward, or one for the input's gradient only (a pipeline stage's shape probe): not counted
    hidden = torch.randn(2, 16, spec.hidden, requires_grad=True)
    torch.autograd.grad(model.layers["1"](hidden, model.freqs_cis).sum(), hidden)
    assert moe.choice_counts.sum() == 0
    checkpoint(model, tokens, use_reentrant=False).sum().backward()  # the recompute in backward is not counted
    counts = moe.choice_counts.clone()
    assert counts.sum() == 2 * 16 * spec.stack[1].top_k
    update_choice_biases([model], spec)
    torch.testing.assert_close(moe.choice_bias, BIAS_UPDATE_RATE * torch.sign(counts.mean() - counts).float())
    assert moe.choice_counts.sum() == 0 and not any(
        isinstance(m, MoE) and m.choice_bias is not None for m in build_model(PRESETS[MODEL]).modules())


def test_the_experts_backward_allocates_in_proportion_to_the_experts() -> None:
    """Each expert's slice of the stacked weights feeds its gradient back once: the backward allocates a few
    copies of the weights' size however many experts there are, not a weight-sized tensor per expert (what
    indexing a stacked parameter once per expert costs: 12x the weights at 4 experts, 36x at 16)."""
    few, many = _backward_bytes(4), _backward_bytes(16)
    assert 1.0 <= few < 8.0 and many < 8.0 and many < 1.1 * few


def test_balancing_loss_is_the_switch_loss_per_sequence_and_enters_the_backward() -> None:
    """E/k * sum_i f_i P_i per sequence (1 when perfectly balanced), summed over the sequences; training
    adds aux_scale / B times its gradient to the router's."""
    moe = _moe_block(1)
    b, t, k, e = 2, 6, moe.top_k, moe.n_experts
    x = torch.randn(b, t, moe.router.in_features)
    with torch.no_grad():
        probs, chosen, _ = moe.route(x.reshape(b * t, -1))
    want = 0.0
    for s in range(b):
        rows = slice(s * t, (s + 1) * t)
        f = torch.bincount(chosen[rows].flatten(), minlength=e).float() / t  # sums to k
        want += e / k * float((f * probs[rows].mean(0)).sum())
    assert float(moe.aux_loss(probs, chosen, b)) == pytest.approx(want, rel=1e-6)
    uniform = torch.full((t, e), 1.0 / e)
    balanced = torch.arange(t * k).remainder(e).view(t, k)
    assert float(moe.aux_loss(uniform, balanced, 1)) == pytest.approx(1.0)

    moe.train()
    (moe(x) * 0).sum().backward()  # only the balancing loss's gradient reaches the router
    injected = moe.router.weight.grad.clone()
    moe.zero_grad()
    probs, chosen, _ = moe.route(x.reshape(b * t, -1))
    (moe.aux_loss(probs, chosen, b) * moe.aux_scale / b).backward()
    torch.testing.assert_close(injected, moe.router.weight.grad)


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-gpt-oss"])
def test_moe_layers_run_under_bf16_autocast(model: str) -> None:
    """Under autocast (`--dtype bf16`) the experts compute in bf16 and their weighted outputs are summed in the
    residual stream's fp32 (they were refused by index_add as bf16 into fp32); the loss is near fp32's."""
    spec = PRESETS[model]
    net = build_model(spec, seed=0)
    tokens = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        return F.cross_entropy(net(tokens[:, :-1]).float().reshape(-1, spec.vocab), tokens[:, 1:].reshape(-1))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = loss()
    low.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters() if p.requires_grad)
    with torch.no_grad():
        assert float(low) == pytest.approx(float(loss()), rel=2e-2)


def test_tiny_moe_builds_with_its_spec_parameter_count() -> None:
    spec = PRESETS[MODEL]
    assert [b.kind for b in spec.stack] == ["decoder", "moe", "moe", "moe"]
    assert unbuildable(spec) is None and unbuildable(PRESETS["deepseek-moe-16b"]) is None
    assert sum(p.numel() for p in build_model(spec).parameters()) == spec.params


def test_what_the_runtime_refuses_for_moe_names_the_cause() -> None:
    """MoE in GPT models and tp without sp (etp > 1 runs: test_runtime_etp.py); --varlen takes MoE models, and
    the Hugging Face loader MoE checkpoints (tests/test_models.py)."""
    spec = PRESETS[MODEL]
    assert unsupported(uniform_plan("dp=2,ep=2,gbs=4", spec, local_ranks(2), 64), spec) is None
    no_sp = _plan(MODEL, [((0, 4), (0, 1), (S(tp=2), S(tp=2, sp=True, ep=2, etp=1), S(tp=2, ep=2, etp=1), S(dp=2)))],
                  1, 4)
    assert "layer 2 (moe, dp1 tp2 ep2 etp1)" in unsupported(no_sp, spec) and "sp=1" in unsupported(no_sp, spec)
    gpt_moe = parse_inline("gpt:layers=2,hidden=64,heads=4,vocab=512,experts=4,top_k=2,expert_ffn=32")
    assert "MoE layers in llama models" in unbuildable(gpt_moe)
    check_config(TrainConfig(model=MODEL, plan={}, varlen="flexsp", capacity=128), spec, 2)
    expect_error(lambda: load_hf_safetensors(build_model(spec), "."), "no *.safetensors")  # Mixtral's layout loads


TWO_RANKS = {  # name: plan or --strategy text
    "ep2": "dp=2,ep=2,gbs=4",
    "ep2 on tp2+sp attention": "tp=2,sp=1,ep=2,etp=1,gbs=4",
    "ep2 on cp2 attention": "cp=2,ep=2,gbs=4",
    "ep2 full recompute": "dp=2,ep=2,recompute=full,gbs=4",
    "ep2 zero3": "dp=2,ep=2,zero=3,gbs=4",
    "layers tp2|dp2-ep2|tp2-sp-ep2|dp2": _plan(MODEL, [((0, 4), (0, 1), (
        S(tp=2), S(dp=2, ep=2), S(tp=2, sp=True, ep=2, etp=1), S(dp=2)))], 1, 4),
}
FOUR_RANKS = {
    "ep2 x dp2": "dp=4,ep=2,gbs=4",
    "ep2 x dp2 zero1": "dp=4,ep=2,zero=1,gbs=4",
    "ep2 x dp2 on tp2+sp zero3": "dp=2,tp=2,sp=1,ep=2,etp=1,zero=3,gbs=4",
    "ep4 over dp2 x tp2+sp": "dp=2,tp=2,sp=1,ep=4,etp=1,gbs=4",
    "pp2 x ep2": "pp=2,dp=2,ep=2,mbs=1,gbs=4",
    "pp2 x ep2 on the runtime's own schedule": "pp=2,dp=2,ep=2,p2p=megatron,mbs=1,gbs=4",  # the balancing
    # loss's gradient divided by the micro-batches as the loss's
    "pp2 dp2|tp2-sp-ep2 then dp2-ep2|dp2": _plan(MODEL, [
        ((0, 2), (0, 1), (S(dp=2), S(tp=2, sp=True, ep=2, etp=1))),
        ((2, 4), (2, 3), (S(dp=2, ep=2), S(dp=2)))], 2, 2),
}
SAVE, RESUME = "ep2 saved", "ep4 resumed"
QK_MODEL = "llama:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,vocab=512,seq=256,experts=8,top_k=2," \
    "expert_ffn=64,qk_norm=true"
"""Qwen3-MoE's layer in small: per-head q/k norms, routed experts without shared ones."""
QK_CASE = "q/k norms on tp2+sp heads, ep2"


@pytest.fixture(scope="module")
def references(tmp_path_factory, text) -> dict[tuple[str, int], list[float]]:  # noqa: F811
    return reference_losses(tmp_path_factory.mktemp("reference"), text, [(MODEL, GBS), (QK_MODEL, GBS)])


@pytest.fixture(scope="module")
def reference(references) -> list[float]:
    return references[(MODEL, GBS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> dict[int, tuple]:  # noqa: F811
    """Every case in one torchrun job per rank count; the 2-rank job also saves the checkpoint that the 4-rank
    job resumes with ep4."""
    two = {name: (MODEL, plan) for name, plan in TWO_RANKS.items()} | \
        {QK_CASE: (QK_MODEL, "tp=2,sp=1,ep=2,etp=1,gbs=4")}
    return train_saved_then_resumed(tmp_path_factory, text, two,
                                    {name: (MODEL, plan) for name, plan in FOUR_RANKS.items()},
                                    (SAVE, (MODEL, "dp=2,ep=2,gbs=4")), (RESUME, (MODEL, "dp=4,ep=4,gbs=4")))


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_expert_parallel_plans_match_single_process(runs, reference, name) -> None:
    """ep alone, with dp, ZeRO, tp+sp, cp, recompute, pp and per-layer mixes trains to the single-process
    losses."""
    nproc = 2 if name in TWO_RANKS else 4
    plan = {**TWO_RANKS, **FOUR_RANKS}[name]
    if not isinstance(plan, str):
        assert unsupported(plan, PRESETS[MODEL]) is None and plan.ranks[-1] == nproc - 1
    assert_same(_losses(runs[nproc], name), reference)


def test_q_k_norms_on_heads_split_by_tensor_parallelism_match_single_process(runs, references) -> None:
    """Each tp rank norms its own query and key heads with the whole norm weights, whose gradients are then
    summed over the group: the losses are those of one process."""
    assert_same(_losses(runs[2], QK_CASE), references[(QK_MODEL, GBS)])


def test_training_reports_the_expert_load_it_ran(runs) -> None:
    """Every step's metrics carry the busiest expert-parallel rank's routed rows over the mean across its ep
    group (the `expert_load` a plan prices), over the MoE layers: between 1 and the ep degree, and above 1
    when real text is routed over several ranks."""
    for nproc, cases in ((2, TWO_RANKS), (4, FOUR_RANKS)):
        first = runs[nproc][0].first_records
        for name in cases:
            load = first[name]["expert_load"]
            assert 1.0 < load["mean"] <= load["max"] <= (4 if "ep4" in name else 2), name


def test_resume_from_ep2_into_ep4(runs) -> None:
    """A checkpoint written with ep2 (2 ranks) loads with ep4 (4 ranks, experts resharded by DCP): the next
    losses are those of the uninterrupted run."""
    assert_resumed(runs, SAVE, RESUME)
