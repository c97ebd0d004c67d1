"""Hugging Face safetensors checkpoints <-> plait models, with a self-contained safetensors reader/writer.

The format: an 8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, then the raw little-endian tensor bytes (offsets
relative to the end of the header). Names understood:

- Llama (also Mistral, Qwen2, Qwen3): `model.embed_tokens`, `model.layers.{i}.input_layernorm`,
  `self_attn.{q,k,v,o}_proj` (Qwen3: and `self_attn.{q,k}_norm`), `post_attention_layernorm`,
  `mlp.{gate,up,down}_proj`, `model.norm`, `lm_head`. q/k are used as stored: plait's RoPE uses HF's
  rotate_half layout. MoE layers (`MoeNames`), one tensor an expert, stacked into plait's `Experts`: Mixtral's
  `block_sparse_moe.gate` (the router) and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down);
  Qwen2-MoE's, Qwen3-MoE's and DeepSeek-V3's `mlp.gate` (DeepSeek-V3: with `e_score_correction_bias`),
  `mlp.experts.{e}.{gate,up,down}_proj`, shared experts in `mlp.shared_expert` (Qwen2-MoE, gated by
  `mlp.shared_expert_gate`) or `mlp.shared_experts` (DeepSeek). DeepSeek's latent attention:
  `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` (or `q_proj`), `kv_a_proj_with_mqa`, `kv_a_layernorm`,
  `kv_b_proj`, `o_proj`; its rotary channels stored interleaved (config.json's rope_interleave, on by default)
  are permuted into the rotate_half layout on loading and back on saving. GPT-OSS: `self_attn.sinks`,
  `mlp.router` (with a bias), and all experts in one tensor a matrix (`mlp.experts.gate_up_proj` [E, H, 2F],
  gate and up interleaved, `down_proj` [E, F, H], each with a `_bias`). Quantized weights are dequantized on
  loading: block-quantized FP8 (a `weight_scale_inv` per 128 x 128 tile: DeepSeek-V3's released files) and
  MXFP4 (`_blocks` and `_scales`: GPT-OSS's released experts).
- GPT-2, with or without a `transformer.` prefix: `wte`, `wpe`, `h.{i}.ln_1`, `attn.c_attn` (Conv1D
  [in, out] layout holding q, k and v side by side), `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`, `ln_f`.

Buffers (attention masks, rotary inv_freq) and the layers a pipeline stage deleted are ignored; a tensor the
model needs and the files lack is an error, and so is a weight of a held layer that no parameter reads (the
runtime builds that layer otherwise).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from plait.errors import PlaitError
from plait.io import write_atomically
from plait.models.llama import SCALED_ROPE, Transformer, copy_full_, rope_kind

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

_LLAMA = {  # plait suffix of layers.{i}. -> HF suffix of model.layers.{i}.
    "attention_norm": "input_layernorm", "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
}
_QK_NORMS = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}  # Qwen3
_LATENT = {  # DeepSeek-V2/V3's multi-head latent attention (`plait.models.mla`)
    "attention.wq_a": "self_attn.q_a_proj", "attention.q_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj", "attention.wq": "self_attn.q_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa", "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj", "attention.wo": "self_attn.o_proj",
}


@dataclass(frozen=True)
class MoeNames:
    """Where a Hugging Face checkpoint keeps a MoE layer's tensors (suffixes of model.layers.{i}.)."""

    router: str  # the router's linear (and DeepSeek-V3's e_score_correction_bias beside its weight)
    experts: str  # expert e's matrices: {experts}.{e}.{name} with the names of `weights`
    weights: tuple[str, str, str]  # the names of plait's w1 (gate), w3 (up), w2 (down)
    shared: str = ""  # the shared experts' MLP (gate_proj, up_proj, down_proj)
    fused: bool = False  # every expert in one tensor a matrix, [E, in, out], gate and up interleaved in one
    # (GPT-OSS: {experts}.gate_up_proj, its _bias, down_proj, its _bias)

    def expert_keys(self, layer: str, weight: str, bias: bool, experts: int) -> list[str]:
        """The HF tensors of a MoE layer's stacked `weight` (a `weights` name) or its bias: one, or one an
        expert."""
        if self.fused:
            return [f"model.layers.{layer}.{self.experts}.{weight}{'_bias' if bias else ''}"]
        kind = "bias" if bias else "weight"
        return [f"model.layers.{layer}.{self.experts}.{e}.{weight}.{kind}" for e in range(experts)]

    def layer(self) -> dict[str, str]:
        """plait suffix -> HF suffix of the router, its choice bias, the shared experts and their gate."""
        dense = {f"feed_forward.shared.{w}": f"{self.shared}.{p}" for w, p in
                 (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}
        return {"feed_forward.router": self.router, "feed_forward.shared_gate": "mlp.shared_expert_gate", **dense}


MOE_NAMES = {
    "mixtral": MoeNames("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")),
    "qwen": MoeNames("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"), "mlp.shared_expert"),
    "deepseek": MoeNames("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"), "mlp.shared_experts"),
    "gpt-oss": MoeNames("mlp.router", "mlp.experts", ("gate_up_proj", "gate_up_proj", "down_proj"), fused=True),
}
"""The MoE layouts: Mixtral's; Qwen2-MoE's and Qwen3-MoE's; DeepSeek-V2/V3's (and Kimi K2's); GPT-OSS's."""
_LLAMA_TOP = {"tok_embeddings": "model.embed_tokens", "pos_embeddings": "model.embed_positions",
              "norm": "model.norm", "output": "lm_head"}
