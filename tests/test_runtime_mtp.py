"""Multi-token prediction (DeepSeek-V3's MTP modules) in the runtime: the module computes what the paper and
Megatron-LM write, the model holds the parameters the cost model counts, the loss adds the modules' means at
MTP_LOSS_SCALE, and data, ZeRO-3, expert and pipeline parallelism (the last stage looking the tokens ahead up
in its own copy of the table, laid out like the first stage's or not) and recompute train a DeepSeek-shaped
tiny model (latent attention, routed and shared experts, one module) to the single-process losses; checkpoints
move between plans with and without the copy (gloo, real torchrun launches, fp32; see tests/test_runtime.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from test_runtime import _losses, assert_same, reference_losses, text, train_together  # noqa: F401 (fixture)
from test_runtime_kinds import _plan

from plait.executable import unsupported
from plait.models import build_model
from plait.models.mtp import MTP_LOSS_SCALE, MTPLayer, mtp_loss
from plait.plan import Strategy
from plait.spec.model import load_model

S = Strategy
MODEL = ("llama:layers=4,hidden=64,heads=4,kv_heads=4,head_dim=16,ffn=192,vocab=512,seq=256,q_lora=32,kv_lora=16,"
         "rope_head_dim=8,v_head_dim=16,experts=8,top_k=2,expert_ffn=64,shared_ffn=64,dense_first=1,expert_groups=4,"
         "group_top_k=2,mtp=1")
GBS = 4
SAVED_STEPS, RESUME_AT = 6, 3


def test_the_module_predicts_the_token_two_ahead_as_megatron_writes_it() -> None:
    """Depth 1 by hand: the normed embedding of the next token beside the normed trunk state, projected, the
    module's layer, its final norm and the shared head; the loss is the trunk's plus MTP_LOSS_SCALE times the
    module's on the positions with a token two ahead."""
    spec = load_model(MODEL)
    model = build_model(spec, seed=1)
    assert spec.layers == 5 and spec.mtp_layers == 1 and model.holds_mtp
    assert sum(p.numel() for p in model.parameters()) == spec.params
    torch.manual_seed(0)
    seq = torch.randint(0, spec.vocab, (2, 17))
    tokens, targets = seq[:, :-1], seq[:, 1:]
    out = model(tokens, next_tokens=targets)
    assert out.shape == (2, 2, 16, spec.vocab)
    trunk = model.norm(_trunk(model, tokens))
    module: MTPLayer = model.layers["4"]
    h = module.eh_proj(torch.cat([module.enorm(model.tok_embeddings(targets)), module.hnorm(trunk)], dim=-1))
    h = module.final_norm(super(MTPLayer, module).forward(h, model.freqs_cis))
    torch.testing.assert_close(out[0], model.output(trunk).float())
    torch.testing.assert_close(out[1], model.output(h).float())
    main = F.cross_entropy(out[0].reshape(-1, spec.vocab), targets.reshape(-1))
    ahead = F.cross_entropy(out[1][:, :-1].reshape(-1, spec.vocab), seq[:, 2:].reshape(-1))
    torch.testing.assert_close(mtp_loss(out, targets), main + MTP_LOSS_SCALE * ahead)


def _trunk(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    h = model.tok_embeddings(tokens)
    for i in range(4):
        h = model.layers[str(i)](h, model.freqs_cis)
    return h


TWO_RANKS = {  # name: plan or --strategy text
    "dp2": "dp=2,gbs=4",
    "dp2 ep2 zero3 full recompute": "dp=2,ep=2,zero=3,recompute=full,gbs=4",
    "pp2": "pp=2,mbs=1,gbs=4",
    "pp2 own schedule (p2p=megatron)": "pp=2,p2p=megatron,mbs=1,gbs=4",
}
FOUR_RANKS = {
    "pp2 x dp2 ep2 zero1": "pp=2,dp=2,ep=2,zero=1,mbs=1,gbs=4",
    "pp2 interleaved": "pp=2,vpp=2,dp=2,mbs=1,gbs=4",
    "tp2+sp stage, then dp2 ep2 stage": _plan(MODEL, [((0, 3), (0, 1), (S(tp=2, sp=True, ep=2, etp=1),)),
                                                      ((3, 5), (2, 3), (S(dp=2, ep=2),))], 2, 2),
}
SAVES = {"pp2 saved": "pp=2,mbs=1,gbs=4", "dp2 saved": "dp=2,ep=2,gbs=4"}  # with the table's copy, without
RESUMES = {"pp2 resumed as dp4": ("pp2 saved", "dp=4,ep=2,gbs=4"),
           "dp2 resumed as pp2 x dp2": ("dp2 saved", "pp=2,dp=2,mbs=1,gbs=4")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text) -> list[float]:  # noqa: F811
    return reference_losses(tmp_path_factory.mktemp("reference"), text, [(MODEL, GBS)])[(MODEL, GBS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> dict[int, tuple]:  # noqa: F811
    """Every case in one torchrun job per rank count; the 2-rank job saves checkpoints (after steps 3 and 6;
    the second is removed) that the 4-rank job resumes under other plans."""
    ckpt = {name: tmp_path_factory.mktemp(name.replace(" ", "-")) for name in SAVES}
    two = {name: (MODEL, plan) for name, plan in {**TWO_RANKS, **SAVES}.items()}
    out = {2: train_together(tmp_path_factory.mktemp("ranks2"), text, 2, two, {
        name: {"steps": SAVED_STEPS, "checkpoint_dir": str(ckpt[name]), "checkpoint_every": RESUME_AT}
        for name in SAVES})}
    for path in ckpt.values():
        shutil.rmtree(path / f"step-{SAVED_STEPS}", ignore_errors=True)
    four = {name: (MODEL, plan) for name, plan in FOUR_RANKS.items()} | \
        {name: (MODEL, plan) for name, (_, plan) in RESUMES.items()}
    out[4] = train_together(tmp_path_factory.mktemp("ranks4"), text, 4, four, {
        name: {"steps": SAVED_STEPS, "checkpoint_dir": str(ckpt[saved])} for name, (saved, _) in RESUMES.items()})
    return out


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_multi_token_prediction_plans_match_single_process(runs, reference, name) -> None:
    """dp, ZeRO-3 with ep and full recompute, pp (torch's schedules, the runtime's own, interleaved), and a
    pipeline whose ends lay the table out differently train to the single-process losses."""
    nproc = 2 if name in TWO_RANKS else 4
    plan = {**TWO_RANKS, **FOUR_RANKS}[name]
    if not isinstance(plan, str):
        assert unsupported(plan, load_model(MODEL)) is None and plan.ranks[-1] == nproc - 1
    assert_same(_losses(runs[nproc], name), reference)


@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoints_move_between_plans_with_and_without_the_tables_copy(runs, name) -> None:
    """A checkpoint written by a pipeline (the last stage's copy of the table saved beside the embedding) resumes
    on one stage, and one written on one stage resumes in a pipeline (its copy read from the embedding): the
    next losses are those of the uninterrupted run."""
    saved, resumed = runs[2][1].get(RESUMES[name][0]), runs[4][1].get(name)
    assert saved is not None and len(saved) == SAVED_STEPS, runs[2][0].stderr[-3000:]
    assert resumed is not None and len(resumed) == SAVED_STEPS - RESUME_AT, runs[4][0].stderr[-3000:]
    assert_same(resumed, saved[RESUME_AT:])
