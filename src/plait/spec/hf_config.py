"""ModelSpec from a Hugging Face `config.json`: dense decoders (Llama, Mistral, Qwen2/3, Gemma-2, GPT-2),
MoE decoders (Mixtral, Qwen2/3-MoE, DeepSeekMoE, DeepSeek-V2/V3 with latent attention, GPT-OSS), T5 encoder-decoders and LLaVA-style vision + text models,
each layer loaded as its kind (sliding-window and global layers, dense and MoE layers)."""

from __future__ import annotations

from dataclasses import replace

from plait.errors import PlaitError
from plait.spec import stacks
from plait.spec.layers import SWIGLU_ALPHA, Gating
from plait.spec.model import GPT_OSS_SWIGLU_LIMIT, ModelSpec, _t5

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek",
               "deepseek_v2", "deepseek_v3", "kimi_k2", "gpt_oss")
"""model_type values read as Llama-shaped decoders (RMS norms, rotary positions, gated MLPs)."""
TEXT_TYPES = ("gpt2", "t5", *LLAMA_TYPES)


class _Config:
    """A config dict with one-line errors for missing fields."""

    def __init__(self, config: dict, name: str) -> None:
        self.c, self.name = config, name

    def need(self, *keys: str) -> int:
        for key in keys:
            if self.c.get(key) is not None:
                return int(self.c[key])
        raise PlaitError(f"config.json of {self.name!r} has no {keys[0]!r}; is it a transformer LM config?")

    def get(self, key: str, default: object = None) -> object:
        value = self.c.get(key)
        return default if value is None else value


def from_hf_config(config: dict, name: str = "hf") -> ModelSpec:
    """ModelSpec from a Hugging Face `config.json` (see the module docstring for what is read)."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type in ("llava", "llava_next") or "vision_config" in config:
        return _llava(config, name)
    if model_type == "t5" or "num_decoder_layers" in config:
        return _t5_config(_Config(config, name), name)
    if model_type == "gpt2" or "n_embd" in config:
        c = _Config(config, name)
        hidden = c.need("n_embd", "hidden_size")
        return ModelSpec(
            name=name, family="gpt", layers=c.need("n_layer", "num_hidden_layers"), hidden=hidden,
            heads=c.need("n_head", "num_attention_heads"), vocab=c.need("vocab_size"),
            ffn=int(c.get("n_inner") or 4 * hidden), max_seq_len=c.need("n_positions", "n_ctx"),
            tied_embeddings=bool(c.get("tie_word_embeddings", True)),
        )
    if model_type and model_type not in LLAMA_TYPES:
        raise PlaitError(f"config.json of {name!r} has model_type {model_type!r}; supported: "
                         + ", ".join((*TEXT_TYPES, "llava", "llava_next")))
    return _decoder(_Config(config, name), name, model_type)


def _decoder(c: _Config, name: str, model_type: str) -> ModelSpec:
    """A Llama-shaped decoder with its sliding-window and MoE layers."""
    heads, hidden = c.need("num_attention_heads"), c.need("hidden_size")
    layers = c.need("num_hidden_layers")
    moe = bool(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts"))
    dense_ffn = c.need("intermediate_size")
    model = ModelSpec(
        name=name, family="llama", layers=layers, hidden=hidden, heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads), ffn=dense_ffn, vocab=c.need("vocab_size"),
        head_dim=int(c.get("head_dim") or 0), max_seq_len=int(c.get("max_position_embeddings") or 4096),
        gated_mlp=True, norm="rmsnorm", bias=False,
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(c.get("attention_bias", False)),
        out_bias=bool(c.get("attention_bias", False)),
        mlp_bias=bool(c.get("mlp_bias", model_type == "gpt_oss")),  # GPT-OSS experts carry biases
        dropout=False, tied_embeddings=bool(c.get("tie_word_embeddings", model_type == "gemma2")),
        learned_positions=False, rope_theta=float(c.get("rope_theta") or _rope_parameters(c).get("rope_theta") or 0),
        norm_eps=float(c.get("rms_norm_eps") or 0), rope_scaling=_rope_scaling(c),
    )
    block = model.block.with_(norms=4) if model_type == "gemma2" else model.block
    if model_type in ("qwen3", "qwen3_moe"):  # q and k heads RMS-normed before RoPE
        block = block.with_(qk_norm=True)
    if model_type == "gpt_oss":  # attention sinks, clamped SwiGLU
        block = block.with_(sinks=True, swiglu_limit=_swiglu_limit(c))
    if c.get("kv_lora_rank"):  # DeepSeek-V2/V3 multi-head latent attention
        block = block.with_(kv_heads=heads, head_dim=c.need("qk_nope_head_dim"), q_lora=int(c.get("q_lora_rank") or 0),  # type: ignore[call-overload]
                            kv_lora=c.need("kv_lora_rank"), rope_head_dim=c.need("qk_rope_head_dim"),
                            v_head_dim=c.need("v_head_dim"))
    stack = (block,) * layers
    local = _local_layers(c, layers, model_type)
    if local is not None:
        stack = stacks.windowed(block, layers, int(c.need("sliding_window")), local=local)
    if moe:
        mixed = _moe_layers(c, block, layers, model_type)
        stack = tuple(m.with_(window=b.window) if m.kind == "moe" else b for m, b in zip(mixed, stack, strict=True))
    return replace(model, mixed=stack) if stack != model.stack else model


def _rope_parameters(c: _Config) -> dict:
    """The config's `rope_parameters` table (transformers 5 moves rope_theta there), or {}."""
    table = c.get("rope_parameters")
    return table if isinstance(table, dict) else {}