_GPT2 = {"attention_norm": "ln_1", "attention.wo": "attn.c_proj", "ffn_norm": "ln_2",
         "feed_forward.w1": "mlp.c_fc", "feed_forward.w2": "mlp.c_proj"}
_GPT2_TOP = {"tok_embeddings": "wte", "pos_embeddings": "wpe", "norm": "ln_f", "output": "lm_head"}
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of one .safetensors file, on the CPU, mapped from the file (copy-on-write): their bytes are
    read from disk when a tensor is used, so a checkpoint larger than memory can be opened and only the
    tensors a rank needs are read."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        data = np.memmap(path, dtype=np.uint8, mode="c") if path.stat().st_size > 8 + n else None
        return {name: _mapped(data, 8 + n, info) for name, info in header.items()}
    except (struct.error, ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:
        raise PlaitError(f"{str(path)!r} is not a readable safetensors file ({exc}); re-download or re-save it")


def _mapped(data: np.memmap | None, start: int, info: dict) -> Tensor:
    """One tensor of a mapped safetensors file (`start`: where the data begins) as its header entry describes."""
    dtype, shape = DTYPES[info["dtype"]], info["shape"]
    begin, end = (start + off for off in info["data_offsets"])
    if end <= begin:
        return torch.empty(shape, dtype=dtype)
    if data is None or end > len(data) or (end - begin) % dtype.itemsize:
        raise ValueError(f"tensor bytes [{begin}, {end}) lie outside the file or do not fit {info['dtype']}")
    raw = torch.from_numpy(data[begin:end])
    if begin % dtype.itemsize:  # an unaligned tensor: its own copy
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


def write_safetensors(path: str | Path, tensors: dict[str, Tensor]) -> None:
    """Write tensors (moved to the CPU, made contiguous) as one .safetensors file, atomically: a file of the
    same name stays whole for the tensors mapped from it (`read_safetensors`) until the new one replaces it."""
    header: dict[str, dict] = {}
    blobs, offset = [], 0
    for name, t in tensors.items():
        blob = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as the reference writer does
    write_atomically(path, struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _hf_names(name: str, model: Transformer, gpt2: bool, moe: MoeNames) -> list[str]:
    """The HF tensors plait parameter (or buffer) `name` (e.g. layers.3.attention.wq.weight) is stored as: one,
    or for a MoE layer's stacked experts one an expert."""
    top, blocks = (_GPT2_TOP, _GPT2) if gpt2 else (_LLAMA_TOP, _LLAMA)
    if (m := EXPERTS.fullmatch(name)) is not None:
        i, w, bias = m.groups()
        weight = moe.weights[("w1", "w3", "w2").index(w)]
        return moe.expert_keys(i, weight, bool(bias), model.spec.stack[int(i)].experts)
    if m := re.fullmatch(r"layers\.(\d+)\.feed_forward\.choice_bias", name):
        return [f"model.layers.{m.group(1)}.{moe.router}.e_score_correction_bias"]
    if m := re.fullmatch(r"layers\.(\d+)\.attention\.sinks", name):
        return [f"model.layers.{m.group(1)}.self_attn.sinks"]
    if m := re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name):
        i, module, kind = m.groups()
        if gpt2:
            if module in ("attention.wq", "attention.wk", "attention.wv"):
                return [f"h.{i}.attn.c_attn.{kind}"]
            return [f"h.{i}.{blocks[module]}.{kind}"]
        block = model.spec.stack[int(i)]
        names = blocks | (_LATENT if block.latent else _QK_NORMS) | (moe.layer() if block.kind == "moe" else {})
        return [f"model.layers.{i}.{names[module]}.{kind}"]
    module, kind = name.rsplit(".", 1)
    return [f"{top[module]}.{kind}"]


EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])(_bias)?")
"""A MoE layer's stacked experts [E, ...] and their biases (`plait.models.moe.Experts`), stored one expert a
tensor, or all in one (`MoeNames.fused`)."""


