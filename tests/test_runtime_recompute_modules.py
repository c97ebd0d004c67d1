"""Megatron-LM's module-wise recompute in the runtime (`Strategy.recompute_modules`: layernorm, moe_act,
mla_up_proj, mlp). What a layer stops keeping for backward is what `plait.cost.recompute_modules.dropped_bytes` prices, each
difference named; the gradients are bitwise those without it; and plans with it train to the single-process
losses under tensor+sequence, expert, context and pipeline parallelism and ZeRO-3 (gloo, real torchrun launches,
fp32; see tests/test_runtime.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_runtime import text  # noqa: F401 (a fixture)
from test_runtime import SEQ as RUN_SEQ
from test_runtime import _losses, assert_same, reference_losses, train_together
from torch.multiprocessing.reductions import StorageWeakRef

from plait.cost import comm
from plait.cost.calibration import DEFAULT_CALIBRATION
from plait.cost.layer import BlockContext
from plait.cost.precision import PRECISIONS
from plait.cost.recompute_modules import dropped_bytes
from plait.executable import unsupported
from plait.plan import Plan, Strategy, uniform_plan
from plait.spec.cluster import dgx, local_ranks
from plait.spec.layers import Block
from plait.spec.model import load_model

SEQS, SEQ = 2, 48
FP32 = 4
LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=97,max_seq_len=48"


class _SavedMeter:
    """Peak bytes of what one block keeps for backward: every saved tensor's storage once while alive, but
    parameters (unlike the swap meter, expert rows are counted too)."""

    def __init__(self, model: torch.nn.Module, block: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        block.register_forward_pre_hook(lambda *_: hooks.__enter__())
        block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params and not (t.requires_grad and t.grad_fn is None):
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return t


def _kept(spec: str, layer: str, mode: str, modules: tuple[str, ...], dtype: str, swap: float = 0.0
          ) -> tuple[float, list[torch.Tensor]]:
    """Bytes per token that `layer` keeps for backward with the recompute `modules` (with a `swap`: the bytes
    the swap moved to the host, every layer), and the model's gradients after one backward."""
    from plait.models import build_model
    from plait.runtime.parallelize import apply_ac, apply_recompute_modules
    from plait.runtime.swap import apply_swap

    torch.manual_seed(0)
    model_spec = load_model(spec)
    model = build_model(model_spec)
    apply_recompute_modules(model, modules, list(model.layers))
    apply_ac(model, mode, list(model.layers))
    apply_swap(model, swap, list(model.layers))
    meter = _SavedMeter(model, model.layers[layer]) if not swap else None
    tokens = torch.randint(0, model_spec.vocab, (SEQS, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        model(tokens).float().logsumexp(-1).mean().backward()
    kept = meter.peak if meter is not None else model.swap_meter.swapped
    return kept / (SEQS * SEQ), [p.grad for p in model.parameters() if p.grad is not None]


def _priced(spec: str, layer: str, mode: str, modules: tuple[str, ...], dtype: str) -> float:
    """Bytes per token the cost model says `layer` no longer keeps with `modules` (one device)."""
    model = load_model(spec)
    ctx = BlockContext(model, dgx(1, 8, "A100-80GB"), DEFAULT_CALIBRATION, PRECISIONS[dtype], SEQ, SEQS,
                       comm.SINGLE, comm.SINGLE, comm.SINGLE)
    s = Strategy(recompute=mode, recompute_modules=modules)  # type: ignore[arg-type]
    return dropped_bytes(model.stack[int(layer)], s, SEQS * SEQ, ctx) / (SEQS * SEQ)


Cause = Callable[[Block, int], float]
"""Bytes per token a cause adds to what the runtime drops over the price, from the layer and the activation
element size (bytes)."""
NORMS_OWN = "the norms keep only their input, their own statistics and CPU's composite rms_norm's normalized " \
    "input (fp32, not priced) go too, as under Megatron's CheckpointWithoutOutput"
CAUSES: dict[str, Cause] = {
    NORMS_OWN: lambda b, eb: 2 * FP32 + 2 * b.hidden * FP32,
    "autocast cast the norm outputs once per projection (q, k, v; gate, up), the block casts them once":
        lambda b, eb: 3 * b.hidden * eb,
    "the values are a view of the kv up-projection's output, which holds the keys' plain part too":
        lambda b, eb: b.heads * b.head_dim * eb,
    "GPT-OSS's clamped SwiGLU in eager ops keeps three more F-wide tensors per routed pair than the fused form "
    "priced (the clamped gate, the clamped up + 1, gate x sigmoid); the recomputed activation drops them too":
        lambda b, eb: b.top_k * 3 * b.expert_ffn * eb,
    "the checkpointed MLP drops autocast's copies of its three weights too (cast again in backward; bytes per "
    "step, here over the step's tokens)": lambda b, eb: 3 * b.hidden * b.ffn * eb / (SEQS * SEQ),
}
_CAUSE = list(CAUSES)
CASES = {  # name: (spec, layer, recompute, modules, dtype, causes)
    "llama layernorm fp32": (LLAMA, "0", "none", ("layernorm",), "fp32", [NORMS_OWN]),
    "llama layernorm bf16": (LLAMA, "0", "none", ("layernorm",), "bf16", [NORMS_OWN, _CAUSE[1]]),
    "llama mlp fp32": (LLAMA, "0", "none", ("mlp",), "fp32", []),
    "llama mlp bf16": (LLAMA, "0", "none", ("mlp",), "bf16", [_CAUSE[4]]),
    "llama layernorm+mlp fp32": (LLAMA, "0", "none", ("layernorm", "mlp"), "fp32", [NORMS_OWN]),
    "deepseek moe layer moe_act fp32": ("tiny-deepseek", "1", "none", ("moe_act",), "fp32", []),
    "deepseek moe layer moe_act bf16": ("tiny-deepseek", "1", "none", ("moe_act",), "bf16", []),
    "deepseek dense layer mlp fp32": ("tiny-deepseek", "0", "none", ("mlp",), "fp32", []),
    "deepseek mla_up_proj selective fp32": ("tiny-deepseek", "1", "selective", ("mla_up_proj",), "fp32", [_CAUSE[2]]),
    "gpt-oss moe_act fp32": ("tiny-gpt-oss", "0", "none", ("moe_act",), "fp32", [_CAUSE[3]]),
    "gpt-oss layernorm fp32": ("tiny-gpt-oss", "0", "none", ("layernorm",), "fp32", [NORMS_OWN]),
}


@pytest.mark.parametrize("name", CASES)
def test_dropped_bytes_are_priced_and_gradients_unchanged(name: str) -> None:
    """The bytes a layer stops keeping equal the price plus the named causes, and every gradient is bitwise
    the one without recompute modules (the dropped tensors are made again from the same inputs)."""
    spec, layer, mode, modules, dtype, causes = CASES[name]
    block, eb = load_model(spec).stack[int(layer)], PRECISIONS[dtype].activation
    kept, grads = _kept(spec, layer, mode, (), dtype)
    kept_with, grads_with = _kept(spec, layer, mode, modules, dtype)
    priced = _priced(spec, layer, mode, modules, dtype)
    explained = {c: CAUSES[c](block, eb) for c in causes}
    print(f"{name}: drops {kept - kept_with:,.0f} B/token/layer of {kept:,.0f}, priced {priced:,.0f}, explained "
          f"{ {c[:40]: round(v) for c, v in explained.items()} }")
    assert priced > 0
    assert kept - kept_with == pytest.approx(priced + sum(explained.values()), abs=0.5)
    if dtype == "fp32" or modules != ("layernorm",):  # bf16 layernorm: the projections' input gradients add
        assert len(grads) == len(grads_with)     # up in bf16 (cast once), not in fp32
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_with))


