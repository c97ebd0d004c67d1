"""LSH-MoE token compression (Nie et al., NeurIPS 2024, arXiv 2411.08446): the tokens bound for each expert
are clustered with cross-polytope locality-sensitive hashing and only the clusters' centroids travel to the
experts; each token's output is rebuilt from its centroid's expert output.

Cross-polytope hashing (Andoni et al. 2015): a random rotation R (here its first `dims` orthonormal columns,
so a hash has 2*dims buckets) maps a token x to the nearest vertex of the cross-polytope,
h(x) = argmax over the 2*dims coordinates of [Rx, -Rx]. `hashes` independent rotations are concatenated
(a bucket holds tokens equal under every hash), so more hashes give finer buckets, more centroids and a
smaller error, as in the paper's ablation (2-10 hash functions). A bucket is (expert, codes): tokens go to
different experts' centroids even when they hash alike. Hashing is angular (scale-free), so each expert's
tokens are centred on their mean before it: the buckets then split the expert's own spread rather than a
direction all its tokens share.

Residual compensation (the paper's Fig. 5: E(tokens) ~ E(centroids) combined with the residuals x - c):
the residual x - c of a token is exactly what separates the centroid's block output c + E(c) from the
token's x + E(x) besides the expert's own change; the token's own x stays on its block's skip path and
only E(c) is shared, so the block returns x + E(c) = (c + E(c)) + (x - c). Adding x - c to the expert's
output as well would count it twice: on real activations that reconstructs worse than no compensation
(tests/test_lsh_moe.py measures both), so the residual is applied once, through the skip connection.

Compression rate = centroids / routed (token, expert) pairs, measured per call. Gradients: the centroid
is the mean of its bucket and each pair takes its centroid's output, both differentiable, so every token
gets the exact gradient of the compressed layer (1/|bucket| of the bucket's expert-input gradient, plus its
own through the skip path and the router). Deterministic: rotations come from a fixed seed, and hashing
runs where the tokens are, before the dispatch, so no rank needs another's rotations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from plait.spec.lsh import LSH_DIMS, LSH_HASHES, LSH_SEED


@lru_cache(maxsize=16)
def rotations(hidden: int, hashes: int = LSH_HASHES, dims: int = LSH_DIMS, seed: int = LSH_SEED) -> Tensor:
    """`hashes` random rotations restricted to `dims` output coordinates: [hashes, hidden, dims] with
    orthonormal columns (QR of a Gaussian matrix, the first columns of a Haar-random rotation)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(hashes, hidden, dims, generator=gen, dtype=torch.float64)).Q.float()


def cross_polytope_codes(x: Tensor, rot: Tensor) -> Tensor:
    """x [n, H], rot [L, H, d] -> one bucket code per row in [0, (2d)^L): the L cross-polytope hashes
    argmax([Rx, -Rx]) combined as digits base 2d."""
    proj = torch.einsum("nh,lhd->lnd", x.float(), rot)
    codes = torch.cat([proj, -proj], dim=-1).argmax(dim=-1)  # [L, n]
    base = 2 * rot.shape[-1]
    weights = base ** torch.arange(rot.shape[0], device=x.device)
    return (codes * weights.unsqueeze(1)).sum(dim=0)


@dataclass
class Clusters:
    """Centroids of the buckets of routed (token, expert) pairs sorted by expert."""

    centroids: Tensor  # [C, H] sorted by expert
    counts: Tensor  # [E] centroids per expert
    member: Tensor  # [A] each pair's centroid

    @property
    def rate(self) -> float:
        """Compression rate: centroids / pairs."""
        return self.centroids.shape[0] / max(1, self.member.shape[0])

    def expand(self, outputs: Tensor) -> Tensor:
        """The experts' outputs of the centroids [C, H] -> each pair's output [A, H] (its centroid's)."""
        return outputs.index_select(0, self.member)


def cluster(tokens: Tensor, counts: Tensor, rot: Tensor) -> Clusters:
    """Bucket the pairs `tokens` [A, H] (sorted by expert, `counts` [E] per expert) by expert and
    cross-polytope code of the token centred on its expert's mean; centroid = mean of a bucket's tokens."""
    experts = counts.shape[0]
    expert = torch.arange(experts, device=tokens.device).repeat_interleave(counts)
    with torch.no_grad():
        flat = tokens.detach().float()
        means = torch.zeros(experts, flat.shape[1], device=flat.device).index_add(0, expert, flat)
        means = means / counts.clamp(min=1).unsqueeze(1)
        code = cross_polytope_codes(flat - means.index_select(0, expert), rot)
        per_expert = (2 * rot.shape[-1]) ** rot.shape[0]
        keys, member = torch.unique(expert * per_expert + code, return_inverse=True)  # sorted: by expert
        sizes = torch.bincount(member, minlength=keys.shape[0]).clamp(min=1)
    sums = torch.zeros(keys.shape[0], tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
    centroids = sums.index_add(0, member, tokens) / sizes.unsqueeze(1).to(tokens.dtype)
    return Clusters(centroids, torch.bincount(keys // per_expert, minlength=experts), member)


@dataclass
class LshCompressor:
    """`plait.models.moe.Compressor` by cross-polytope LSH; counts the centroids and pairs it has seen."""

    hashes: int = LSH_HASHES
    dims: int = LSH_DIMS
    seed: int = LSH_SEED
    centroids: int = 0
    pairs: int = 0

    @property
    def rate(self) -> float:
        """Compression rate over every call so far (centroids / pairs; 1 before any)."""
        return self.centroids / self.pairs if self.pairs else 1.0

    def compress(self, tokens: Tensor, counts: Tensor) -> Clusters:
        """Pairs sorted by expert [A, H] with `counts` [E] -> their clusters (centroids sorted by expert)."""
        rot = rotations(tokens.shape[1], self.hashes, self.dims, self.seed).to(tokens.device)
        clusters = cluster(tokens, counts, rot)
        self.centroids += clusters.centroids.shape[0]
        self.pairs += clusters.member.shape[0]
        return clusters
