"""Selective KV caches: product quantisation, each method's selection, the Hugging Face integration on a
small random Llama, and (when SmolLM2 is installed) retrieval and perplexity on the real model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import expect_error

from plait.inference.config import PQCacheConfig
from plait.inference.pq import fit
from plait.inference.select import LayerCache


def _keys(g=3, t=400, d=32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(g, 12, d, generator=gen) * 2
    pick = torch.randint(0, 12, (g, t), generator=gen)
    return torch.gather(centres, 1, pick[..., None].expand(-1, -1, d)) + 0.5 * torch.randn(g, t, d, generator=gen)


def _error(keys, subspaces, bits) -> float:
    book = fit(keys, subspaces, bits)
    return float(((book.reconstruct() - keys) ** 2).sum() / (keys**2).sum())


def test_reconstruction_error_falls_with_more_subspaces_and_bits() -> None:
    keys = _keys()
    by_bits = [_error(keys, 4, b) for b in (2, 4, 6)]
    by_sub = [_error(keys, m, 4) for m in (1, 4, 16)]
    assert by_bits[0] > by_bits[1] > by_bits[2], by_bits
    assert by_sub[0] > by_sub[1] > by_sub[2], by_sub


def test_scores_are_inner_products_with_the_reconstructed_keys() -> None:
    keys = _keys(t=100)
    book = fit(keys, 4, 3)
    q = torch.randn(3, 5, 32)
    assert torch.allclose(book.scores(q), q @ book.reconstruct().transpose(-1, -2), atol=1e-4)
    before = book.codes.shape[1]
    book.append(keys[:, :7])
    assert book.codes.shape[1] == before + 7 and torch.equal(book.codes[:, before:], book.codes[:, :7])


def _exact(q, k, v, scale):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), scale=scale)


def _run(method: str, budget: float, t=120, steps=6, **kw) -> tuple[LayerCache, list[torch.Tensor], list[torch.Tensor]]:
    """Prefill t tokens then decode `steps`; returns the cache, its decode outputs and exact ones."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, t + steps, 16, generator=gen)
    k = torch.randn(1, 2, t + steps, 16, generator=gen)
    v = torch.randn(1, 2, t + steps, 16, generator=gen)
    cache = LayerCache(PQCacheConfig(method=method, budget=budget, sinks=2, recent=8, observation=8, **kw))
    scale = 0.25
    out = cache.prefill(q[:, :, :t], k[:, :, :t], v[:, :, :t], scale)
    causal = F.scaled_dot_product_attention(q[:, :, :t], k[:, :, :t].repeat_interleave(2, 1),
                                            v[:, :, :t].repeat_interleave(2, 1), is_causal=True, scale=scale)
    assert torch.allclose(out, causal, atol=1e-5)
    got, want = [], []
    for s in range(t, t + steps):
        got.append(cache.decode(q[:, :, s: s + 1], k[:, :, s: s + 1], v[:, :, s: s + 1], scale))
        want.append(_exact(q[:, :, s: s + 1], k[:, :, : s + 1], v[:, :, : s + 1], scale))
    return cache, got, want


@pytest.mark.parametrize("method", ["full", "pqcache", "window", "h2o", "snapkv"])
def test_a_budget_of_everything_is_exact_attention(method) -> None:
    _, got, want = _run(method, budget=1000)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)


def test_each_method_attends_to_its_budget() -> None:
    for method in ("pqcache", "window", "h2o"):
        cache, got, want = _run(method, budget=0.25)
        assert cache.budget == 30
        assert not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))  # approximate now
    h2o, *_ = _run("h2o", budget=0.25)
    assert h2o.kept.shape[-1] == 30 and bool((h2o.kept[..., -8:] >= 126 - 8).all())  # recent window kept
    snap, *_ = _run("snapkv", budget=0.25)
    assert snap.kept.shape[-1] == 30 + 6  # chosen at prefill, then every decoded token