@pytest.mark.parametrize("spec", [LLAMA, "tiny-deepseek"])
def test_a_swap_moves_the_inputs_tensors_are_made_from(spec: str) -> None:
    """With a swap, what the dropped tensors are made from is swapped as every saved tensor (the block's input
    for the norms, the experts' first GEMM outputs, the latents) and joined again for the rebuild: the
    gradients are bitwise those with neither, and less moves to the host than without the modules."""
    modules = ("layernorm", "moe_act", "mla_up_proj", "mlp")
    _, plain = _kept(spec, "0", "none", (), "fp32")
    swapped, grads = _kept(spec, "0", "none", modules, "fp32", swap=0.5)
    swapped_alone, _ = _kept(spec, "0", "none", (), "fp32", swap=0.5)
    assert 0 < swapped < swapped_alone
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
    model, ranks = load_model(spec), local_ranks(2)
    assert unsupported(uniform_plan("dp=2,swap=0.5,gbs=4,recompute_modules=" + "+".join(modules), model, ranks,
                                    SEQ), model) is None


def _first_layer_only(model: str, strategy: str) -> Plan:
    """The uniform plan of `strategy` on 2 ranks with its recompute modules in the first layer only."""
    plan = uniform_plan(strategy, load_model(model), local_ranks(2), RUN_SEQ)
    (stage,) = plan.pipelines[0].stages
    s = stage.strategies[0]
    layers = [s] + [s.model_copy(update={"recompute_modules": ()})] * (stage.num_layers - 1)
    pipe = plan.pipelines[0].model_copy(update={"stages": (stage.model_copy(update={"strategies": tuple(layers)}),)})
    return plan.model_copy(update={"pipelines": (pipe,)})


MODELS = {"tiny-deepseek": 4, "tiny-gpt-oss": 4, "tiny-llama": 4}
ALL = "recompute_modules=layernorm+moe_act+mla_up_proj+mlp"
TWO_RANKS = {  # name: (model, --strategy)
    "deepseek tp2+sp ep2 all": ("tiny-deepseek", f"tp=2,sp=1,ep=2,etp=1,gbs=4,{ALL}"),  # gathered norm outputs
    "deepseek ulysses cp2 selective": ("tiny-deepseek", f"cp=2,recompute=selective,gbs=4,{ALL}"),  # a2a rebuilt
    "gpt-oss tp2+sp etp2 norm+act": ("tiny-gpt-oss", "tp=2,sp=1,gbs=4,recompute_modules=layernorm+moe_act"),
    "llama dp2 zero3 norm+mlp in layer 0": ("tiny-llama", _first_layer_only(
        "tiny-llama", "dp=2,zero=3,gbs=4,recompute_modules=layernorm+mlp")),  # per layer: FSDP units of each
}
FOUR_RANKS = {
    "deepseek pp2 x dp2 ep2 all": ("tiny-deepseek", f"pp=2,dp=2,ep=2,mbs=1,gbs=4,{ALL}"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text) -> dict[tuple[str, int], list[float]]:  # noqa: F811
    return reference_losses(tmp_path_factory.mktemp("reference"), text, list(MODELS.items()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text) -> dict[int, tuple]:  # noqa: F811
    return {2: train_together(tmp_path_factory.mktemp("ranks2"), text, 2, TWO_RANKS),
            4: train_together(tmp_path_factory.mktemp("ranks4"), text, 4, FOUR_RANKS)}


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_plans_with_recompute_modules_match_single_process(runs, reference, name) -> None:
    """Each plan trains to the single-process losses of its model."""
    model = (TWO_RANKS | FOUR_RANKS)[name][0]
    assert_same(_losses(runs[2 if name in TWO_RANKS else 4], name), reference[(model, MODELS[model])])
