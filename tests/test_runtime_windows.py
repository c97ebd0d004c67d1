"""Sliding-window attention (Mistral / Gemma-2 / GPT-OSS style `window`, on some or all layers) in the
runtime: a banded causal mask in SDPA, under tensor / sequence, data / ZeRO, pipeline and context
parallelism (ring attention skips the blocks outside every query's window; Ulysses' attention core holds
the whole sequence, so the mask is local) trains to the single-process losses."""

from __future__ import annotations

import pytest
import torch
from test_runtime import text, train_together  # noqa: F401

from plait.executable import unbuildable
from plait.models import build_model
from plait.models.llama import causal_mask
from plait.spec.model import PRESETS, load_model

LOCAL_LLAMA = ("llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=384,vocab=512,max_seq_len=256,window=8,"
               "global_every=2")
"""tiny-llama's shape with a window of 8 tokens on layers 0 and 2 (Gemma-2's alternation)."""
LOCAL_GPT = "gpt:layers=4,hidden=128,heads=4,vocab=512,max_seq_len=256,window=8"
"""tiny-gpt's shape with a window of 8 tokens on every layer."""
STEPS = 3
TOLERANCE = 1e-5
"""Largest absolute difference from the single-process loss at any step."""


def test_causal_mask_keeps_the_window_ending_at_each_query() -> None:
    place = torch.arange(6)
    mask = causal_mask(place, place, 3)
    assert mask.sum(1).tolist() == [1, 2, 3, 3, 3, 3]
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert torch.equal(causal_mask(place, place), causal_mask(place, place, 6))


def test_windowed_models_build_and_a_window_limits_the_reach() -> None:
    for name in ("mistral-7b", "gemma2-9b"):
        assert unbuildable(PRESETS[name]) is None, name
    model = build_model(load_model(LOCAL_GPT))
    tokens = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 0] += 1
    reach = (model(tokens) - model(changed)).abs().amax(-1)[0] > 0
    assert reach.nonzero().max().item() == 4 * 7  # four layers, each 7 tokens further
    mixed = build_model(load_model(LOCAL_LLAMA))
    assert [layer.attention.window for layer in mixed.layers.values()] == [8, 0, 8, 0]


def test_packed_rows_keep_each_layers_window() -> None:
    """The variable-length runtime's attention core (`plait.runtime.varlen.masked`) narrows the document mask
    of a packed row to a windowed layer's window, and leaves it whole for a global layer."""
    import torch.nn.functional as F

    from plait.runtime.packing import document_mask
    from plait.runtime.varlen import masked

    docs, place = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1]), torch.arange(8)
    q, k, v = torch.randn(3, 1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
    mask = document_mask(docs, place, docs, place)
    attend = masked(mask)
    assert torch.equal(attend(q, k, v), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    band = document_mask(docs, place, docs, place, 2)
    assert int(band.sum()) == 1 + 4 * 2 + 1 + 2 * 2  # two documents of 5 and 3 tokens
    assert torch.equal(attend(q, k, v, window=2), F.scaled_dot_product_attention(q, k, v, attn_mask=band))


CASES = {
    "llama tp2 sp dp2 zero1": (LOCAL_LLAMA, "tp=2,sp=1,dp=2,zero=1,gbs=4"),
    "llama cp2 ring dp2": (LOCAL_LLAMA, "cp=2,cp_mode=ring,dp=2,gbs=4"),
    "llama cp2 ulysses dp2": (LOCAL_LLAMA, "cp=2,dp=2,zero=1,gbs=4"),
    "llama pp2 tp2": (LOCAL_LLAMA, "pp=2,tp=2,mbs=2,gbs=4"),
    "gpt cp4 ring": (LOCAL_GPT, "cp=4,cp_mode=ring,gbs=4"),  # key blocks outside every window skipped
}


def test_windowed_models_match_single_process_on_four_ranks(tmp_path_factory, text) -> None:  # noqa: F811
    models = sorted({m for m, _ in CASES.values()})
    _, ref = train_together(tmp_path_factory.mktemp("one"), text, 1, {m: (m, "dp=1,gbs=4") for m in models},
                            {m: {"steps": STEPS} for m in models})
    proc, got = train_together(tmp_path_factory.mktemp("four"), text, 4, CASES,
                               {k: {"steps": STEPS} for k in CASES})
    for key, (model, _) in CASES.items():
        assert len(ref[model]) == STEPS and len(got.get(key, [])) == STEPS, proc.stderr[-3000:]
        assert got[key] == pytest.approx(ref[model], abs=TOLERANCE), key
    assert ref[LOCAL_GPT] != pytest.approx(ref[LOCAL_LLAMA], abs=1e-3)
