"""Hugging Face safetensors checkpoints <-> plait models, with a self-contained safetensors reader/writer.

The format: an 8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, then the raw little-endian tensor bytes (offsets
relative to the end of the header). Names understood:

- Llama (also Mistral, Qwen2): `model.embed_tokens`, `model.layers.{i}.input_layernorm`,
  `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`, `model.norm`,
  `lm_head`. q/k are used as stored: plait's RoPE uses HF's rotate_half layout. Mixtral's MoE layers:
  `block_sparse_moe.gate` (the router) and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down: one
  tensor an expert, stacked into plait's `Experts`).
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
from pathlib import Path

import torch
from torch import Tensor

from plait.errors import PlaitError
from plait.models.llama import SCALED_ROPE, Transformer, copy_full_

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
    "feed_forward.router": "block_sparse_moe.gate",  # Mixtral's router; its experts: `_hf_names`
}
_LLAMA_TOP = {"tok_embeddings": "model.embed_tokens", "pos_embeddings": "model.embed_positions",
              "norm": "model.norm", "output": "lm_head"}
_GPT2 = {"attention_norm": "ln_1", "attention.wo": "attn.c_proj", "ffn_norm": "ln_2",
         "feed_forward.w1": "mlp.c_fc", "feed_forward.w2": "mlp.c_proj"}
_GPT2_TOP = {"tok_embeddings": "wte", "pos_embeddings": "wpe", "norm": "ln_f", "output": "lm_head"}
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of one .safetensors file, on the CPU."""
    data = Path(path).read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8: 8 + n])
        header.pop("__metadata__", None)
        out = {}
        for name, info in header.items():
            begin, end = (8 + n + off for off in info["data_offsets"])
            dtype, shape = DTYPES[info["dtype"]], info["shape"]
            raw = bytearray(data[begin:end])
            out[name] = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(shape)
        return out
    except (struct.error, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise PlaitError(f"{str(path)!r} is not a readable safetensors file ({exc}); re-download or re-save it")


def write_safetensors(path: str | Path, tensors: dict[str, Tensor]) -> None:
    """Write tensors (moved to the CPU, made contiguous) as one .safetensors file."""
    header: dict[str, dict] = {}
    blobs, offset = [], 0
    for name, t in tensors.items():
        blob = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned, as the reference writer does
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _hf_name(name: str, gpt2: bool) -> str:
    """The HF name of a plait parameter name (e.g. layers.3.attention.wq.weight)."""
    top, blocks = (_GPT2_TOP, _GPT2) if gpt2 else (_LLAMA_TOP, _LLAMA)
    if m := re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name):
        i, module, kind = m.groups()
        if gpt2 and module in ("attention.wq", "attention.wk", "attention.wv"):
            return f"h.{i}.attn.c_attn.{kind}"
        return f"h.{i}.{blocks[module]}.{kind}" if gpt2 else f"model.layers.{i}.{blocks[module]}.{kind}"
    module, kind = name.rsplit(".", 1)
    return f"{top[module]}.{kind}"


EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
"""A MoE layer's stacked experts [E, ...] (`plait.models.moe.Experts`), stored one expert a tensor."""


def _hf_names(name: str, model: Transformer, gpt2: bool) -> list[str]:
    """The HF tensors plait parameter `name` is stored as: one, or for a MoE layer's stacked experts one an
    expert (Mixtral's layout: block_sparse_moe.experts.{e}.w1 gate, w3 up, w2 down, as plait's)."""
    if gpt2 or (m := EXPERTS.fullmatch(name)) is None:
        return [_hf_name(name, gpt2)]
    i, w = m.groups()
    return [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
            for e in range(model.spec.stack[int(i)].experts)]


def _from_hf(hf: dict[str, Tensor], name: str, model: Transformer, gpt2: bool) -> Tensor:
    """The full tensor for plait parameter `name` from the HF tensors, in plait's [out, in] layout."""
    if name == "output.weight" and model.spec.tied_embeddings and "lm_head.weight" not in hf:
        name = "tok_embeddings.weight"  # tied checkpoints store only the embedding
    keys = _hf_names(name, model, gpt2)
    if EXPERTS.fullmatch(name):
        if missing := [k for k in keys if k not in hf]:
            raise PlaitError(f"checkpoint lacks tensor {missing[0]!r} (for {name}); MoE checkpoints load in "
                             "Mixtral's layout (block_sparse_moe.experts.E.w1/w2/w3)")
        return torch.stack([hf[k] for k in keys])
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
    return t


HF_FAMILIES = ("llama", "gpt")
"""Families whose Hugging Face parameter names this module maps."""