def _rope_scaling(c: _Config) -> tuple[tuple[str, float | str], ...]:
    """The config's RoPE scaling (transformers 4's `rope_scaling`, 5's `rope_parameters`) as sorted (key,
    value) pairs of its numbers and names, rope_theta aside; () when it has none or is the default."""
    table = c.get("rope_scaling")
    table = {**_rope_parameters(c), **(table if isinstance(table, dict) else {})}
    pairs = tuple(sorted((str(k), v if isinstance(v, str) else float(v)) for k, v in table.items()
                         if k != "rope_theta" and isinstance(v, (int, float, str))))  # bools as 0/1
    kind = dict(pairs).get("rope_type", dict(pairs).get("type", "default"))
    return () if kind == "default" else pairs


def _local_layers(c: _Config, layers: int, model_type: str) -> tuple[bool, ...] | None:
    """Which layers use the sliding window (None: none do)."""
    types = c.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers:
            raise PlaitError(f"config.json of {c.name!r}: layer_types lists {len(types)} layers, num_hidden_layers "
                             f"is {layers}")
        local = tuple(str(t) == "sliding_attention" for t in types)
        return local if any(local) else None
    if not c.get("sliding_window"):
        return None
    if model_type == "gemma2":  # even layers local, odd layers global
        return tuple(i % 2 == 0 for i in range(layers))
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if not c.get("use_sliding_window", False):
            return None
        first = int(c.get("max_window_layers", 0))  # type: ignore[call-overload]
        return tuple(i >= first for i in range(layers))
    return (True,) * layers  # Mistral, Mixtral: every layer


def _moe_layers(c: _Config, block: object, layers: int, model_type: str) -> tuple:
    experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts"))  # type: ignore[call-overload]
    top_k = c.need("num_experts_per_tok", "num_selected_experts", "top_k", "experts_per_token")
    if model_type in ("mixtral", "gpt_oss"):  # every layer, experts as wide as the dense MLP, no shared experts
        return stacks.moe_layers(block, layers, experts, top_k, c.need("intermediate_size"),  # type: ignore[arg-type]
                                 gating=Gating(router_bias=model_type == "gpt_oss"))
    expert_ffn = c.need("moe_intermediate_size")
    shared = int(c.get("shared_expert_intermediate_size") or 0) or expert_ffn * int(c.get("n_shared_experts") or 0)  # type: ignore[call-overload]
    every = int(c.get("decoder_sparse_step") or c.get("moe_layer_freq") or 1)  # type: ignore[call-overload]
    dense = tuple(int(i) for i in c.get("mlp_only_layers", []))  # type: ignore[union-attr]
    groups = int(c.get("n_group") or 0)  # type: ignore[call-overload]
    limited = groups > 1 and c.get("topk_method", "noaux_tc") != "greedy"  # DeepSeek-V2-Lite: greedy, no groups
    return stacks.moe_layers(block, layers, experts, top_k, expert_ffn, shared_ffn=shared,  # type: ignore[arg-type]
                             dense_first=int(c.get("first_k_dense_replace") or 0), every=every, dense=dense,  # type: ignore[call-overload]
                             expert_groups=groups if limited else 0,
                             group_top_k=int(c.get("topk_group") or 0) if limited else 0,  # type: ignore[call-overload]
                             gating=_gating(c, model_type, shared > 0))


