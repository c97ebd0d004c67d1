"""Packed variable-length batches: several documents in one row, kept apart by a document mask.

A document of s + 1 tokens gives s inputs and their s next-token targets. Packing concatenates the
documents of one group into a row of T tokens (padded to a multiple of the group's ranks, and of twice
that for ring attention's zigzag split); every token carries its document's number (padding: one more
document of its own, with no targets) and its position inside the document (RoPE restarts at 0 per
document). Attention is causal within a document and blind across documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.models.llama import causal_mask

IGNORE = -100
"""Target of a token without one (padding): cross-entropy skips it."""


@dataclass(frozen=True)
class Packed:
    """One row of packed documents, all [T]: token ids, next-token targets (IGNORE for padding), the
    document number of every token and its position inside that document."""

    tokens: Tensor
    targets: Tensor
    documents: Tensor
    positions: Tensor

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    def take(self, index: Tensor) -> Packed:
        """The tokens at `index` (global places in the row), in that order."""
        return Packed(self.tokens[index], self.targets[index], self.documents[index], self.positions[index])


def pack(documents: list[Tensor], multiple: int = 1) -> Packed:
    """Documents (each [s + 1] token ids, s >= 1) packed into one row padded to a multiple of `multiple`."""
    inputs = [d[:-1] for d in documents]
    targets = [d[1:] for d in documents]
    count = sum(len(x) for x in inputs)
    pad = -count % multiple
    number = [torch.full((len(x),), i, dtype=torch.long) for i, x in enumerate(inputs)]
    places = [torch.arange(len(x)) for x in inputs]
    if pad:
        inputs.append(torch.zeros(pad, dtype=torch.long))
        targets.append(torch.full((pad,), IGNORE, dtype=torch.long))
        number.append(torch.full((pad,), len(documents), dtype=torch.long))
        places.append(torch.arange(pad))
    return Packed(torch.cat(inputs), torch.cat(targets), torch.cat(number), torch.cat(places))


def document_mask(q_docs: Tensor, q_index: Tensor, k_docs: Tensor, k_index: Tensor, window: int = 0
                  ) -> Tensor:
    """Which keys each query may attend to: same document, not later in the row and, with a sliding
    `window` (tokens; 0: none), within it (`plait.models.llama.causal_mask`). Bool [Tq, Tk] from the
    document numbers and row places of the queries ([Tq]) and keys ([Tk])."""
    return (q_docs[:, None] == k_docs[None, :]) & causal_mask(q_index, k_index, window)


def zigzag(length: int, ranks: int) -> list[Tensor]:
    """Ring attention's split of a row of `length` tokens (a multiple of 2 x ranks) into `ranks` parts: the
    row cut into 2 x ranks pieces, rank r taking pieces r and 2 x ranks - 1 - r, so causal work is even."""
    piece = length // (2 * ranks)
    return [torch.cat([torch.arange(r * piece, (r + 1) * piece),
                       torch.arange((2 * ranks - 1 - r) * piece, (2 * ranks - r) * piece)]) for r in range(ranks)]


def contiguous(length: int, ranks: int) -> list[Tensor]:
    """Ulysses' split: rank r holds the r-th contiguous 1/ranks of the row."""
    part = length // ranks
    return [torch.arange(r * part, (r + 1) * part) for r in range(ranks)]
