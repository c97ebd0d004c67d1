"""Model definitions (plait.models): shapes, parameter counts, init, causality, GQA, pipeline-stage
surgery, RoPE convention, safetensors round trips and a few training steps. Single process, CPU."""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plait.errors import PlaitError
from plait.models import build_model
from plait.models.hf_weights import load_hf_safetensors, read_safetensors, save_hf_safetensors, write_safetensors
from plait.models.llama import apply_rope, rope_cache, rope_theta
from plait.spec.model import PRESETS, ModelSpec, parse_inline

TINY = ["tiny-gpt", "tiny-llama"]


def _tokens(vocab: int, b: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _small(family: str, **kw: object) -> ModelSpec:
    base: dict[str, object] = {"name": "t", "family": family, "layers": 2, "hidden": 32, "heads": 4,
                               "vocab": 97, "max_seq_len": 32}
    if family == "llama":
        base.update(gated_mlp=True, norm="rmsnorm", bias=False, dropout=False, tied_embeddings=False,
                    learned_positions=False, ffn=48)
    base.update(kw)
    return ModelSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", TINY)
def test_forward_shape_and_dtype(name: str) -> None:
    spec = PRESETS[name]
    logits = build_model(spec)(_tokens(spec.vocab))
    assert logits.shape == (2, 16, spec.vocab) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


SPECS = {
    "tiny-gpt": PRESETS["tiny-gpt"], "tiny-llama": PRESETS["tiny-llama"],
    "gpt-untied": _small("gpt", tied_embeddings=False),
    "gpt-nobias": _small("gpt", bias=False, ffn=40),
    "llama-tied": _small("llama", tied_embeddings=True, kv_heads=1),
    "llama-biases": _small("llama", qkv_bias=True, out_bias=True, mlp_bias=True, kv_heads=2),
    "llama-head-dim": _small("llama", head_dim=16, kv_heads=2),
    "inline-llama": parse_inline("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=100,seq=64"),
    "inline-gpt": parse_inline("gpt:layers=3,hidden=48,heads=3,vocab=70,seq=20"),
}


@pytest.mark.parametrize("key", SPECS)
def test_parameter_count_matches_spec(key: str) -> None:
    spec = SPECS[key]
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.params
    assert model(_tokens(spec.vocab, t=8)).shape == (2, 8, spec.vocab)


def test_module_names_and_tying() -> None:
    gpt, llama = build_model(PRESETS["tiny-gpt"]), build_model(PRESETS["tiny-llama"])
    for model in (gpt, llama):
        assert list(model.layers) == ["0", "1", "2", "3"]
        block = model.layers["0"]
        assert [n for n, _ in block.named_children()] == ["attention_norm", "attention", "ffn_norm", "feed_forward"]
        assert all(isinstance(getattr(block.attention, w), torch.nn.Linear) for w in ("wq", "wk", "wv", "wo"))
    assert gpt.output.weight is gpt.tok_embeddings.weight and gpt.pos_embeddings is not None
    assert llama.output.weight is not llama.tok_embeddings.weight and llama.pos_embeddings is None
    assert isinstance(gpt.norm, torch.nn.LayerNorm) and isinstance(llama.norm, torch.nn.RMSNorm)
    assert hasattr(llama.layers["0"].feed_forward, "w3") and not hasattr(gpt.layers["0"].feed_forward, "w3")
    assert "freqs_cis" not in llama.state_dict()


@pytest.mark.parametrize("name", TINY)
def test_init_is_deterministic(name: str) -> None:
    spec = PRESETS[name]
    torch.manual_seed(1)
    a = build_model(spec, seed=7).state_dict()
    torch.manual_seed(2)
    torch.rand(10)
    b = build_model(spec, seed=7).state_dict()
    c = build_model(spec, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    w = a["layers.1.attention.wo.weight"]
    assert abs(w.std().item() - 0.02 / math.sqrt(2 * spec.layers)) < 2e-3
    assert torch.equal(a["layers.0.ffn_norm.weight"], torch.ones(spec.hidden))
    if spec.bias:
        assert torch.equal(a["layers.0.attention.wq.bias"], torch.zeros(spec.hidden))


@pytest.mark.parametrize("name", TINY)
def test_init_same_on_a_pipeline_stage_and_from_meta(name: str) -> None:
    spec = PRESETS[name]
    full = build_model(spec, seed=4).state_dict()
    stage = build_model(spec, device="meta")
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings, stage.pos_embeddings = None, None
    stage.to_empty(device="cpu")
    stage.init_weights(4)
    for k, v in stage.state_dict().items():
        assert torch.equal(v, full[k]), k
    if spec.tied_embeddings:  # the tied head on the last stage equals the embedding of the first
        assert torch.equal(stage.output.weight, full["tok_embeddings.weight"])
    if stage.freqs_cis is not None:  # recomputed after to_empty()
        assert torch.equal(stage.freqs_cis, build_model(spec).freqs_cis)


def test_dtype() -> None:
    model = build_model(PRESETS["tiny-llama"], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.freqs_cis.dtype == torch.float32
    assert model(_tokens(512)).dtype == torch.float32


@pytest.mark.parametrize("name", TINY)
def test_causal(name: str) -> None:
    spec = PRESETS[name]
    model = build_model(spec).eval()
    tokens = _tokens(spec.vocab)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % spec.vocab
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3


def test_gqa_matches_reference_attention() -> None:
    spec = _small("llama", heads=4, kv_heads=2)
    attn = build_model(spec).layers["0"].attention
    x = torch.randn(2, 8, spec.hidden, generator=torch.Generator().manual_seed(0))
    freqs = rope_cache(spec.head_dim, 8)
    d = spec.head_dim
    q = apply_rope(attn.wq(x).view(2, 8, 4, d), freqs)
    k = apply_rope(attn.wk(x).view(2, 8, 2, d), freqs)
    v = attn.wv(x).view(2, 8, 2, d)
    heads = []
    for h in range(4):  # query head h reads kv head h // 2
        scores = q[:, :, h] @ k[:, :, h // 2].transpose(1, 2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, h // 2])
    expected = attn.wo(torch.cat(heads, dim=-1))
    torch.testing.assert_close(attn(x, freqs), expected, rtol=1e-5, atol=1e-6)


def test_rope_matches_hf_rotate_half_formula() -> None:
    """Per pair (i, i + D/2) at position p: rotation by p * theta^(-2i/D) (HF's rotate_half layout)."""
    b, t, nh, d, theta = 1, 5, 2, 8, 10000.0
    x = torch.randn(b, t, nh, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = torch.empty_like(x)
    for p in range(t):
        for i in range(d // 2):
            a = p * theta ** (-2 * i / d)
            x1, x2 = x[:, p, :, i], x[:, p, :, i + d // 2]
            expected[:, p, :, i] = x1 * math.cos(a) - x2 * math.sin(a)
            expected[:, p, :, i + d // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    torch.testing.assert_close(apply_rope(x, rope_cache(d, t, theta).double()), expected, rtol=0, atol=1e-6)
    # HF's conversion permutes Meta's q/k rows; rotate_half on permuted rows = Meta's interleaved RoPE.
    w = torch.randn(nh * d, 16, dtype=torch.float64)
    perm = w.view(nh, d // 2, 2, 16).transpose(1, 2).reshape(nh * d, 16)
    xin = torch.randn(b, t, 16, dtype=torch.float64)
    meta = torch.view_as_complex((xin @ w.t()).view(b, t, nh, d // 2, 2).contiguous())
    angles = torch.outer(torch.arange(t, dtype=torch.float64), theta ** (-torch.arange(0, d, 2) / d))
    meta = torch.view_as_real(meta * torch.polar(torch.ones_like(angles), angles)[None, :, None]).flatten(3)
    hf = apply_rope((xin @ perm.t()).view(b, t, nh, d), rope_cache(d, t, theta).double())
    meta_in_hf_layout = meta.view(b, t, nh, d // 2, 2).transpose(3, 4).reshape(b, t, nh, d)
    torch.testing.assert_close(hf, meta_in_hf_layout, rtol=0, atol=1e-6)


def test_rope_theta_for_llama3_vocab() -> None:
    big, small = _small("llama", vocab=128256), _small("llama")
    assert rope_theta(big) == 500000.0 and rope_theta(small) == 10000.0
    assert torch.equal(build_model(big).freqs_cis, rope_cache(8, 32, 500000.0))
    assert torch.equal(build_model(small).freqs_cis, rope_cache(8, 32, 10000.0))


@pytest.mark.parametrize("name", TINY)
def test_pipeline_stages_chain_to_the_full_forward(name: str) -> None:
    spec = PRESETS[name]
    model = build_model(spec).eval()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["2"], first.layers["3"]
    first.norm, first.output = None, None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings, last.pos_embeddings = None, None
    tokens = _tokens(spec.vocab)
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, spec.hidden)
        assert torch.equal(last(hidden), model(tokens))
    assert sum(p.numel() for p in first.parameters()) + sum(p.numel() for p in last.parameters()) == (
        spec.params + (spec.vocab * spec.hidden if spec.tied_embeddings else 0))  # tied table on both ends


def test_dropout_only_in_training() -> None:
    spec = PRESETS["tiny-gpt"]
    model = build_model(spec, dropout=0.1)
    tokens = _tokens(spec.vocab)
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))
    torch.testing.assert_close(model(tokens), build_model(spec).eval()(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("key", ["tiny-gpt", "tiny-llama", "llama-tied", "llama-biases", "gpt-untied"])
def test_safetensors_round_trip(key: str, tmp_path: Path) -> None:
    spec = SPECS[key]
    model = build_model(spec, seed=1).eval()
    path = save_hf_safetensors(model, tmp_path)
    names = read_safetensors(path)
    if spec.family == "llama":
        assert "model.layers.0.self_attn.q_proj.weight" in names and "model.embed_tokens.weight" in names
        assert ("lm_head.weight" in names) != spec.tied_embeddings
    else:
        assert "h.0.attn.c_attn.weight" in names and "wpe.weight" in names
    other = build_model(spec, seed=2).eval()
    load_hf_safetensors(other, tmp_path)
    tokens = _tokens(spec.vocab)
    with torch.no_grad():
        assert torch.equal(other(tokens), model(tokens))


def test_load_into_a_pipeline_stage_and_other_dtype(tmp_path: Path) -> None:
    spec = PRESETS["tiny-llama"]
    model = build_model(spec, seed=1)
    save_hf_safetensors(model, tmp_path)
    stage = build_model(spec, seed=2, dtype=torch.bfloat16)
    del stage.layers["0"]
    stage.tok_embeddings = None
    load_hf_safetensors(stage, tmp_path)
    assert torch.equal(stage.layers["3"].feed_forward.w3.weight, model.layers["3"].feed_forward.w3.weight.bfloat16())


def _write_by_hand(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written straight from the format description (F32 only)."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        blob = struct.pack(f"<{t.numel()}f", *t.flatten().tolist())
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.mark.parametrize("prefix", ["", "transformer."])
def test_hand_written_gpt2_checkpoint_loads(prefix: str, tmp_path: Path) -> None:
    spec = _small("gpt", layers=2, hidden=16, heads=2, vocab=23, max_seq_len=12)
    ref = build_model(spec, seed=3).eval()
    sd = ref.state_dict()
    hf = {f"{prefix}wte.weight": sd["tok_embeddings.weight"], f"{prefix}wpe.weight": sd["pos_embeddings.weight"],
          f"{prefix}ln_f.weight": sd["norm.weight"], f"{prefix}ln_f.bias": sd["norm.bias"]}
    for i in range(spec.layers):
        p, h = f"layers.{i}.", f"{prefix}h.{i}."
        att = [sd[f"{p}attention.{w}.weight"] for w in ("wq", "wk", "wv")]
        hf[h + "attn.c_attn.weight"] = torch.cat(att, 0).t()  # Conv1D: [in, out]
        hf[h + "attn.c_attn.bias"] = torch.cat([sd[f"{p}attention.{w}.bias"] for w in ("wq", "wk", "wv")])
        hf[h + "attn.bias"] = torch.ones(1, 1, 12, 12).tril()  # HF's causal-mask buffer: ignored
        for ours, theirs in [("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"),
                             ("feed_forward.w2", "mlp.c_proj")]:
            hf[f"{h}{theirs}.weight"] = sd[f"{p}{ours}.weight"].t()
            hf[f"{h}{theirs}.bias"] = sd[f"{p}{ours}.bias"]
        for ours, theirs in [("attention_norm", "ln_1"), ("ffn_norm", "ln_2")]:
            hf[f"{h}{theirs}.weight"], hf[f"{h}{theirs}.bias"] = sd[f"{p}{ours}.weight"], sd[f"{p}{ours}.bias"]
    _write_by_hand(tmp_path / "model.safetensors", hf)
    model = build_model(spec, seed=9).eval()
    load_hf_safetensors(model, tmp_path)
    tokens = _tokens(spec.vocab, t=12)
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens))


def test_load_errors(tmp_path: Path) -> None:
    spec = PRESETS["tiny-llama"]
    model = build_model(spec)
    with pytest.raises(PlaitError, match="does not exist"):
        load_hf_safetensors(model, tmp_path / "nope")
    with pytest.raises(PlaitError, match="no \\*.safetensors"):
        load_hf_safetensors(model, tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(PlaitError, match="not a readable safetensors"):
        load_hf_safetensors(model, tmp_path)
    (tmp_path / "bad.safetensors").unlink()
    path = save_hf_safetensors(model, tmp_path)
    tensors = read_safetensors(path)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    _write_by_hand(path, tensors)
    with pytest.raises(PlaitError, match="model.layers.2.mlp.up_proj.weight") as err:
        load_hf_safetensors(model, tmp_path)
    assert "\n" not in str(err.value)
    save_hf_safetensors(build_model(spec.with_(ffn=256)), tmp_path)
    with pytest.raises(PlaitError, match="model.layers.0.mlp.gate_proj.weight' has shape \\[256, 128\\]"):
        load_hf_safetensors(model, tmp_path)


def test_unknown_family() -> None:
    spec = copy.copy(PRESETS["tiny-gpt"])
    object.__setattr__(spec, "family", "mamba")
    with pytest.raises(PlaitError, match="family"):
        build_model(spec)


@pytest.mark.parametrize("name", TINY)
def test_loss_goes_down(name: str) -> None:
    spec = PRESETS[name]
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = _tokens(spec.vocab, b=2, t=33)
    losses = []
    for _ in range(20):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(spec.vocab)) < 0.1  # small init: near-uniform predictions
    assert losses[-1] < 0.5 * losses[0]


SMALL_HF = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


def _saved_hf(kind: str, tmp_path: Path, **config: object) -> torch.nn.Module:
    """A randomly initialised Hugging Face model of `kind` (Llama, Qwen2, Qwen3, Mixtral) saved to tmp_path."""
    import transformers

    cls, cfg = (getattr(transformers, f"{kind}ForCausalLM"), getattr(transformers, f"{kind}Config"))
    torch.manual_seed(0)
    model = cls(cfg(**{**SMALL_HF, **config})).eval()
    with torch.no_grad():  # DeepSeek-V3's routers' choice biases and GPT-OSS's biases start at 0: make them
        for name, t in model.state_dict().items():  # count, and GPT-OSS's experts wide enough to clamp
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.1)
            elif kind == "GptOss" and (name.endswith(("bias", "sinks")) or ".experts." in name):
                t.normal_(0.0, 1.0 if name.endswith(("gate_up_proj", "down_proj")) else 0.5)
    model.save_pretrained(tmp_path)
    return model


MOE_HF = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}


@pytest.mark.parametrize("kind, config", [
    ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),  # routed experts, one tensor an expert
    ("Llama", {"rope_theta": 5e5}),  # the base read from config.json (transformers 5: rope_parameters)
    ("Llama", {"rope_theta": 5e5, "rope_scaling": LLAMA3_SCALING}),  # Llama 3.1's scaled frequencies
    ("Llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("Qwen2", {"rope_theta": 1e6}),  # q/k/v biases
    ("Llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                "truncate": False}}),  # YaRN: ramped frequencies, cos and sin scaled
    ("Qwen3", {"head_dim": 8}),  # q/k norms
    ("Qwen3Moe", {"num_experts": 4, "norm_topk_prob": True, "head_dim": 8, **MOE_HF}),
    ("Qwen2Moe", {"num_experts": 4, "shared_expert_intermediate_size": 48, **MOE_HF}),  # gated shared experts,
    # weights as the router gives them (norm_topk_prob false)
    ("DeepseekV3", {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,  # latent
                    "topk_group": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,  # attention with
                    "qk_rope_head_dim": 4, "v_head_dim": 8, "routed_scaling_factor": 2.5, "num_key_value_heads": 4,
                    **MOE_HF}),  # interleaved
    # rotary channels, sigmoid router with a choice bias, groups scored by their best two
    ("DeepseekV2", {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,  # softmax
                    "topk_group": 2, "topk_method": "group_limited_greedy", "q_lora_rank": 16,  # router, weights
                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,  # scaled but
                    "routed_scaling_factor": 1.5, "num_key_value_heads": 4, **MOE_HF}),  # not renormalised, groups
    # scored by their best expert, rotary channels in complex pairs
    ("DeepseekV3", {"n_routed_experts": 4, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 16,
                    "kv_lora_rank": 16,
                    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "num_key_value_heads": 4,
                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                     "mscale": 1.0, "mscale_all_dim": 0.8}, **MOE_HF}),  # YaRN's mscale_all_dim
    # on every score
    ("GptOss", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24, "head_dim": 8,
                "sliding_window": 8, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                         "beta_slow": 1.0, "truncate": False, "rope_theta": 1.5e5,
                                                         "original_max_position_embeddings": 16}}),  # sinks, router
    # and expert biases, clamped SwiGLU, gate and up interleaved in one tensor, sliding and full layers
])
def test_hugging_face_checkpoints_give_hugging_face_logits(kind: str, config: dict, tmp_path: Path) -> None:
    """A saved Hugging Face model loads from its config.json and weights into the runtime's model, which then
    computes its logits (RoPE base and scaling, norm epsilon, biases, q/k norms, latent attention, routed and
    shared experts and the router's gating as configured); the model saved again loads back into Hugging Face's
    class."""
    from plait.spec.model import load_model

    hf = _saved_hf(kind, tmp_path, **config)
    model = build_model(load_model(str(tmp_path / "config.json")), seed=5).eval()
    load_hf_safetensors(model, tmp_path)
    tokens = _tokens(128, t=60)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    back = tmp_path / "back"
    save_hf_safetensors(model, back)  # and Hugging Face loads plait's file back into the same model
    (back / "config.json").write_text((tmp_path / "config.json").read_text())
    again = type(hf).from_pretrained(back).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_block_quantized_fp8_checkpoints_load_dequantized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's released weights are FP8 with a scale per 128 x 128 tile (`weight_scale_inv`): the layers'
    matrices of a Qwen3-MoE checkpoint quantized so (16 x 24 tiles, partial ones at the edges) load as Hugging
    Face's model holding the dequantized weights computes; a pipeline stage decodes its own layers' weights
    only; a scale of the wrong shape is refused in one line."""
    from plait.models import hf_weights
    from plait.spec.model import load_model

    hf = _saved_hf("Qwen3Moe", tmp_path, num_experts=4, norm_topk_prob=True, head_dim=8, **MOE_HF)
    tensors, tile = read_safetensors(tmp_path / "model.safetensors"), (16, 24)
    with torch.no_grad():
        for name, w in hf.state_dict().items():
            if not (name.startswith("model.layers.") and w.dim() == 2 and "norm" not in name):
                continue
            rows, cols = (-(-n // t) for n, t in zip(w.shape, tile, strict=True))
            blocks = F.pad(w, (0, cols * tile[1] - w.shape[1], 0, rows * tile[0] - w.shape[0]))
            amax = blocks.view(rows, tile[0], cols, tile[1]).abs().amax(dim=(1, 3))
            scale = amax / 448.0
            wide = scale.repeat_interleave(tile[0], 0)[: w.shape[0]].repeat_interleave(tile[1], 1)[:, : w.shape[1]]
            quantized = (w / wide).to(torch.float8_e4m3fn)
            w.copy_(quantized.float() * wide)  # what the quantized file holds
            tensors[name], tensors[name + "_scale_inv"] = quantized, scale
    write_safetensors(tmp_path / "model.safetensors", tensors)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(tile)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = build_model(load_model(str(tmp_path / "config.json")), seed=5).eval()
    load_hf_safetensors(model, tmp_path)
    tokens = _tokens(128, t=60)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    decoded, decode = [], hf_weights._fp8_weight
    monkeypatch.setattr(hf_weights, "_fp8_weight", lambda *args: decoded.append(args[2]) or decode(*args))
    stage = build_model(load_model(str(tmp_path / "config.json")))
    del stage.layers["0"]
    load_hf_safetensors(stage, tmp_path)
    assert len(decoded) == 5 and all(k.startswith("model.layers.1.") for k in decoded)  # q, k, v, o, router
    config["quantization_config"]["weight_block_size"] = [8, 8]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlaitError, match="weight_scale_inv.*8 x 8 tiles") as err:
        load_hf_safetensors(model, tmp_path)
    assert "\n" not in str(err.value)


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's MXFP4 of an expert stack w [E, in, out]: blocks [E, out, in/32, 16] (two 4-bit codes a byte, the
    low nibble first) and scales [E, out, in/32] (2^(s - 127) per 32 values), each value the nearest code."""
    from plait.models.hf_weights import FP4_VALUES

    groups = w.transpose(1, 2).reshape(w.shape[0], w.shape[2], -1, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    codes = (groups / torch.exp2(exp)[..., None] - torch.tensor(FP4_VALUES)[:, None, None, None, None]).abs()
    codes = codes.argmin(0).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def test_mxfp4_experts_load_dequantized(tmp_path: Path) -> None:
    """GPT-OSS's released experts are MXFP4 (`_blocks` and `_scales`): they decode as transformers'
    convert_moe_packed_tensors does, and a checkpoint so quantized loads as Hugging Face's model holding the
    decoded weights computes; blocks of the wrong shape are refused in one line."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from plait.models.hf_weights import Dequantized
    from plait.spec.model import load_model

    hf = _saved_hf("GptOss", tmp_path, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                   hidden_size=64, head_dim=8, sliding_window=8)
    tensors = read_safetensors(tmp_path / "model.safetensors")
    with torch.no_grad():
        for name, w in hf.state_dict().items():
            if name.endswith(("gate_up_proj", "down_proj")):
                blocks, scales = _mxfp4(w)
                decoded = Dequantized({"x_blocks": blocks, "x_scales": scales}, {})["x"]
                torch.testing.assert_close(decoded, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                assert (decoded - w).abs().max() < 0.5 * w.abs().max()  # a coarse copy of the weights
                w.copy_(decoded)
                del tensors[name]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    write_safetensors(tmp_path / "model.safetensors", tensors)
    model = build_model(load_model(str(tmp_path / "config.json")), seed=5).eval()
    load_hf_safetensors(model, tmp_path)
    tokens = _tokens(128, t=60)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = blocks[..., :8]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(PlaitError, match="down_proj_blocks.*MXFP4") as err:
        load_hf_safetensors(model, tmp_path)
    assert "\n" not in str(err.value)


def test_checkpoints_of_layers_the_runtime_builds_otherwise_are_refused(tmp_path: Path) -> None:
    """Gemma-2's extra norms have no place in the runtime's layer, and dynamic NTK RoPE is not applied:
    loading either would give another model, so both are refused in one line."""
    from plait.spec.model import load_model

    _saved_hf("Gemma2", tmp_path / "gemma2", head_dim=8)
    model = build_model(load_model(str(tmp_path / "gemma2" / "config.json")))
    with pytest.raises(PlaitError, match="feedforward_layernorm.weight.*no place") as err:
        load_hf_safetensors(model, tmp_path / "gemma2")
    assert "\n" not in str(err.value)
    _saved_hf("Llama", tmp_path / "dynamic", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    model = build_model(load_model(str(tmp_path / "dynamic" / "config.json")))
    with pytest.raises(PlaitError, match="'dynamic'"):
        load_hf_safetensors(model, tmp_path / "dynamic")
