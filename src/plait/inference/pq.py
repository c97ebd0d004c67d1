"""Product quantisation of attention keys (PQCache): approximate q . k for every past token from codes.

Each key vector [D] is cut into `m` sub-vectors of D/m channels; each sub-space has 2^bits centroids found by
k-means over the keys (vectorised over every head and sub-space at once); a key is stored as m small
integers (its nearest centroid per sub-space; one byte each for up to 256 centroids). A query's inner
product with every key is then the sum over sub-spaces of one table lookup:
table[s, c] = q_s . centroid[s, c], so scoring T keys costs m x T lookups instead of D x T multiply-adds,
and needs only the codes (bytes per token: m), not the keys.

Shapes: G independent groups (e.g. a layer's kv heads), T tokens, D channels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plait.inference.buffer import Growing


class Codebook:
    """Centroids [G, m, K, D/m] and the codes of T keys [G, T, m], each code held in the smallest integer type
    that holds a centroid index (`code_dtype`: one byte for up to 256 centroids), so the bytes counted are
    the bytes held. Scoring widens only the codes it reads, for one step."""

    def __init__(self, centroids: Tensor, codes: Tensor) -> None:
        self.centroids = centroids
        g, m, k, _ = centroids.shape
        self.dtype = code_dtype(k)
        self.offsets = (torch.arange(g)[:, None] * m + torch.arange(m)[None, :]) * k  # [G, m]
        self.rows = Growing(codes.to(self.dtype), dim=1)

    @property
    def codes(self) -> Tensor:
        """Codes [G, T, m] (in `dtype`)."""
        return self.rows.view

    @property
    def held_bytes(self) -> int:
        """Bytes held: the codes' buffer (spare capacity included) and the centroids."""
        return self.rows.held_bytes + self.centroids.numel() * self.centroids.element_size()

    @property
    def subspaces(self) -> int:
        return self.centroids.shape[1]

    @property
    def length(self) -> int:
        """Keys coded so far."""
        return self.rows.length

    def split(self, x: Tensor) -> Tensor:
        """[G, T, D] -> [G, m, T, D/m]."""
        g, t, d = x.shape
        return x.reshape(g, t, self.subspaces, d // self.subspaces).transpose(1, 2)

    def encode(self, keys: Tensor) -> Tensor:
        """Codes [G, T, m] of keys [G, T, D]: the nearest centroid in every sub-space."""
        return _nearest(self.split(keys.float()), self.centroids).transpose(1, 2)

    def append(self, keys: Tensor) -> None:
        """Encode new keys [G, T_new, D] and add their codes after the existing ones."""
        self.rows.append(self.encode(keys).to(self.dtype))

    def reconstruct(self) -> Tensor:
        """The keys as the codes describe them: [G, T, D]."""
        g, m, _, ds = self.centroids.shape
        idx = self.codes.long().transpose(1, 2)  # [G, m, T]
        parts = torch.gather(self.centroids, 2, idx[..., None].expand(-1, -1, -1, ds))  # [G, m, T, ds]
        return parts.transpose(1, 2).reshape(g, -1, m * ds)

    def scores(self, queries: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """Approximate q . k for queries [G, Q, D] against the coded keys [start, end): [G, Q, end - start]."""
        q = self.split(queries.float())  # [G, m, Q, ds]
        table = (q @ self.centroids.transpose(-1, -2)).permute(2, 0, 1, 3).reshape(q.shape[2], -1)  # [Q, G*m*K]
        rows = self.codes[:, start:end].long() + self.offsets[:, None, :]  # flattened table rows [G, T, m]
        picked = table.index_select(1, rows.reshape(-1)).view(q.shape[2], *rows.shape)  # [Q, G, T, m]
        return picked.sum(-1).transpose(0, 1)


def code_dtype(centroids: int) -> torch.dtype:
    """The smallest integer type that holds indices 0..centroids-1 (uint8 up to 256 centroids)."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if centroids - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def _nearest(x: Tensor, centroids: Tensor) -> Tensor:
    """Index of the nearest centroid: x [G, m, T, ds], centroids [G, m, K, ds] -> [G, m, T]."""
    dist = (centroids * centroids).sum(-1)[:, :, None, :] - 2 * x @ centroids.transpose(-1, -2)
    return dist.argmin(-1)


def fit(keys: Tensor, subspaces: int, bits: int, iterations: int = 8, seed: int = 0) -> Codebook:
    """k-means codebooks of keys [G, T, D] (D divisible by `subspaces`), 2^bits centroids per sub-space (fewer
    when T is smaller), `iterations` Lloyd steps from distinct random keys; returns centroids and codes."""
    g, t, d = keys.shape
    if d % subspaces:
        raise ValueError(f"head_dim {d} does not split into {subspaces} sub-spaces")
    k = min(1 << bits, t)
    x = keys.float().reshape(g, t, subspaces, d // subspaces).transpose(1, 2)  # [G, m, T, ds]
    gen = torch.Generator().manual_seed(seed)
    start = torch.randperm(t, generator=gen)[:k]
    centroids = x[:, :, start].clone()  # [G, m, K, ds]
    for _ in range(iterations):
        assign = _nearest(x, centroids)  # [G, m, T]
        sums = torch.zeros_like(centroids).scatter_add_(2, assign[..., None].expand_as(x), x)
        counts = torch.zeros(centroids.shape[:3]).scatter_add_(2, assign, torch.ones_like(assign, dtype=torch.float))
        filled = counts > 0
        centroids = torch.where(filled[..., None], sums / counts.clamp_min(1)[..., None], centroids)
    return Codebook(centroids, _nearest(x, centroids).transpose(1, 2))
