"""The bytes a layer keeps for backward, as the runtime's real modules keep them, against the cost model's price.

One process builds a tiny model with the runtime's own modules (`build_model`, `apply_ac`), counts what its
first layer saves for backward with the swap meter (`runtime/swap.py`: saved-tensor hooks plus attn_kept's and
gemm_kept's selective-checkpoint cache; each storage once, tensors with a token dimension), and compares bytes
per token per layer with `cost/layer.block_activation_bytes` for every recompute mode. Where they differ, each
cause is named in EXPLAINED with its bytes (docs/cost-model.md, "What a layer keeps for backward"); a new
recompute mode adds its rows there.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import pytest

from helpers import ranks_command
from plait.cost import comm
from plait.cost.calibration import DEFAULT_CALIBRATION
from plait.cost.layer import BlockContext, block_activation_bytes
from plait.cost.precision import PRECISIONS
from plait.plan import Strategy
from plait.spec.cluster import dgx
from plait.spec.layers import LSE_BYTES, MASK_BYTES, Block, Recompute
from plait.spec.model import load_model

SPECS = {"gpt": "gpt:layers=2,hidden=64,heads=4,vocab=97,max_seq_len=48",
         "llama": "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=97,max_seq_len=48"}
SEQS, SEQ = 2, 48
FP32 = 4
"""Bytes of an fp32 element (what autocast keeps in fp32: the residual stream, norm statistics)."""
MODES: tuple[str, ...] = get_args(Recompute)

Cause = Callable[[Block, int], float]
"""Bytes per token per layer a cause adds to the runtime's count over the price, from the layer and the
activation element size (bytes)."""
CAUSES: dict[str, Cause] = {
    # Every mode.
    "norm statistics (rsqrt, or LayerNorm mean and rstd), fp32, not priced":
        lambda b, eb: b.norms * FP32 * (1 if b.norm == "rmsnorm" else 2),
    "CPU's composite rms_norm also keeps the normalized input (fp32), not priced":
        lambda b, eb: b.norms * b.hidden * FP32 if b.norm == "rmsnorm" else 0,
    "grouped-query k and v are expanded to the query heads before SDPA":
        lambda b, eb: 2 * (b.q_dim - b.k_dim) * eb,
    "the log-sum-exp is fp32 whatever the activation dtype (priced at the activation width)":
        lambda b, eb: b.heads * LSE_BYTES * (1 - eb / 2),
    "the runtime trains without dropout (build_model's dropout=0): no masks":
        lambda b, eb: -2 * b.hidden * MASK_BYTES if b.dropout else 0,
    # bf16 under autocast (runtime/train.py): fp32 residual stream and per-linear input casts.
    "autocast keeps the residual stream fp32 (the layer input and the mid-layer sum)":
        lambda b, eb: 2 * b.hidden * (FP32 - eb),
    "autocast keeps the layer input fp32":
        lambda b, eb: b.hidden * (FP32 - eb),
    "autocast casts the norm output once per linear (q, k, v; the gated MLP's gate and up)":
        lambda b, eb: (2 + (1 if b.gated_mlp else 0)) * b.hidden * eb,
    "autocast casts RoPE's cos and sin per layer":
        lambda b, eb: 2 * b.head_dim * eb if b.rope else 0,
}
_EVERY = ["norm statistics (rsqrt, or LayerNorm mean and rstd), fp32, not priced",
          "CPU's composite rms_norm also keeps the normalized input (fp32), not priced",
          "grouped-query k and v are expanded to the query heads before SDPA",
          "the log-sum-exp is fp32 whatever the activation dtype (priced at the activation width)",
          "the runtime trains without dropout (build_model's dropout=0): no masks"]
_AUTOCAST = ["autocast keeps the residual stream fp32 (the layer input and the mid-layer sum)",
             "autocast casts the norm output once per linear (q, k, v; the gated MLP's gate and up)",
             "autocast casts RoPE's cos and sin per layer"]
_LSE = "the log-sum-exp is fp32 whatever the activation dtype (priced at the activation width)"
_SELECTIVE = [c for c in _EVERY if c != _LSE]  # the recomputed core keeps no log-sum-exp
EXPLAINED: dict[tuple[str, str], list[str]] = {
    # (dtype, mode) -> causes of the difference (any family; a cause that does not apply adds 0).
    ("fp32", "none"): _EVERY,
    ("bf16", "none"): _EVERY + _AUTOCAST,
    ("fp32", "selective"): _SELECTIVE,
    ("bf16", "selective"): _SELECTIVE + _AUTOCAST,
    ("fp32", "attn_kept"): [_LSE],
    ("bf16", "attn_kept"): [_LSE, "autocast keeps the layer input fp32"],
    ("fp32", "gemm_kept"): [],
    ("bf16", "gemm_kept"): ["autocast keeps the layer input fp32"],
    ("fp32", "full"): [],
    ("bf16", "full"): ["autocast keeps the layer input fp32"],
}


def measured_bytes_per_token(spec: str, mode: str, dtype: str) -> float:
    """Bytes per token that layer 0 of the runtime's model keeps for backward (the swap meter's peak)."""
    import torch

    from plait.models import build_model
    from plait.runtime import swap
    from plait.runtime.parallelize import apply_ac

    torch.manual_seed(0)
    model = build_model(load_model(spec))
    apply_ac(model, mode, list(model.layers))
    meter = swap.SwapMeter.of(model)
    swap.attach(model.layers["0"], 0.0, meter)
    tokens = torch.randint(0, 97, (SEQS, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return meter.resident_peak / (SEQS * SEQ)


def priced_bytes_per_token(spec: str, mode: str, dtype: str) -> float:
    """Bytes per token the cost model prices for one layer of `spec` (one device, no parallelism)."""
    model = load_model(spec)
    ctx = BlockContext(model, dgx(1, 8, "A100-80GB"), DEFAULT_CALIBRATION, PRECISIONS[dtype], SEQ, SEQS,
                       comm.SINGLE, comm.SINGLE, comm.SINGLE)
    return block_activation_bytes(model.block, Strategy(recompute=mode), ctx) / (SEQS * SEQ)


def test_every_recompute_mode_has_its_explained_rows() -> None:
    assert {mode for _, mode in EXPLAINED} == set(MODES)
    assert all(c in CAUSES for causes in EXPLAINED.values() for c in causes)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", sorted(SPECS))
def test_priced_activation_bytes_are_what_the_runtime_keeps(family: str, mode: str, dtype: str) -> None:
    spec = SPECS[family]
    block, eb = load_model(spec).block, PRECISIONS[dtype].activation
    measured, priced = measured_bytes_per_token(spec, mode, dtype), priced_bytes_per_token(spec, mode, dtype)
    explained = {c: CAUSES[c](block, eb) for c in EXPLAINED[(dtype, mode)]}
    print(f"{family} {dtype} {mode}: runtime {measured:,.0f} B/token/layer, priced {priced:,.0f}, explained "
          f"{ {c: round(v) for c, v in explained.items() if v} }")
    assert measured == pytest.approx(priced + sum(explained.values()), abs=0.5)
    if not explained:
        assert measured == pytest.approx(priced, rel=0.05)


TP = 2
WHOLE_UNDER_SP = {"autocast casts RoPE's cos and sin per layer"}
"""Causes that sequence parallelism does not split: the rotary tables cover the gathered sequence."""
NOT_UNDER_SP = {"autocast casts the norm output once per linear (q, k, v; the gated MLP's gate and up)"}
"""Causes absent under sequence parallelism: the block casts its norm's shard once, before the gather, and
keeps that shard alone (`plait.models.llama.TransformerBlock.through`)."""


@pytest.fixture(scope="module")
def sp_measured(tmp_path_factory) -> dict[str, float]:
    """tests/sp_bytes_check.py on 2 ranks: bytes per token layer 0 keeps under tp2+sp, by family, dtype, mode."""
    out = tmp_path_factory.mktemp("sp") / "bytes.json"
    here = Path(__file__).parent
    cmd = ranks_command(TP, str(here / "sp_bytes_check.py"), str(out), json.dumps(SPECS))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(here.parent)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective"])
@pytest.mark.parametrize("family", sorted(SPECS))
def test_under_sequence_parallelism_each_rank_keeps_its_shard_as_priced(sp_measured, family: str, mode: str,
                                                                         dtype: str) -> None:
    """Under tp2+sp each rank keeps 1/tp of the layer's bytes, as Megatron-LM's sequence parallelism and the
    price (the projections' inputs as sequence shards, gathered again in backward), plus the single-process
    causes split as the layer splits."""
    spec = SPECS[family]
    block, eb = load_model(spec).block, PRECISIONS[dtype].activation
    model = load_model(spec)
    ctx = BlockContext(model, dgx(1, 8, "A100-80GB"), DEFAULT_CALIBRATION, PRECISIONS[dtype], SEQ, SEQS,
                       comm.SINGLE, comm.SINGLE, comm.SINGLE)
    priced = block_activation_bytes(model.block, Strategy(tp=TP, sp=True, recompute=mode), ctx) / (SEQS * SEQ)
    explained = sum(CAUSES[c](block, eb) / (1 if c in WHOLE_UNDER_SP else TP)
                    for c in EXPLAINED[(dtype, mode)] if c not in NOT_UNDER_SP)
    measured = sp_measured[f"{family} {dtype} {mode}"]
    print(f"{family} {dtype} {mode} tp2+sp: runtime {measured:,.0f} B/token/layer, priced {priced:,.0f}, "
          f"explained {explained:,.0f}")
    assert measured == pytest.approx(priced + explained, abs=0.5)
