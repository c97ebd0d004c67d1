"""Model definitions of the runtime: `build_model(spec)` gives a `Transformer` of the spec's family (Llama,
GPT, T5-style encoder-decoder, LLaVA-style vision + text) whose module names are the same for all of them
(see `plait.models.llama`), and `hf_weights` loads Hugging Face safetensors checkpoints into Llama and GPT."""

from __future__ import annotations

import torch

from plait.errors import PlaitError
from plait.executable import unbuildable
from plait.models.gpt import GPT
from plait.models.llama import Llama, Transformer, TransformerBlock
from plait.models.t5 import T5
from plait.models.vision import Llava
from plait.spec.model import ModelSpec

__all__ = ["GPT", "T5", "Llama", "Llava", "Transformer", "TransformerBlock", "build_model"]


def build_model(spec: ModelSpec, *, dropout: float = 0.0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", seed: int | None = 0) -> Transformer:
    """The model for `spec` (family "llama", "gpt", "t5" or "llava") on `device`, initialised by `init_weights(seed)`.

    On the meta device (or with seed=None) the weights are left uninitialised: call `to_empty(device=...)`
    and then `init_weights(seed)`, which gives the same weights as building on the device directly.
    Parameters take `dtype`; the RoPE table stays float32.
    """
    families = {"llama": Llama, "gpt": GPT, "t5": T5, "llava": Llava}
    if (reason := unbuildable(spec)) is not None:
        raise PlaitError(reason)
    with torch.device(device):
        model = families[spec.family](spec, dropout=dropout)
    if seed is not None and model.tok_embeddings.weight.device.type != "meta":
        model.init_weights(seed)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model
