"""Selective KV caches for Hugging Face causal LMs, through transformers' own extension points.

`SelectiveCache(model, config)` is a `transformers.Cache` whose layers keep every key and value (in CPU
memory by default) together with the method's state (`plait.inference.select.LayerCache`); the model's
attention runs through a registered attention function (`AttentionInterface`, name `ATTENTION`) that
prefills exactly and decodes over the selected tokens. No model code is forked:

    cache = SelectiveCache(model, PQCacheConfig(method="pqcache", budget=0.2))
    model.generate(input_ids, cache=cache, max_new_tokens=32)

The cache switches the model to `ATTENTION` while it exists (`release()`, or a new cache, restores it)
and works on batches without padding. Requires `transformers` (the `inference` extra).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from plait.errors import PlaitError
from plait.inference.config import PQCacheConfig
from plait.inference.select import LayerCache

ATTENTION = "plait_selective"
"""The name of the attention function in transformers' AttentionInterface."""

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise PlaitError("plait.inference needs transformers: pip install 'plait[inference]'") from exc


class SelectiveLayer(CacheLayerMixin):
    """transformers' view of one layer: tokens seen so far (for positions and masks). The keys and values
    themselves are kept by `kv`, which the attention function feeds."""

    is_sliding = False
    is_compileable = False

    def __init__(self, kv: LayerCache) -> None:
        super().__init__()
        self.kv = kv
        self.seen = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states  # the new tokens only: the attention function appends them to `kv`

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise PlaitError("a selective cache cannot be reset; make a new SelectiveCache")


class SelectiveCache(Cache):
    """A KV cache for `model` (a transformers causal LM) that attends to what `config` selects."""

    def __init__(self, model: nn.Module, config: PQCacheConfig, store_device: str | torch.device = "cpu") -> None:
        attentions = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
        if not attentions:
            raise PlaitError(f"{type(model).__name__} has no Llama-style attention modules (layer_idx, "
                             "num_key_value_groups); selective caches support Llama-family models")
        self.config = config
        self.kv = [LayerCache(config, store_device) for _ in attentions]
        super().__init__(layers=[SelectiveLayer(kv) for kv in self.kv])
        self.model_config = model.config
        self.previous = model.config._attn_implementation
        if self.previous == ATTENTION:
            self.previous = getattr(model.config, "_plait_previous_attention", "sdpa")
        model.config._plait_previous_attention = self.previous
        model.set_attn_implementation(ATTENTION)
        for m in attentions:
            m._plait_cache = weakref.ref(self)

    def release(self) -> None:
        """Give the model back its previous attention implementation."""
        self.model_config._attn_implementation = self.previous

    def recall(self) -> float | None:
        """Mean top-k recall of the PQ selection against exact scores (with `measure_recall`)."""
        values = [r for kv in self.kv for r in kv.recall]
        return sum(values) / len(values) if values else None

    def bytes(self) -> dict[str, int]:
        """Summed over layers: the full KV kept in the store, what a decode step holds near the accelerator
        and what it fetches from the store (`LayerCache.resident_bytes`)."""
        out: dict[str, int] = {}
        for kv in self.kv:
            for key, value in kv.resident_bytes().items():
                out[key] = out.get(key, 0) + value
        return out


def selective_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                        scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers attention function: query [B, H, Q, D], the new key/value [B, kv, Q, D] -> [B, Q, H, D]."""
    ref = getattr(module, "_plait_cache", None)
    cache = ref() if ref is not None else None
    if cache is None:
        raise PlaitError("the model runs plait's selective attention but no SelectiveCache is alive; pass "
                         "cache=SelectiveCache(model, config) to generate(), or call cache.release() first")
    layer = cache.kv[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] > 1 or layer.length == 0:
        out = layer.prefill(query, key, value, scale)
    else:
        out = layer.decode(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, selective_attention)