def load_hf_safetensors(model: Transformer, directory: str | Path) -> None:
    """Load every parameter `model` has (Llama naming, or GPT-2 naming for the gpt family) from `directory/*.safetensors`.

    Works on pipeline stages (deleted modules are skipped) and on sharded DTensor parameters (each rank
    keeps its shard). Dtypes are converted to the model's.
    """
    if model.spec.family not in HF_FAMILIES:
        raise PlaitError(f"Hugging Face checkpoints load into {' and '.join(HF_FAMILIES)} models, not "
                         f"{model.spec.family} ({model.spec.name}); start it from the seed instead")
    scaling = dict(model.spec.rope_scaling)
    if scaling and (kind := scaling.get("rope_type", scaling.get("type"))) not in SCALED_ROPE:
        raise PlaitError(f"{model.spec.name} scales RoPE as {kind!r}, which the runtime does not apply (it applies "
                         f"{', '.join(SCALED_ROPE)}); its weights would load into another model, so start it from "
                         "the seed instead")
    if any(b.latent for b in model.spec.stack):
        raise PlaitError(f"Hugging Face checkpoints of latent-attention models do not load yet ({model.spec.name}); "
                         "start it from the seed instead")
    path = Path(directory)
    if not path.is_dir():
        raise PlaitError(f"checkpoint directory {str(path)!r} does not exist; give a folder with *.safetensors")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PlaitError(f"no *.safetensors files in {str(path)!r}; give a Hugging Face checkpoint folder")
    hf: dict[str, Tensor] = {}
    for file in files:
        hf.update(read_safetensors(file))
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    gpt2 = model.spec.family == "gpt"
    used: set[str] = set()
    for name, param in model.named_parameters():
        full = _from_hf(hf, name, model, gpt2)
        keys = _hf_names(name, model, gpt2)
        used.update(keys)
        if full.shape != param.shape:
            raise PlaitError(f"tensor {keys[0]!r} has shape {list(full.shape)} but {name} of model "
                             f"{model.spec.name!r} needs {list(param.shape)}; the checkpoint is of another shape")
        copy_full_(param, full.to(param.dtype))
    if unused := _unused_layer_tensors(hf, used, model, gpt2):
        more = f" and {len(unused) - 2} more" if len(unused) > 2 else ""
        raise PlaitError(f"checkpoint tensors {', '.join(unused[:2])}{more} have no place in plait's "
                         f"{model.spec.family} layers (e.g. Qwen3's q/k norms, Gemma-2's extra norms): the runtime "
                         "does not build this architecture's layer; start it from the seed instead")


IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
"""Buffers some checkpoints store in a layer that are not weights (rotary frequencies, GPT-2's causal mask)."""


def _unused_layer_tensors(hf: dict[str, Tensor], used: set[str], model: Transformer, gpt2: bool) -> list[str]:
    """The checkpoint's tensors of the layers `model` holds that no parameter read (sorted): weights of a layer
    the runtime builds differently, which loading must not drop silently."""
    held = set(model.layers.keys())
    prefix = re.compile(r"h\.(\d+)\." if gpt2 else r"model\.layers\.(\d+)\.")
    return sorted(k for k in hf if k not in used and not k.endswith(IGNORED_SUFFIXES)
                  and (m := prefix.match(k)) is not None and m.group(1) in held)


def save_hf_safetensors(model: Transformer, directory: str | Path, filename: str = "model.safetensors") -> Path:
    """Write the model's parameters with HF names (Llama naming; GPT-2 naming for the gpt family) to `directory/filename`. A tied head is stored once, as the embedding. DTensor parameters
    are gathered (a collective: call on every rank)."""
    gpt2 = model.spec.family == "gpt"
    hf: dict[str, Tensor] = {}
    fused: dict[str, dict[str, Tensor]] = {}  # GPT-2 c_attn: q, k, v side by side
    for name, param in model.named_parameters():
        t = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        if name == "output.weight" and model.spec.tied_embeddings:
            name = "tok_embeddings.weight"
        if EXPERTS.fullmatch(name):  # one tensor an expert
            hf.update(zip(_hf_names(name, model, gpt2), t.unbind(0)))
            continue
        key = _hf_name(name, gpt2)
        if gpt2 and key.endswith(_CONV1D):
            t = t.t()
        if ".c_attn." in key:
            fused.setdefault(key, {})[name.split(".")[-2]] = t
        else:
            hf[key] = t
    for key, qkv in fused.items():  # Conv1D weights [in, out]: join along out, the last dimension
        hf[key] = torch.cat([qkv["wq"], qkv["wk"], qkv["wv"]], dim=-1)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / filename, hf)
    return out / filename
