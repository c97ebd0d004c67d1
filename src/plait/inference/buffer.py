"""A tensor that grows along one dimension without copying everything it holds on every append."""

from __future__ import annotations

import torch
from torch import Tensor


class Growing:
    """Rows appended along `dim` into spare capacity (doubled when full): appending n rows copies n rows,
    not the whole tensor as `torch.cat` does. `view` is the filled part."""

    def __init__(self, first: Tensor, dim: int) -> None:
        self.dim, self.length = dim, first.shape[dim]
        shape = list(first.shape)
        shape[dim] = max(2 * self.length, 16)
        self.data = self._empty(shape, first)
        self.data.narrow(dim, 0, self.length).copy_(first)

    def append(self, rows: Tensor) -> None:
        n = rows.shape[self.dim]
        if self.length + n > self.data.shape[self.dim]:
            shape = list(self.data.shape)
            shape[self.dim] = 2 * (self.length + n)
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

    def take(self, index: Tensor) -> Tensor:
        """Rows `index` [B, H, n] along dim 2 of a [B, H, T, D] buffer -> [B, H, n, D] (one index_select)."""
        b, h, cap, d = self.data.shape
        flat = (torch.arange(b * h, device=index.device).view(b, h, 1) * cap + index).reshape(-1)
        return self.data.view(b * h * cap, d).index_select(0, flat).view(b, h, -1, d)
