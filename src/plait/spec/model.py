"""ModelSpec: what a decoder-only transformer costs, per layer.

A model is an embedding, `layers` identical transformer blocks and a head (final norm + LM projection).
Everything the cost model needs is derived here from the shape alone: parameter counts, the GEMMs of a
block (so compute efficiency can depend on matrix size), forward FLOPs per token (the attention term grows
with sequence length), activation bytes per token by recompute mode (Korthikanti et al. 2022, Table 2,
generalised to GQA, SwiGLU and flash attention), and communication volumes per parallel dimension.

Sources of a ModelSpec: presets (`PRESETS`), a Hugging Face `config.json`, or an inline spec such as
`llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256`. `load_model` accepts all three.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Literal

from plait.errors import PlaitError

Family = Literal["gpt", "llama"]
Recompute = Literal["none", "selective", "full"]
Attention = Literal["flash", "eager"]

MASK_BYTES = 1
"""Bytes per element of a dropout mask (Megatron stores uint8 masks; Korthikanti Table 2)."""
LSE_BYTES = 4
"""Bytes per (token, head) of the fp32 log-sum-exp a flash-attention kernel saves for backward."""


@dataclass(frozen=True)
class Gemm:
    """One token-wise linear layer of a block: y[tokens, n] = x[tokens, k] @ W[k, n].

    `split` says how tensor parallelism divides it: "col" splits n (Megatron ColumnParallelLinear),
    "row" splits k (RowParallelLinear).
    """

    name: str
    k: int
    n: int
    split: Literal["col", "row"]


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes saved for backward by one block, per token, at 16-bit activations.

    `replicated` is stored whole on every tensor-parallel rank unless sequence parallelism shards it;
    `sharded` is divided by the tensor-parallel degree; `quadratic_per_seq_token` is multiplied by the
    sequence length (the s^2 attention scores of eager attention) and divided by the TP degree;
    `masks` are 1-byte dropout masks that stay 1 byte whatever the activation dtype.
    """

    replicated: float
    sharded: float
    quadratic_per_seq_token: float
    replicated_masks: float
    sharded_quadratic_masks: float


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer. Counts are elements; sizes are in tokens."""

    name: str
    family: Family
    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int = 0  # 0 = same as heads (multi-head attention)
    ffn: int = 0  # 0 = 4 * hidden
    head_dim: int = 0  # 0 = hidden // heads
    max_seq_len: int = 2048
    gated_mlp: bool = False  # SwiGLU: three matrices (gate, up, down)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True  # biases on every linear (GPT) or not (Llama)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama's attention_bias adds the output projection too)
    out_bias: bool = False  # bias on the attention output projection (Llama's attention_bias)
    mlp_bias: bool = False  # biases on the MLP linears (Llama's mlp_bias)
    dropout: bool = True  # Megatron GPT trains with dropout (its masks cost activation memory)
    tied_embeddings: bool = True
    learned_positions: bool = True  # GPT: learned position table; Llama: RoPE (no parameters)
    attention: Attention = "flash"

    def __post_init__(self) -> None:
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if not self.head_dim:
            if self.heads <= 0 or self.hidden % self.heads:
                raise PlaitError(
                    f"model {self.name!r}: hidden={self.hidden} is not divisible by heads={self.heads}; "
                    "pick heads that divide hidden or give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        for f in ("layers", "hidden", "heads", "vocab", "kv_heads", "ffn", "head_dim", "max_seq_len"):
            if getattr(self, f) <= 0:
                raise PlaitError(f"model {self.name!r}: {f} must be a positive integer, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise PlaitError(
                f"model {self.name!r}: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; "
                "grouped-query attention needs kv_heads to divide heads"
            )

    # ---- parameters -------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projections (kv_heads x head_dim)."""
        return self.kv_heads * self.head_dim

    @cached_property
    def gemms(self) -> tuple[Gemm, ...]:
        """The linear layers of one block, in execution order."""
        up = 2 * self.ffn if self.gated_mlp else self.ffn
        return (
            Gemm("qkv", self.hidden, self.q_dim + 2 * self.kv_dim, "col"),
            Gemm("attn_out", self.q_dim, self.hidden, "row"),
            Gemm("mlp_up", self.hidden, up, "col"),
            Gemm("mlp_down", self.ffn, self.hidden, "row"),
        )

    @cached_property
    def block_params(self) -> int:
        """Parameters of one transformer block (weights, biases, norms)."""
        weights = sum(g.k * g.n for g in self.gemms)
        norm_params = (2 if self.norm == "layernorm" else 1) * self.hidden * 2
        qkv, out, up, down = self.gemms
        biases = (qkv.n * (self.bias or self.qkv_bias) + out.n * (self.bias or self.out_bias)
                  + (up.n + down.n) * (self.bias or self.mlp_bias))
        return weights + norm_params + biases

    @cached_property
    def embedding_params(self) -> int:
        """Token embedding (+ learned position table)."""
        return self.vocab * self.hidden + (self.max_seq_len * self.hidden if self.learned_positions else 0)

    @cached_property
    def head_params(self) -> int:
        """Final norm + LM projection (0 extra weights when tied to the embedding)."""
        norm_params = (2 if self.norm == "layernorm" else 1) * self.hidden
        return norm_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @cached_property
    def params(self) -> int:
        """All parameters."""
        return self.embedding_params + self.layers * self.block_params + self.head_params

    # ---- FLOPs --------------------------------------------------------------------------------
    @cached_property
    def block_gemm_flops_per_token(self) -> int:
        """Forward FLOPs per token of the block's linear layers (2 per multiply-add)."""
        return sum(2 * g.k * g.n for g in self.gemms)

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token of the attention core (QK^T and AV), counted over the full s x s
        score matrix as Megatron's published FLOP counts do."""
        return 2 * 2 * seq_len * self.q_dim

    def block_flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token of one block."""
        return self.block_gemm_flops_per_token + self.attention_flops_per_token(seq_len)

    @cached_property
    def head_flops_per_token(self) -> int:
        """Forward FLOPs per token of the LM projection."""
        return 2 * self.hidden * self.vocab

    def model_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token without recomputation (forward + 2x for backward).

        For GPT shapes this is Megatron's 72*l*h^2*(1 + s/(6h) + V/(12lh)) per token.
        """
        fwd = self.layers * self.block_flops_per_token(seq_len) + self.head_flops_per_token
        return 3 * fwd

    # ---- activations --------------------------------------------------------------------------
    def activation_bytes(self, recompute: Recompute) -> ActivationBytes:
        """Bytes saved for backward per token of one block, 16-bit activations (see ActivationBytes).

        With eager attention, dropout, LayerNorm and a 4h GeLU MLP this reproduces Korthikanti et al.
        2022, Table 2: s*b*h*(34 + 5*a*s/h) with no parallelism, s*b*h*(10 + 24/t + 5*a*s/(h*t)) with
        tensor parallelism, and 2*s*b*h under full recomputation.
        """
        h, f = self.hidden, self.ffn
        if recompute == "full":  # only the block input survives (sharded by sequence parallelism)
            return ActivationBytes(2 * h, 0, 0, 0, 0)
        drop_masks = 2 * h * MASK_BYTES if self.dropout else 0  # after attention and after the MLP
        replicated = 2 * h + 2 * h + 2 * h + 2 * h  # norm1 in, qkv in, norm2 in, MLP in
        q_k = 2 * self.q_dim + 2 * self.kv_dim
        v = 2 * self.kv_dim
        proj_in = 2 * self.q_dim
        mlp = 3 * 2 * f if self.gated_mlp else 2 * 2 * f  # SwiGLU: gate, up, product; GeLU: in, out
        sharded = q_k + v + proj_in + mlp
        quadratic = 0.0
        quad_masks = 0.0
        if self.attention == "eager" and recompute == "none":
            quadratic = 2 * self.heads  # softmax output, per token per score column
            if self.dropout:
                quadratic += 2 * self.heads  # attention-dropout output
                quad_masks = self.heads * MASK_BYTES
        elif self.attention == "flash":
            sharded += LSE_BYTES * self.heads
        return ActivationBytes(replicated, sharded, quadratic, drop_masks, quad_masks)

    # ---- communication volumes (elements per token) -------------------------------------------
    @property
    def tp_comm_elements_per_token(self) -> int:
        """Elements per token of each tensor-parallel collective (4 per block per pass: 2 fwd, 2 bwd)."""
        return self.hidden

    @property
    def ulysses_elements_per_token(self) -> int:
        """Elements per token that Ulysses all-to-alls move per forward (q, k, v in; output back)."""
        return self.q_dim + 2 * self.kv_dim + self.q_dim

    @property
    def ring_kv_elements_per_token(self) -> int:
        """Elements per token of the K and V blocks that ring attention passes around."""
        return 2 * self.kv_dim

    @property
    def pp_elements_per_token(self) -> int:
        """Elements per token sent between pipeline stages (the hidden state)."""
        return self.hidden

    def with_(self, **changes: object) -> ModelSpec:
        """A copy with some fields changed; kv_heads, ffn and head_dim that were derived from the old
        shape are derived again from the new one unless given."""
        derived = {
            "kv_heads": self.kv_heads == self.heads,
            "head_dim": self.head_dim * self.heads == self.hidden,
            "ffn": self.ffn == 4 * self.hidden and not self.gated_mlp,
        }
        for name, was_derived in derived.items():
            if was_derived and name not in changes:
                changes[name] = 0
        if self.gated_mlp and "ffn" not in changes and "hidden" in changes:
            changes["ffn"] = llama_ffn(int(changes["hidden"]))  # type: ignore[call-overload]
        return replace(self, **changes)  # type: ignore[arg-type]


def llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's default SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023)."""
    ffn = int(2 * 4 * hidden / 3)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelSpec:
    return ModelSpec(name=name, family="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                     max_seq_len=seq)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq: int) -> ModelSpec:
    return ModelSpec(name=name, family="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn=ffn, vocab=vocab, max_seq_len=seq, gated_mlp=True, norm="rmsnorm", bias=False,
                     dropout=False, tied_embeddings=False, learned_positions=False)


PRESETS: dict[str, ModelSpec] = {
    # GPT-3 shapes (Brown et al. 2020, Table 2.1) with Megatron's padded vocabulary of 51200.
    "gpt3-1.3b": _gpt("gpt3-1.3b", 24, 2048, 16),
    "gpt3-2.7b": _gpt("gpt3-2.7b", 32, 2560, 32),
    "gpt3-6.7b": _gpt("gpt3-6.7b", 32, 4096, 32),
    "gpt3-13b": _gpt("gpt3-13b", 40, 5120, 40),
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96),
    # Llama 2 (Touvron et al. 2023) and Llama 3 / 3.1 (Dubey et al. 2024) as in their config.json files.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # Tiny models for tests and CPU runs.
    "tiny-gpt": _gpt("tiny-gpt", 4, 128, 4, vocab=512, seq=256),
    "tiny-llama": _llama("tiny-llama", 4, 128, 4, 2, 384, 512, 256),
}