def _unfused(t: Tensor, name: str) -> Tensor:
    """plait's stacked expert tensor `name` from GPT-OSS's fused one `t`: gate (w1) and up (w3) the even and
    odd columns of gate_up_proj [E, H, 2F] (its bias [E, 2F]); matrices [E, in, out] turned to [E, out, in]."""
    if name.endswith(("w1", "w3", "w1_bias", "w3_bias")):
        t = t[..., 0::2] if ".w1" in name else t[..., 1::2]
    return t if name.endswith("_bias") else t.transpose(1, 2)


def _fused(parts: dict[str, Tensor]) -> Tensor:
    """GPT-OSS's fused tensor from plait's stacked ones (`parts`: w1/w3, their biases, or w2 or its bias, by
    the name's last part): gate and up interleaved along the last dimension, matrices as [E, in, out]."""
    turn = {k: t if k.endswith("_bias") else t.transpose(1, 2) for k, t in parts.items()}
    if len(turn) == 1:
        return next(iter(turn.values()))
    gate, up = (next(t for k, t in turn.items() if k.startswith(w)) for w in ("w1", "w3"))
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _tensors(model: Transformer) -> Iterator[tuple[str, Tensor]]:
    """The model's parameters and the buffers a checkpoint holds (MoE routers' choice biases)."""
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n.endswith("choice_bias"))


def _rotary_rows(name: str, model: Transformer) -> tuple[int, int, int] | None:
    """(rows per group, first rotary row of a group, rotary rows) of a latent-attention projection whose output
    rows hold rotary channels (each query head's last Dr rows, the shared rotary key after the kv latent);
    None for other tensors."""
    m = re.fullmatch(r"layers\.(\d+)\.attention\.(wq_b|wq|wkv_a)\.(weight|bias)", name)
    if m is None or not (b := model.spec.stack[int(m.group(1))]).latent:
        return None
    if m.group(2) == "wkv_a":
        return b.kv_lora + b.rope_head_dim, b.kv_lora, b.rope_head_dim
    return b.qk_head_dim, b.head_dim, b.rope_head_dim


def _interleaved(t: Tensor, rows: tuple[int, int, int], inverse: bool = False) -> Tensor:
    """`t` with each group's rotary rows taken from DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... into
    the rotate_half layout (x0, x2, ..., x1, x3, ...), as transformers' apply_rotary_pos_emb_interleave reads
    them; `inverse`: back."""
    group, first, rotary = rows
    order = torch.cat([torch.arange(0, rotary, 2), torch.arange(1, rotary, 2)])
    if inverse:
        order = order.argsort()
    grouped = t.reshape(-1, group, *t.shape[1:])
    head, rot, tail = grouped.split([first, rotary, group - first - rotary], dim=1)
    return torch.cat([head, rot[:, order], tail], dim=1).reshape(t.shape)