def test_pq_selection_keeps_sinks_and_recent_and_measures_recall() -> None:
    cache, *_ = _run("pqcache", budget=0.25, measure_recall=True, subspaces=16, bits=8)
    assert len(cache.recall) == 6 and min(cache.recall) > 0.5, cache.recall
    chosen = set(cache.last[0, 0].tolist())
    assert len(chosen) == 30 and {0, 1} <= chosen and set(range(126 - 8, 126)) <= chosen
    # With as many centroids as keys per sub-space the scores are nearly exact: recall near 1.
    exact, *_ = _run("pqcache", budget=0.25, measure_recall=True, subspaces=16, bits=8, t=60)
    assert sum(exact.recall) / len(exact.recall) > 0.9, exact.recall


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        PQCacheConfig(method="lru")
    with pytest.raises(ValueError):
        PQCacheConfig(budget=0)
    assert PQCacheConfig(budget=0.1, sinks=4, recent=32).tokens(2000) == 200
    assert PQCacheConfig(budget=0.01, sinks=4, recent=32).tokens(2000) == 36
    assert PQCacheConfig(budget=300).tokens(2000) == 300
    for budget in (1, 1.5, 1.99, 2.5, float("inf")):
        with pytest.raises(ValueError, match="budget must be a fraction below 1 or a whole number of tokens from 2"):
            PQCacheConfig(budget=budget)


@pytest.fixture(scope="module")
def tiny_llama():
    pytest.importorskip("transformers", reason="the 'inference' extra (transformers) is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def test_generate_with_a_full_selection_equals_transformers_own_cache(tiny_llama) -> None:
    from plait.inference.hf import SelectiveCache

    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        native = tiny_llama.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        for method in ("full", "pqcache", "h2o", "snapkv", "window"):
            cache = SelectiveCache(tiny_llama, PQCacheConfig(method=method, budget=1000))
            ours = tiny_llama.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True, cache=cache)
            cache.release()
            assert torch.equal(ours.sequences, native.sequences), method
            for a, b in zip(ours.logits, native.logits):
                assert torch.allclose(a, b, atol=1e-4), method
    assert tiny_llama.config._attn_implementation != "plait_selective"  # released


def test_a_small_budget_changes_attention_but_generates(tiny_llama) -> None:
    from plait.inference.hf import SelectiveCache

    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    cache = SelectiveCache(tiny_llama, PQCacheConfig(method="pqcache", budget=0.2, sinks=2, recent=8,
                                                     measure_recall=True))
    with torch.no_grad():
        native = tiny_llama.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        out = tiny_llama.generate(ids, max_new_tokens=5, do_sample=False, cache=cache, output_logits=True,
                                  return_dict_in_generate=True)
    cache.release()
    assert out.sequences.shape[1] == 205
    assert len(out.logits) == len(native.logits) == 5
    for ours, full in zip(out.logits, native.logits):  # attending to 40 of ~200 tokens changes every step
        assert (ours - full).abs().max() > 1e-3
    assert cache.recall() is not None and 0 < cache.recall() <= 1
    sizes = cache.bytes()
    assert sizes["resident"] < sizes["full_kv"] / 2, sizes


class _CharTokenizer:
    """One token per character (enough for the length checks)."""

    def __call__(self, text: str, return_tensors: str = "pt"):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=torch.zeros(1, len(text), dtype=torch.long))


def test_kv_eval_inputs_are_checked_before_any_trial(tiny_llama) -> None:
    from plait.inference.evaluate import check_inputs

    tok, text = _CharTokenizer(), "x" * 400
    check_inputs(tiny_llama, tok, PQCacheConfig(subspaces=8), 256, 64, text)
    expect_error(lambda: check_inputs(tiny_llama, tok, PQCacheConfig(subspaces=7), 256, 64, text),
                 "--subspaces 7 does not divide the model's head dimension 16")
    check_inputs(tiny_llama, tok, PQCacheConfig(method="window", subspaces=7), 256, 64, text)  # PQ only
    expect_error(lambda: check_inputs(tiny_llama, tok, PQCacheConfig(), 600, 64, "x" * 700),
                 "--context 600 exceeds the model's 512 positions")
    expect_error(lambda: check_inputs(tiny_llama, tok, PQCacheConfig(), 256, 64, text[:300]),
                 "the text has 300 tokens; it needs 321")


