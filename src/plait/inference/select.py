"""One layer's KV cache under a selection method: exact attention at prefill, then at every decode step
attention over the tokens the method selects (`PQCacheConfig`).

The full keys and values [B, kv_heads, T, D] live in `store_device` memory (the CPU by default: the point of
selective attention is that the accelerator holds only what a step reads); a decode step gathers the
selected rows and moves them to the query's device. Keys are cached after RoPE, as Hugging Face caches them.
Grouped-query attention: a kv head is selected for by the summed attention probabilities of the query heads
that read it, so all of them see the same tokens.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

from plait.inference.buffer import Growing
from plait.inference.config import PQCacheConfig
from plait.inference.pq import Codebook, fit

QUERY_CHUNK = 256
"""Prefill queries per block when attention probabilities are needed (bounds memory at Q x T per head)."""


def grouped(q: Tensor, kv_heads: int) -> Tensor:
    """[B, H, Q, D] -> [B, kv_heads, H / kv_heads, Q, D] (query head j reads kv head j // rep, as HF)."""
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, n, d)


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float, probabilities: bool = False) -> tuple[Tensor, Tensor | None]:
    """Exact attention of decode queries q [B, H, 1, D] over k, v [B, kv, n, D] (all allowed): output
    [B, H, 1, D] and, if asked, the probabilities summed over each kv head's query heads [B, kv, n]."""
    if not probabilities:
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scale, enable_gqa=True), None
    kv = k.shape[1]
    g = grouped(q, kv).float()  # [B, kv, rep, 1, D]
    p = torch.softmax((g @ k.float()[:, :, None].transpose(-1, -2)) * scale, dim=-1)  # [B, kv, rep, 1, n]
    out = p @ v.float()[:, :, None]  # [B, kv, rep, 1, D]
    return out.reshape(q.shape).to(q.dtype), p.sum(dim=(2, 3))