_INLINE_KEYS = {
    "layers": "layers", "hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads", "ffn": "ffn",
    "vocab": "vocab", "seq": "max_seq_len", "max_seq_len": "max_seq_len", "head_dim": "head_dim",
    "attention": "attention", "dropout": "dropout", "tied": "tied_embeddings",
}
_REQUIRED_INLINE = ("layers", "hidden", "heads", "vocab")


def parse_inline(text: str) -> ModelSpec:
    """Parse `gpt:layers=..,hidden=..,heads=..,vocab=..` or `llama:...,kv_heads=..,ffn=..`."""
    family, _, body = text.partition(":")
    if family not in ("gpt", "llama"):
        raise PlaitError(f"inline model {text!r} must start with 'gpt:' or 'llama:'")
    values: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in _INLINE_KEYS:
            raise PlaitError(
                f"inline model {text!r}: cannot read {item!r}; use key=value with keys "
                + ", ".join(sorted(_INLINE_KEYS))
            )
        field = _INLINE_KEYS[key]
        if field in values:
            raise PlaitError(f"inline model {text!r} gives {key} twice; give each key once")
        raw = raw.strip()
        if field == "attention":
            if raw not in ("flash", "eager"):
                raise PlaitError(f"inline model {text!r}: attention must be flash or eager, got {raw!r}")
            values[field] = raw
        elif field in ("dropout", "tied_embeddings"):
            if raw.lower() not in ("0", "1", "true", "false"):
                raise PlaitError(f"inline model {text!r}: {key} must be true or false, got {raw!r}")
            values[field] = raw.lower() in ("1", "true")
        else:
            try:
                values[field] = int(raw)
            except ValueError:
                raise PlaitError(f"inline model {text!r}: {key} must be an integer, got {raw!r}") from None
    missing = [k for k in _REQUIRED_INLINE if k not in values]
    if missing:
        raise PlaitError(f"inline model {text!r} lacks {', '.join(missing)}; give e.g. "
                         f"{family}:layers=32,hidden=4096,heads=32,vocab=32000")
    name = text
    if family == "gpt":
        return ModelSpec(name=name, family="gpt", **values)  # type: ignore[arg-type]
    base = {"max_seq_len": 4096, **values}
    hidden = base.pop("hidden")
    return replace(_llama(name, base.pop("layers"), hidden, base.pop("heads"),  # type: ignore[arg-type]
                          base.pop("kv_heads", 0), base.pop("ffn", 0) or llama_ffn(hidden),  # type: ignore[arg-type]
                          base.pop("vocab"), base.pop("max_seq_len")), **base)  # type: ignore[arg-type]


_HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def from_hf_config(config: dict, name: str = "hf") -> ModelSpec:
    """ModelSpec from a Hugging Face `config.json` (Llama, Mistral, Qwen2 or GPT-2 field names)."""
    model_type = str(config.get("model_type", "")).lower()

    def need(*keys: str) -> int:
        for key in keys:
            if config.get(key) is not None:
                return int(config[key])
        raise PlaitError(f"config.json of {name!r} has no {keys[0]!r}; is it a decoder-only LM config?")

    if model_type == "gpt2" or "n_embd" in config:
        hidden = need("n_embd", "hidden_size")
        return ModelSpec(
            name=name, family="gpt", layers=need("n_layer", "num_hidden_layers"), hidden=hidden,
            heads=need("n_head", "num_attention_heads"), vocab=need("vocab_size"),
            ffn=int(config.get("n_inner") or 4 * hidden), max_seq_len=need("n_positions", "n_ctx"),
            tied_embeddings=bool(config.get("tie_word_embeddings", True)),
        )
    if config.get("num_local_experts") or config.get("num_experts"):
        raise PlaitError(f"config.json of {name!r} describes a mixture-of-experts model; experts are not modelled "
                         "yet: give a dense Llama, Mistral, Qwen2 or GPT-2 config")
    if model_type and model_type not in _HF_LLAMA_TYPES:
        raise PlaitError(
            f"config.json of {name!r} has model_type {model_type!r}; supported: gpt2, "
            + ", ".join(_HF_LLAMA_TYPES)
        )
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    return ModelSpec(
        name=name, family="llama", layers=need("num_hidden_layers"), hidden=hidden, heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads), ffn=need("intermediate_size"),
        vocab=need("vocab_size"), head_dim=int(config.get("head_dim") or 0),
        max_seq_len=int(config.get("max_position_embeddings") or 4096), gated_mlp=True, norm="rmsnorm",
        bias=False, qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        out_bias=bool(config.get("attention_bias", False)), mlp_bias=bool(config.get("mlp_bias", False)),
        dropout=False, tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        learned_positions=False,
    )


def load_model(ref: str) -> ModelSpec:
    """A ModelSpec from a preset name, a path to a Hugging Face config.json, or an inline spec."""
    if ref in PRESETS:
        return PRESETS[ref]
    if ref.startswith(("gpt:", "llama:")):
        return parse_inline(ref)
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise PlaitError(f"model config {str(path)!r} does not exist; give a preset name "
                             "(see `plait models`), a config.json path or an inline spec")
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlaitError(f"cannot read {str(path)!r} as JSON ({exc}); give a Hugging Face config.json")
        if not isinstance(config, dict):
            raise PlaitError(f"{str(path)!r} is not a JSON object; give a Hugging Face config.json")
        return from_hf_config(config, name=path.parent.name or path.stem)
    raise PlaitError(
        f"unknown model {ref!r}; use a preset ({', '.join(PRESETS)}), a config.json path, "
        "or an inline spec such as llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256"
    )


def field_names() -> list[str]:
    """Field names of ModelSpec (for tables)."""
    return [f.name for f in fields(ModelSpec)]
