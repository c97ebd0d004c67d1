"""recompute=gemm_kept (op-level selective checkpointing): the layer input and every GEMM output are kept, the
rest runs again. Its kept bytes against the price: tests/test_activation_bytes.py; its gradients under swap:
tests/test_memory_hierarchy.py; its losses on two gloo ranks (dp2 swap 0.5, tp2+sp swap 0.5, Ulysses cp2):
tests/test_attn_kept.py. Here: MoE layers and what the runtime refuses."""

from __future__ import annotations

from helpers import assert_bad_input
from typer.testing import CliRunner

from plait.cli import app


def _grads(mode: str) -> dict:
    """Gradients of one fp32 forward and backward of tiny-moe (one process) under recompute `mode`."""
    import torch

    from plait.models import build_model
    from plait.runtime.parallelize import apply_ac
    from plait.spec.model import load_model

    torch.manual_seed(0)
    model = build_model(load_model("tiny-moe"))
    apply_ac(model, mode, list(model.layers))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    model(tokens).float().logsumexp(-1).mean().backward()
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()
            if p.grad is not None}


def test_moe_layers_train_to_the_gradients_of_no_recompute() -> None:
    """Routing (top-k, scatter) and the experts' elementwise work run again from the kept GEMM outputs."""
    base, kept = _grads("none"), _grads("gemm_kept")
    assert len(base) == len(kept) == 51
    assert max((kept[n] - base[n]).abs().max().item() for n in base) <= 1e-6


def test_train_refuses_it_with_ring_attention_in_one_line() -> None:
    result = CliRunner().invoke(app, ["train", "--model", "tiny-llama", "--strategy",
                                      "cp=2,cp_mode=ring,recompute=gemm_kept", "--nproc", "2", "--steps", "1",
                                      "--seq-len", "64"])
    assert_bad_input(result, "recompute=gemm_kept", "use cp_mode=ulysses or another recompute mode")