class LayerCache:
    """Keys, values and selection state of one attention layer."""

    def __init__(self, cfg: PQCacheConfig, store_device: str | torch.device = "cpu") -> None:
        self.cfg, self.store_device = cfg, torch.device(store_device)
        self._keys: Growing | None = None
        self._values: Growing | None = None
        self.budget = 0
        self.codebook: Codebook | None = None
        self.kept: Tensor | None = None  # h2o / snapkv: token indices kept [B, kv, n]
        self.score: Tensor | None = None  # h2o: accumulated attention of the kept tokens [B, kv, n]
        self.recall: list[float] = []  # pqcache with measure_recall: top-k recall per decode step
        self.last: Tensor | None = None  # the token indices the last decode step read [B, kv, n]

    @property
    def keys(self) -> Tensor | None:
        """Every cached key [B, kv, T, D] (after RoPE)."""
        return None if self._keys is None else self._keys.view

    @property
    def values(self) -> Tensor | None:
        return None if self._values is None else self._values.view

    @property
    def length(self) -> int:
        return 0 if self._keys is None else self._keys.length

    # ---- prefill ---------------------------------------------------------------------------------------

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Exact causal attention of a prompt (q [B, H, T, D], k/v [B, kv, T, D]); stores the KV and builds
        the method's state. Returns [B, H, T, D]."""
        first = self.keys is None
        self._append(k, v)
        rep = q.shape[1] // k.shape[1]
        kk, vv = self._device(self.keys, q), self._device(self.values, q)
        past = self.length - q.shape[2]
        out = F.scaled_dot_product_attention(q, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1),
                                             attn_mask=_causal(q.shape[2], self.length, past, q.device),
                                             scale=scale)
        method = self.cfg.method
        if first:
            self.budget = self.cfg.tokens(self.length)
            if method == "pqcache":
                b, kv, t, d = k.shape
                self.codebook = fit(k.reshape(b * kv, t, d), self.cfg.subspaces, self.cfg.bits, self.cfg.iterations)
            elif method == "h2o":
                self._h2o_start(q, kk, scale)
            elif method == "snapkv":
                self._snapkv_start(q, kk, scale)
        else:
            self._extend(q.shape[2])
        return out

    def _h2o_start(self, q: Tensor, k: Tensor, scale: float) -> None:
        """Heavy hitters of the prompt: every token's attention summed over all prompt queries; keep the
        recent window (`h2o_recent`: half the budget) and the heaviest of the rest, up to the budget."""
        acc = self._received(q, k, scale, 0)
        self.kept, self.score = self._keep_top(acc, self.budget, recent=self.cfg.h2o_recent(self.budget))

    def _snapkv_start(self, q: Tensor, k: Tensor, scale: float) -> None:
        """SnapKV: attention of the last `observation` prompt queries, max-pooled over neighbours; keep the
        observation window and the top of the rest."""
        t = k.shape[2]
        window = min(self.cfg.observation, t)
        acc = self._received(q, k, scale, t - window)
        pooled = F.max_pool1d(acc.flatten(0, 1)[:, None], self.cfg.pool, stride=1, padding=self.cfg.pool // 2)
        acc = pooled[:, 0, :t].reshape(acc.shape)
        self.kept, _ = self._keep_top(acc, self.budget, recent=window)

    def _received(self, q: Tensor, k: Tensor, scale: float, start: int) -> Tensor:
        """Attention probability each key receives, summed over queries start.. of the prompt and over each
        kv head's query heads: [B, kv, T] (queries in blocks of QUERY_CHUNK)."""
        b, kv, t, _ = k.shape
        acc = torch.zeros(b, kv, t)
        for s in range(start, q.shape[2], QUERY_CHUNK):
            g = grouped(q[:, :, s: s + QUERY_CHUNK], kv).float()  # [B, kv, rep, c, D]
            logits = (g @ k.float()[:, :, None].transpose(-1, -2)) * scale  # [B, kv, rep, c, T]
            rows = torch.arange(s, s + g.shape[3])
            logits = logits.masked_fill(torch.arange(t)[None, :] > rows[:, None], float("-inf"))
            acc += torch.softmax(logits, -1).sum(dim=(2, 3)).cpu()
        return acc

    def _keep_top(self, acc: Tensor, budget: int, recent: int | None = None) -> tuple[Tensor, Tensor]:
        """Indices [B, kv, n] (sorted) of the sinks, the last `recent` tokens and the highest `acc` of the rest,
        n = min(budget, T); and their `acc`."""
        t = acc.shape[-1]
        recent = self.cfg.recent if recent is None else recent
        pinned = self._pinned(t, recent)
        if budget >= t:
            index = torch.arange(t).expand(*acc.shape[:2], t)
        else:
            rank = acc.masked_fill(pinned, float("inf"))
            index = rank.topk(budget, dim=-1).indices.sort(-1).values
        return index.contiguous(), torch.gather(acc, 2, index)

    def _pinned(self, t: int, recent: int) -> Tensor:
        """Tokens always attended to: the first `sinks` and the last `recent` of t. Bool [t]."""
        pos = torch.arange(t)
        return (pos < self.cfg.sinks) | (pos >= t - recent)

    # ---- decode ----------------------------------------------------------------------------------------

    def decode(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """One new token (q [B, H, 1, D], k/v [B, kv, 1, D]): attention over the selected past and itself."""
        self._append(k, v)
        method = self.cfg.method
        if method == "full" or self.length <= self.budget:
            index = torch.arange(self.length).expand(k.shape[0], k.shape[1], -1)
            if method in ("h2o", "snapkv"):
                self._extend(1)
                index = self.kept
        elif method == "window":
            index = torch.nonzero(self._pinned(self.length, self.budget - self.cfg.sinks))[:, 0]
            index = index.expand(k.shape[0], k.shape[1], -1)
        elif method == "pqcache":
            index = self._pq_select(q, scale)
        else:  # h2o, snapkv: the kept tokens and the new one
            self._extend(1)
            index = self.kept
        self.last = index
        keys, values = self._keys.take(index), self._values.take(index)  # the rows this step reads
        out, probs = attend(q, self._device(keys, q), self._device(values, q), scale, probabilities=method == "h2o")
        if method == "h2o" and self.length > 0:
            self.score += probs.cpu()
            if self.kept.shape[-1] > self.budget:
                self._evict()
        return out

    def _pq_select(self, q: Tensor, scale: float) -> Tensor:
        """PQCache: sinks, recent window and the middle tokens of highest approximate attention. Keys are
        coded when they leave the recent window (in batches), not as they arrive."""
        b, h, _, d = q.shape
        kv = self.keys.shape[1]
        t, sinks, recent = self.length, self.cfg.sinks, self.cfg.recent
        end = t - recent  # the middle is [sinks, end)
        coded = self.codebook.length
        if coded < end:
            fresh = self.keys[:, :, coded:]  # everything not coded yet, so batches stay large
            self.codebook.append(fresh.reshape(b * kv, -1, d))
        g = grouped(q, kv).reshape(b * kv, h // kv, d).cpu()
        approx = self.codebook.scores(g, sinks, end) * scale  # [B*kv, rep, end - sinks]
        probs = torch.softmax(approx, -1).sum(1).reshape(b, kv, -1)
        k = self.budget - sinks - recent
        chosen = probs.topk(k, dim=-1).indices + sinks
        if self.cfg.measure_recall:
            middle = self.keys[:, :, sinks:end].float().cpu()
            exact = torch.softmax((g @ middle.reshape(b * kv, -1, d).transpose(-1, -2)) * scale, -1)
            truth = exact.sum(1).reshape(b, kv, -1).topk(k, -1).indices + sinks
            hits = (chosen[..., :, None] == truth[..., None, :]).any(-1).float().mean()
            self.recall.append(float(hits))
        pinned = torch.cat([torch.arange(sinks), torch.arange(end, t)]).expand(b, kv, -1)
        return torch.cat([pinned, chosen], dim=-1)  # attention does not care about order

    def _evict(self) -> None:
        """H2O: drop the kept token with the least accumulated attention outside the recent window (decoded
        tokens compete like prompt tokens once they leave it)."""
        t = self.length
        recent = self.kept >= t - self.cfg.h2o_recent(self.budget)
        sinks = self.kept < self.cfg.sinks
        drop = self.score.masked_fill(recent | sinks, float("inf")).argmin(-1, keepdim=True)
        keep = torch.ones_like(self.kept, dtype=torch.bool).scatter_(2, drop, False)
        b, kv, n = self.kept.shape
        self.kept = self.kept[keep].reshape(b, kv, n - 1)
        self.score = self.score[keep].reshape(b, kv, n - 1)

    # ---- storage -------------------------------------------------------------------------------------

    def _append(self, k: Tensor, v: Tensor) -> None:
        k, v = k.detach().to(self.store_device), v.detach().to(self.store_device)
        if self._keys is None:
            self._keys, self._values = Growing(k, dim=2), Growing(v, dim=2)
        else:
            self._keys.append(k)
            self._values.append(v)

    def _extend(self, new: int) -> None:
        """Tokens added after the prompt are kept (h2o: with zero score so far); pqcache codes them later."""
        if self.kept is None:
            return
        b, kv, _ = self.kept.shape
        added = torch.arange(self.length - new, self.length).expand(b, kv, -1)
        self.kept = torch.cat([self.kept, added], dim=-1)
        if self.score is not None:
            self.score = torch.cat([self.score, torch.zeros(b, kv, new)], dim=-1)

    @staticmethod
    def _device(x: Tensor, like: Tensor) -> Tensor:
        return x.to(like.device, non_blocking=True)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of this layer's cache, as held (buffers' spare capacity included): `full_kv`, the full KV in
        the store; `resident`, what a decode step holds near the accelerator: the rows it reads (for pqcache
        the sinks, the recent window and the middle rows fetched from the store every step; the kept rows
        for h2o and snapkv; the window; everything for full) and the method's state (PQ codes and
        centroids; h2o's kept indices and scores, snapkv's kept indices); `fetched_per_token`, the rows a
        decode step copies from the store (pqcache's chosen middle rows)."""
        if self.keys is None:
            return {"full_kv": 0, "resident": 0, "fetched_per_token": 0}
        b, kv, t, d = self.keys.shape
        row = 2 * b * kv * d * self.keys.element_size()  # one token's key and value, every kv head
        store = self._keys.held_bytes + self._values.held_bytes
        method, fetched = self.cfg.method, 0
        if method == "pqcache" and self.codebook is not None:
            read = min(t, self.budget)
            fetched = max(0, read - self.cfg.sinks - self.cfg.recent) * row if t > self.budget else 0
            near = self.codebook.held_bytes + read * row
        elif self.kept is not None:
            near = self.kept.shape[-1] * row + self.kept.numel() * self.kept.element_size()
            if self.score is not None:
                near += self.score.numel() * self.score.element_size()
        elif method == "window":
            near = min(t, self.budget) * row
        else:
            near = store
        return {"full_kv": store, "resident": near, "fetched_per_token": fetched}


def _causal(q_len: int, k_len: int, past: int, device: torch.device) -> Tensor:
    """Bool [q_len, k_len]: query i (at position past + i) sees keys 0..past + i."""
    return torch.arange(k_len, device=device)[None, :] <= (past + torch.arange(q_len, device=device))[:, None]
