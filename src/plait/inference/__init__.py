"""Long-context inference: product-quantised selective KV caches (PQCache) and the baselines they are
measured against, for Hugging Face causal LMs (`plait.inference.hf`, needs the `inference` extra)."""

from plait.inference.config import METHODS, PQCacheConfig

__all__ = ["METHODS", "PQCacheConfig"]
