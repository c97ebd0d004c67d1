"""Deterministic training data: the same global batch at every step, whatever the plan.

Two sources: a synthetic token stream (seeded per step) and a real text file read as bytes (a byte-level
tokenizer: token = byte value, so the vocabulary needs at least 256 entries). A global batch is
`[global_batch, seq_len + 1]` tokens; inputs are the first seq_len columns, targets the last seq_len.
Plans take their share with `shard`: pipelines, then micro-batches, then data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from plait.errors import PlaitError

BYTE_VOCAB = 256


@dataclass(frozen=True)
class Batch:
    """Token ids [sequences, seq_len] and the next-token targets of the same shape."""

    inputs: torch.Tensor
    targets: torch.Tensor


class TokenSource:
    """Global batches of `global_batch` sequences of `seq_len` tokens for any step."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int, path: str | None = None) -> None:
        self.vocab, self.seq_len, self.global_batch, self.seed = vocab, seq_len, global_batch, seed
        self.tokens: torch.Tensor | None = None
        if path is not None:
            file = Path(path)
            if not file.is_file():
                raise PlaitError(f"data file {path!r} does not exist; give a text file or omit --data for "
                                 "synthetic tokens")
            if vocab < BYTE_VOCAB:
                raise PlaitError(f"the byte-level tokenizer needs a vocabulary of at least {BYTE_VOCAB}; the "
                                 f"model has {vocab}")
            raw = file.read_bytes()
            if len(raw) < seq_len + 2:
                raise PlaitError(f"data file {path!r} has {len(raw)} bytes; it needs more than seq_len + 1 = "
                                 f"{seq_len + 1}")
            self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long)

    def batch(self, step: int) -> Batch:
        """The global batch of optimizer step `step` (0-based)."""
        n, s = self.global_batch, self.seq_len
        if self.tokens is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            rows = torch.randint(0, self.vocab, (n, s + 1), generator=gen)
        else:
            span = len(self.tokens) - (s + 1)
            starts = (torch.arange(n) + step * n) * s % max(span, 1)
            rows = torch.stack([self.tokens[i: i + s + 1] for i in starts.tolist()])
        return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def shard(batch: Batch, start: int, count: int) -> Batch:
    """Sequences [start, start + count) of a batch."""
    return Batch(batch.inputs[start: start + count], batch.targets[start: start + count])