def _from_hf(hf: Mapping[str, Tensor], name: str, model: Transformer, gpt2: bool, moe: MoeNames,
             interleaved: bool) -> Tensor:
    """The full tensor for plait parameter `name` from the HF tensors, in plait's [out, in] layout."""
    if name == "output.weight" and model.spec.tied_embeddings and "lm_head.weight" not in hf:
        name = "tok_embeddings.weight"  # tied checkpoints store only the embedding
    keys = _hf_names(name, model, gpt2, moe)
    if EXPERTS.fullmatch(name):
        if missing := [k for k in keys if k not in hf]:
            raise PlaitError(f"checkpoint lacks tensor {missing[0]!r} (for {name}); MoE checkpoints load in "
                             "Mixtral's, Qwen-MoE's, DeepSeek's or GPT-OSS's layout")
        return _unfused(hf[keys[0]], name) if moe.fused else torch.stack([hf[k] for k in keys])
    key = keys[0]
    if key not in hf:
        raise PlaitError(f"checkpoint lacks tensor {key!r} (for {name}); is it a checkpoint of this model?")
    t = hf[key]
    if gpt2 and key.endswith(_CONV1D):
        t = t.t()  # Conv1D stores [in, out]
    if ".c_attn." in key:
        q_dim, kv_dim = model.spec.q_dim, model.spec.kv_dim
        if t.shape[0] != q_dim + 2 * kv_dim:
            raise PlaitError(f"tensor {key!r} has shape {list(hf[key].shape)}, expected fused q, k, v of "
                             f"{q_dim + 2 * kv_dim}; the checkpoint does not match model {model.spec.name!r}")
        q, k, v = t.split([q_dim, kv_dim, kv_dim], dim=0)
        t = {"wq": q, "wk": k, "wv": v}[name.split(".")[-2]]
    if interleaved and (rows := _rotary_rows(name, model)) is not None and t.shape[0] % rows[0] == 0:
        t = _interleaved(t, rows)
    return t


def _moe_names(hf: Mapping[str, Tensor]) -> MoeNames:
    """The MoE layout of a checkpoint's tensors (Mixtral's unless it has Qwen's, DeepSeek's or GPT-OSS's
    names)."""
    if any(".mlp.shared_experts." in k for k in hf):
        return MOE_NAMES["deepseek"]
    if any(".mlp.router." in k for k in hf):
        return MOE_NAMES["gpt-oss"]
    return MOE_NAMES["qwen"] if any(".mlp.experts." in k or ".mlp.gate." in k for k in hf) else MOE_NAMES["mixtral"]