def test_a_pass_key_counts_only_as_a_number_of_its_own() -> None:
    from plait.inference.evaluate import key_found

    assert key_found(" 10981. It is", 10981) and key_found("1 0 9 8 1", 10981)
    assert not key_found(" 1098112", 10981) and not key_found("210981", 10981) and not key_found("1098", 10981)


def _smollm2_missing() -> str | None:
    try:
        import transformers  # noqa: F401

        from plait.inference.evaluate import smollm2_path

        smollm2_path()
    except Exception as exc:  # noqa: BLE001 - any missing piece means: skip, saying which
        return str(exc)
    return None


needs_smollm2 = pytest.mark.skipif(_smollm2_missing() is not None, reason=f"real model absent: {_smollm2_missing()}")


@pytest.fixture(scope="module")
def smollm2():
    from plait.inference.evaluate import load

    return load()


@needs_smollm2
def test_on_smollm2_a_whole_budget_is_native_attention_and_a_fifth_still_finds_the_key(smollm2) -> None:
    from plait.inference.evaluate import continuation, default_text, passkey

    model, tok = smollm2
    text = default_text()
    native = continuation(model, tok, PQCacheConfig(method="full"), text, 192, 8)
    whole = continuation(model, tok, PQCacheConfig(method="pqcache", budget=1000), text, 192, 8)
    assert whole.perplexity == pytest.approx(native.perplexity, rel=1e-4)
    assert 1 < native.perplexity < 100
    fifth = passkey(model, tok, PQCacheConfig(method="pqcache", budget=0.2, measure_recall=True), 320, [0.5])
    assert fifth.trials == 1 and len(fifth.recall) == 1 and 0 < fifth.recall[0] <= 1
    full = passkey(model, tok, PQCacheConfig(method="full"), 320, [0.5])
    assert full.found == 1  # the model retrieves the key with its whole context


@needs_smollm2
def test_kv_eval_prints_one_json_row() -> None:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "plait.cli", "kv-eval", "--method", "snapkv", "--budget", "0.2", "--context", "256",
           "--depths", "1", "--continuation", "4", "--json"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout)
    assert row["method"] == "snapkv" and row["passkey_trials"] == 1 and row["perplexity"] > 1
    assert row["kv_resident_bytes"] < row["kv_full_bytes"]