def _swiglu_limit(c: _Config) -> float:
    """GPT-OSS's SwiGLU clamp (config.json's swiglu_limit, 7 by default); its swiglu_alpha must be the 1.702 the
    runtime applies."""
    alpha = float(c.get("swiglu_alpha") or SWIGLU_ALPHA)  # type: ignore[arg-type]
    if alpha != SWIGLU_ALPHA:
        raise PlaitError(f"config.json of {c.name!r}: swiglu_alpha {alpha} is not GPT-OSS's {SWIGLU_ALPHA}, the only "
                         "one the runtime's clamped SwiGLU applies; give swiglu_alpha 1.702")
    return float(c.get("swiglu_limit") or GPT_OSS_SWIGLU_LIMIT)  # type: ignore[arg-type]


V3_TYPES = ("deepseek_v3", "kimi_k2")
"""model_type values of DeepSeek-V3's router (sigmoid scores, a bias on the choice, scaled weights)."""


def _gating(c: _Config, model_type: str, shared: bool) -> Gating:
    """How the config's router weighs its experts: config.json's scoring_func, topk_method, norm_topk_prob and
    routed_scaling_factor, each defaulting as transformers' class for the model_type does; Qwen2-MoE's shared
    experts are gated."""
    v3 = model_type in V3_TYPES
    method = str(c.get("topk_method", "noaux_tc" if v3 else "greedy"))
    scoring = str(c.get("scoring_func", "sigmoid" if v3 else "softmax"))
    return Gating(score="sigmoid" if scoring == "sigmoid" else "softmax", normalized=bool(c.get("norm_topk_prob", v3)),
                  scale=float(c.get("routed_scaling_factor") or (2.5 if v3 else 1.0)),  # type: ignore[arg-type]
                  choice_bias=method == "noaux_tc", group_score="top2" if method == "noaux_tc" else "max",
                  shared_gate=model_type == "qwen2_moe" and shared)


def _t5_config(c: _Config, name: str) -> ModelSpec:
    encoder = c.need("num_layers")
    ffn_kind = str(c.get("feed_forward_proj", "relu"))
    return _t5(name, encoder, int(c.get("num_decoder_layers") or encoder), c.need("d_model"), c.need("num_heads"),  # type: ignore[call-overload]
               c.need("d_kv"), c.need("d_ff"), c.need("vocab_size"), gated=ffn_kind.startswith("gated"),
               tied=bool(c.get("tie_word_embeddings", True)), seq=int(c.get("n_positions") or 512))  # type: ignore[call-overload]


def _llava(config: dict, name: str) -> ModelSpec:
    """A CLIP/SigLIP vision tower, LLaVA's projector and the text model of `text_config`."""
    vision, text_config = config.get("vision_config"), config.get("text_config")
    if not isinstance(vision, dict) or not isinstance(text_config, dict):
        raise PlaitError(f"config.json of {name!r} is a vision-language config without vision_config and "
                         "text_config objects; give a LLaVA-style config")
    text_config = {"model_type": "llama", **text_config}
    text = from_hf_config(text_config, name)
    if set(text.kind_counts()) != {"decoder"}:
        raise PlaitError(f"config.json of {name!r}: the text model must be a dense decoder")
    v = _Config(vision, f"{name} vision_config")
    siglip = "siglip" in str(vision.get("model_type", ""))
    tower = stacks.VisionTower(name=f"{name}-vision", layers=v.need("num_hidden_layers"), hidden=v.need("hidden_size"),
                               heads=v.need("num_attention_heads"), ffn=v.need("intermediate_size"),
                               image=v.need("image_size"), patch=v.need("patch_size"), class_token=not siglip,
                               pre_norm=not siglip)
    keep_class = config.get("vision_feature_select_strategy") == "full"
    return replace(text, family="llava", mixed=stacks.vision_stack(tower, text.hidden, keep_class_token=keep_class)
                   + text.stack)