def _config(directory: Path) -> dict:
    """The checkpoint folder's config.json ({} when it has none or it is unreadable)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _rope_interleaved(config: dict, model: Transformer) -> bool:
    """Whether the checkpoint's latent attention stores its rotary channels interleaved: config.json's
    rope_interleave, on by default (DeepSeek's own layout) for latent-attention models."""
    return any(b.latent for b in model.spec.stack) and bool(config.get("rope_interleave", True))


SCALE_SUFFIX = ".weight_scale_inv"
"""The per-tile scales of a block-quantized FP8 weight (DeepSeek-V3's, Kimi K2's and Qwen's FP8 releases)."""
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The values of the 16 codes of a 4-bit e2m1 number (MXFP4's elements)."""


class Dequantized(Mapping[str, Tensor]):
    """A checkpoint's tensors with its quantized weights read as fp32, each when it is read (a rank decodes only
    the weights its layers load): block-quantized FP8 (`_fp8_weight`) and MXFP4 (`_mxfp4_weight`), their
    scales and blocks not listed; the other tensors as they are."""

    def __init__(self, raw: Mapping[str, Tensor], config: dict) -> None:
        self.raw, self.config = raw, config
        self.fp8 = {k.removesuffix("_scale_inv"): k for k in raw if k.endswith(SCALE_SUFFIX)}
        self.mxfp4 = {k.removesuffix("_blocks"): k for k in raw
                      if k.endswith("_blocks") and k.removesuffix("_blocks") + "_scales" in raw}
        parts = set(self.fp8.values()) | set(self.mxfp4.values()) | {k + "_scales" for k in self.mxfp4}
        self.names = dict.fromkeys([*(k for k in raw if k not in parts), *self.fp8, *self.mxfp4])

    def __getitem__(self, name: str) -> Tensor:
        if name in self.fp8:
            return _fp8_weight(self.raw.get(name), self.raw[self.fp8[name]], self.fp8[name], self.config)
        if name in self.mxfp4:
            return _mxfp4_weight(self.raw[self.mxfp4[name]], self.raw[name + "_scales"], self.mxfp4[name])
        if name not in self.names:
            raise KeyError(name)
        return self.raw[name]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _fp8_weight(w: Tensor | None, scale: Tensor, key: str, config: dict) -> Tensor:
    """A block-quantized FP8 weight in fp32: each quantization_config.weight_block_size tile (default 128 x 128)
    times its `weight_scale_inv`, as transformers' FP8 dequantization does."""
    quant = config.get("quantization_config")
    rows, cols = (quant.get("weight_block_size") if isinstance(quant, dict) else None) or (128, 128)
    if w is None or w.dim() != 2 or tuple(scale.shape) != (-(-w.shape[0] // rows), -(-w.shape[1] // cols)):
        raise PlaitError(f"checkpoint tensor {key!r} of shape {list(scale.shape)} does not scale a weight "
                         f"{key.removesuffix('_scale_inv')!r} in {rows} x {cols} tiles; give config.json's "
                         "quantization_config with its weight_block_size, or a checkpoint in 16 or 32 bits")
    tiles = scale.float().repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
    return w.float() * tiles


def _mxfp4_weight(blocks: Tensor, scales: Tensor, key: str) -> Tensor:
    """An MXFP4 stack of expert matrices in fp32 (GPT-OSS's released experts), as transformers'
    convert_moe_packed_tensors: `blocks` [E, out, G, 16] bytes of two 4-bit codes (low nibble first), `scales`
    [E, out, G] a power of two (biased by 127) per 32 values -> [E, in = 32 G, out], the layout of the
    unquantized tensor."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape) \
            or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise PlaitError(f"checkpoint tensor {key!r} of shape {list(blocks.shape)} and its scales "
                         f"{list(scales.shape)} are not MXFP4 blocks [E, out, G, 16] and scales [E, out, G] of "
                         "bytes; give the checkpoint as released, or in 16 or 32 bits")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [E, out, G, 16, 2]
    values = torch.tensor(FP4_VALUES)[codes].flatten(-2)  # [E, out, G, 32]
    values = torch.ldexp(values, (scales.long() - 127)[..., None])
    return values.flatten(-2).transpose(1, 2).contiguous()


HF_FAMILIES = ("llama", "gpt")
"""Families whose Hugging Face parameter names this module maps."""


def load_hf_safetensors(model: Transformer, directory: str | Path) -> None:
    """Load every parameter `model` has (Llama naming, or GPT-2 naming for the gpt family) from `directory/*.safetensors`.

    Works on pipeline stages (deleted modules are skipped) and on sharded DTensor parameters (each rank
    keeps its shard). The files are mapped, not read whole: a rank reads the tensors its parameters take.
    Dtypes are converted to the model's; quantized weights (block-quantized FP8, MXFP4) are dequantized as
    they are read (`Dequantized`).
    """
    if model.spec.family not in HF_FAMILIES:
        raise PlaitError(f"Hugging Face checkpoints load into {' and '.join(HF_FAMILIES)} models, not "
                         f"{model.spec.family} ({model.spec.name}); start it from the seed instead")
    scaling = dict(model.spec.rope_scaling)
    if scaling and (kind := rope_kind(scaling)) not in SCALED_ROPE:
        raise PlaitError(f"{model.spec.name} scales RoPE as {kind!r}, which the runtime does not apply (it applies "
                         f"{', '.join(SCALED_ROPE)}); its weights would load into another model, so start it from "
                         "the seed instead")
    path = Path(directory)
    if not path.is_dir():
        raise PlaitError(f"checkpoint directory {str(path)!r} does not exist; give a folder with *.safetensors")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PlaitError(f"no *.safetensors files in {str(path)!r}; give a Hugging Face checkpoint folder")
    raw: dict[str, Tensor] = {}
    for file in files:
        raw.update(read_safetensors(file))
    config = _config(path)
    hf = Dequantized({k.removeprefix("transformer."): v for k, v in raw.items()}, config)
    gpt2 = model.spec.family == "gpt"
    moe, interleaved = _moe_names(hf), _rope_interleaved(config, model)
    used: set[str] = set()
    for name, param in _tensors(model):
        full = _from_hf(hf, name, model, gpt2, moe, interleaved)
        keys = _hf_names(name, model, gpt2, moe)
        used.update(keys)
        if full.shape != param.shape:
            raise PlaitError(f"tensor {keys[0]!r} has shape {list(full.shape)} but {name} of model "
                             f"{model.spec.name!r} needs {list(param.shape)}; the checkpoint is of another shape")
        copy_full_(param, full.to(param.dtype))
    if unused := _unused_layer_tensors(hf, used, model, gpt2):
        more = f" and {len(unused) - 2} more" if len(unused) > 2 else ""
        raise PlaitError(f"checkpoint tensors {', '.join(unused[:2])}{more} have no place in plait's "
                         f"{model.spec.family} layers (e.g. Gemma-2's extra norms): the runtime "
                         "does not build this architecture's layer; start it from the seed instead")


IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
"""Buffers some checkpoints store in a layer that are not weights (rotary frequencies, GPT-2's causal mask)."""


def _unused_layer_tensors(hf: Mapping[str, Tensor], used: set[str], model: Transformer, gpt2: bool) -> list[str]:
    """The checkpoint's tensors of the layers `model` holds that no parameter read (sorted): weights of a layer
    the runtime builds differently, which loading must not drop silently."""
    held = set(model.layers.keys())
    prefix = re.compile(r"h\.(\d+)\." if gpt2 else r"model\.layers\.(\d+)\.")
    return sorted(k for k in hf if k not in used and not k.endswith(IGNORED_SUFFIXES)
                  and (m := prefix.match(k)) is not None and m.group(1) in held)


def save_hf_safetensors(model: Transformer, directory: str | Path, filename: str = "model.safetensors",
                        moe_layout: str | None = None, rope_interleave: bool = True) -> Path:
    """Write the model's parameters with HF names (Llama naming; GPT-2 naming for the gpt family) to
    `directory/filename`: MoE layers in `moe_layout` (a `MOE_NAMES` key; default: GPT-OSS's for biased routers,
    DeepSeek's for latent attention or sigmoid routers, Qwen's for q/k norms, gated or shared experts, else
    Mixtral's), latent attention's rotary channels interleaved unless `rope_interleave` is False. A tied head is
    stored once, as the embedding. DTensor parameters are gathered (a collective: call on every rank)."""
    gpt2 = model.spec.family == "gpt"
    moe = MOE_NAMES[moe_layout or _default_moe_layout(model.spec.stack)]
    interleaved = rope_interleave and any(b.latent for b in model.spec.stack)
    hf: dict[str, Tensor] = {}
    fused: dict[str, dict[str, Tensor]] = {}  # GPT-2 c_attn: q, k, v side by side
    experts: dict[str, dict[str, Tensor]] = {}  # GPT-OSS: gate and up in one tensor
    for name, param in _tensors(model):
        t = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        if name == "output.weight" and model.spec.tied_embeddings:
            name = "tok_embeddings.weight"
        keys = _hf_names(name, model, gpt2, moe)
        if EXPERTS.fullmatch(name):  # one tensor an expert, or all in one
            if moe.fused:
                experts.setdefault(keys[0], {})[name.rsplit(".", 1)[1]] = t
            else:
                hf.update(zip(keys, t.unbind(0), strict=True))
            continue
        key = keys[0]
        if gpt2 and key.endswith(_CONV1D):
            t = t.t()
        if interleaved and (rows := _rotary_rows(name, model)) is not None:
            t = _interleaved(t, rows, inverse=True)
        if ".c_attn." in key:
            fused.setdefault(key, {})[name.split(".")[-2]] = t
        else:
            hf[key] = t
    for key, qkv in fused.items():  # Conv1D weights [in, out]: join along out, the last dimension
        hf[key] = torch.cat([qkv["wq"], qkv["wk"], qkv["wv"]], dim=-1)
    hf.update((key, _fused(parts)) for key, parts in experts.items())
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / filename, hf)
    return out / filename


def _default_moe_layout(stack: tuple) -> str:
    """The MoE layout a model's layers suggest (see `save_hf_safetensors`)."""
    moes = [b for b in stack if b.kind == "moe"]
    if any(b.gating.router_bias for b in moes):
        return "gpt-oss"
    if any(b.latent for b in stack) or any(b.gating.score == "sigmoid" for b in moes):
        return "deepseek"
    return "qwen" if any(b.qk_norm for b in stack) or any(b.ffn for b in moes) else "mixtral"
