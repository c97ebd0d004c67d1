"""Ulysses sequence (context) parallelism: all-to-alls that trade a sequence split for a head split.

Outside attention each of the cp ranks holds a contiguous 1/cp of every sequence with all heads; for the
attention core it needs the whole sequence for 1/cp of the heads. Both directions are one all-to-all
over the cp group, differentiable (the backward is the opposite all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None) -> torch.Tensor:
    """Differentiable all-to-all of x's rows over `group` (the backward is the opposite exchange): equal
    parts, or `input_splits` rows to each rank and `output_splits` rows from each."""
    out = all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)
    return out.wait() if hasattr(out, "wait") else out


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, T/cp, H, D] (sequence chunk of this rank) -> [B, T, H/cp, D] (this rank's head group)."""
    cp = dist.get_world_size(group)
    b, t, h, d = x.shape
    chunks = x.reshape(b, t, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp (head group), B, t, H/cp, D]
    got = all_to_all(chunks, group)  # [cp (sequence chunk), B, t, H/cp, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * t, h // cp, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, T, H/cp, D] -> [B, T/cp, H, D]: the inverse of `seq_to_heads`."""
    cp = dist.get_world_size(group)
    b, t_full, h, d = x.shape
    t = t_full // cp
    chunks = x.reshape(b, cp, t, h, d).permute(1, 0, 2, 3, 4)  # [cp (sequence chunk), B, t, H/cp, D]
    got = all_to_all(chunks, group)  # [cp (head group), B, t, H/cp, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, t, cp * h, d)


@dataclass(frozen=True)
class Ulysses:
    """The attention core's context-parallel swap over `group` (set as `Attention.context_parallel`)."""

    group: dist.ProcessGroup
    splits_heads = True
    attend = None  # the attention core itself runs on whole sequences

    @property
    def degree(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's place in the group: its head group's index."""
        return dist.get_rank(self.group)

    def rope(self, freqs: torch.Tensor) -> torch.Tensor:
        return freqs  # whole sequences: positions from 0

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        return seq_to_heads(x, self.group)

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return heads_to_seq(x, self.group)