def test_kv_eval_bad_input_is_one_line_and_exit_2() -> None:
    import subprocess
    import sys

    for args, needle in ((["--method", "lru"], "method must be one of"), (["--budget", "0"], "--budget"),
                         (["--context", "8"], "--context"), (["--text", "/nonexistent.txt"], "does not exist")):
        proc = subprocess.run([sys.executable, "-m", "plait.cli", "kv-eval", *args], check=False,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_pq_codes_are_held_in_one_byte_and_buffers_report_what_they_hold() -> None:
    from plait.inference.buffer import Growing

    keys = _keys(t=300)
    book = fit(keys, 4, 6)
    assert book.codes.dtype == torch.uint8 and book.codes.element_size() == 1
    assert book.rows.held_bytes == 3 * 300 * 4  # the prompt's codes held exactly: G x T x m bytes
    for _ in range(40):  # decode-time appends: a bounded spare, not a doubled buffer
        book.append(keys[:, :1])
    assert book.codes.shape[1] == 340 and book.rows.held_bytes <= 3 * 4 * (340 + 64)
    assert torch.equal(book.codes[:, 300:], book.codes[:, :1].expand(-1, 40, -1))
    q = torch.randn(3, 5, 32)
    assert torch.allclose(book.scores(q), q @ book.reconstruct().transpose(-1, -2), atol=1e-4)
    grown = Growing(torch.zeros(2, 3, 1000, 8), dim=2)
    assert grown.held_bytes == 2 * 3 * 1000 * 8 * 4
    for _ in range(200):
        grown.append(torch.ones(2, 3, 1, 8))
    assert grown.length == 1200 and grown.held_bytes <= 2 * 3 * 8 * 4 * 1200 * 9 // 8 + 2 * 3 * 8 * 4 * 64
    assert float(grown.view[:, :, 1000:].min()) == 1 and float(grown.view[:, :, :1000].max()) == 0


def test_pq_device_bytes_count_codes_centroids_and_every_row_a_step_reads() -> None:
    cache, *_ = _run("pqcache", budget=0.25)  # 126 tokens, a budget of 30: sinks 2, recent 8, 20 fetched
    row = 2 * 1 * 2 * 16 * 4  # key and value, 2 kv heads, 16 channels, fp32
    book = cache.codebook
    assert book.codes.dtype == torch.uint8
    held_codes = book.rows.data.numel()  # one byte per code, spare capacity included
    got = cache.resident_bytes()
    assert got["fetched_per_token"] == 20 * row
    assert got["resident"] == held_codes + book.centroids.numel() * 4 + 30 * row
    assert got["full_kv"] == cache._keys.held_bytes + cache._values.held_bytes >= 126 * row


def test_h2o_keeps_half_its_budget_as_recent_tokens_and_heavy_decoded_tokens() -> None:
    """H2O (Zhang et al. 2023): the cache is half heavy hitters, half recent tokens, over prompt and decoded
    tokens alike; a decoded token that later queries attend to stays once it leaves the recent window, an
    ignored one is evicted."""
    t, steps = 120, 40
    gen = torch.Generator().manual_seed(2)
    q = 0.1 * torch.randn(1, 4, t + steps, 16, generator=gen)
    k = 0.1 * torch.randn(1, 2, t + steps, 16, generator=gen)
    v = torch.randn(1, 2, t + steps, 16, generator=gen)
    heavy = t + 2  # the third decoded token: every later query attends to it
    k[:, :, heavy] = 0
    k[:, :, heavy, 0] = 8.0
    q[:, :, heavy + 1:, 0] = 2.0
    cache = LayerCache(PQCacheConfig(method="h2o", budget=0.25, sinks=2, recent=8))
    cache.prefill(q[:, :, :t], k[:, :, :t], v[:, :, :t], 0.25)
    assert cache.cfg.h2o_recent(cache.budget) == 15
    for s in range(t, t + steps):
        cache.decode(q[:, :, s: s + 1], k[:, :, s: s + 1], v[:, :, s: s + 1], 0.25)
    kept = set(cache.kept[0, 0].tolist())
    assert len(kept) == 30 and set(range(t + steps - 15, t + steps)) <= kept  # half the budget is recent
    assert heavy in kept and t + 1 not in kept  # 37 steps later the heavy hitter is kept, its neighbour not


def test_a_text_given_to_kv_eval_is_also_the_pass_key_haystack(monkeypatch) -> None:
    from plait.inference import evaluate as ev

    seen = []
    def fake_passkey(model, tokenizer, config, context, depths, seed=0, new_tokens=8, progress=None,
                     filler=None):
        assert new_tokens == 8  # the default answer length, not the progress callback
        seen.append(filler)
        return ev.PasskeyResult()

    monkeypatch.setattr(ev, "passkey", fake_passkey)
    monkeypatch.setattr(ev, "continuation", lambda *a, **kw: ev.ContinuationResult(2.0, 0.0, 0.0, {
        "full_kv": 8, "resident": 4, "fetched_per_token": 1}, None))
    row = ev.evaluate(None, None, PQCacheConfig(), 256, 1, 4, "Call me Ishmael. " * 500)
    ev.evaluate(None, None, PQCacheConfig(), 256, 1, 4, ev.default_text())
    assert seen == ["Call me Ishmael. " * 500, None] and row["kv_fetched_bytes_per_token"] == 1


@needs_smollm2
def test_on_smollm2_the_pass_key_haystack_is_the_given_text(smollm2) -> None:
    from plait.inference.evaluate import QUESTION, default_text, passkey_prompt

    _, tok = smollm2
    text = default_text()
    ids = passkey_prompt(tok, 400, 0.5, 12345, filler=text)
    prompt = tok.decode(ids[0])
    assert 380 <= ids.shape[1] <= 410 and prompt.endswith(QUESTION)
    needle = prompt.index("The pass key is 12345.")
    assert "In the beginning God created" in prompt[:needle] and "grass is green" not in prompt
    assert 0.35 < needle / len(prompt) < 0.65  # at the depth asked for
    assert tok.decode(passkey_prompt(tok, 400, 0.5, 12345)[0]).count("The grass is green") > 10
