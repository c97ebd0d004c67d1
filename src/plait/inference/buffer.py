"""A tensor that grows along one dimension without copying everything it holds on every append."""

from __future__ import annotations

import torch
from torch import Tensor

SPARE = 8
"""Growth: a full buffer is enlarged to hold what it holds plus 1/SPARE more (at least MIN_SPARE rows), so
appending one row at a time copies each row about SPARE times in all while at most 1/SPARE of the memory
held is spare (a doubling buffer would hold up to twice what it uses)."""
MIN_SPARE = 64


class Growing:
    """Rows appended along `dim` into spare capacity: appending n rows copies n rows (and, when full, the
    filled part once into a buffer 1/SPARE larger), not the whole tensor on every append as `torch.cat` does.
    The first rows are held exactly (no spare until something is appended). `view` is the filled part;
    `held_bytes` what the buffer holds, spare included."""

    def __init__(self, first: Tensor, dim: int) -> None:
        self.dim, self.length = dim, first.shape[dim]
        self.data = self._empty(list(first.shape), first)
        self.data.copy_(first)

    def append(self, rows: Tensor) -> None:
        n = rows.shape[self.dim]
        if self.length + n > self.data.shape[self.dim]:
            shape = list(self.data.shape)
            need = self.length + n
            shape[self.dim] = need + max(need // SPARE, MIN_SPARE)
            bigger = self._empty(shape, self.data)
            bigger.narrow(self.dim, 0, self.length).copy_(self.view)
            self.data = bigger
        self.data.narrow(self.dim, self.length, n).copy_(rows)
        self.length += n

    @staticmethod
    def _empty(shape: list[int], like: Tensor) -> Tensor:
        """Room for `shape`; in page-locked memory when it is CPU memory feeding a GPU (asynchronous copies)."""
        pin = like.device.type == "cpu" and torch.cuda.is_available()
        return torch.empty(shape, dtype=like.dtype, device=like.device, pin_memory=pin)

    @property
    def view(self) -> Tensor:
        return self.data.narrow(self.dim, 0, self.length)

    @property
    def held_bytes(self) -> int:
        """Bytes of the whole buffer, spare capacity included: what memory it really takes."""
        return self.data.numel() * self.data.element_size()

    def take(self, index: Tensor) -> Tensor:
        """Rows `index` [B, H, n] along dim 2 of a [B, H, T, D] buffer -> [B, H, n, D] (one index_select)."""
        b, h, cap, d = self.data.shape
        flat = (torch.arange(b * h, device=index.device).view(b, h, 1) * cap + index).reshape(-1)
        return self.data.view(b * h * cap, d).index_select(0, flat).view(b, h, -1, d)
