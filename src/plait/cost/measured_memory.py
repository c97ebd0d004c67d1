"""Memory terms measured on GPUs (Galvatron's memory profiles), which the cost model prefers to its formulas.

Bytes. `plait.galvatron` reads a Galvatron 2.4.0 `memory_profiling_*.json` into a `MeasuredMemory`; the
calibration carries it (`Calibration.memory`) and three terms use it: a block's saved activations
(`cost/layer.block_activation_bytes`), the embedding's and head's transient activations (`cost/price.price_edge`)
and the bytes of model state per parameter (`cost/price.price`). Activations are stored per token at 16-bit
(the precision Galvatron measured, bf16) and scaled to the run's activation bytes; with flash attention a
block keeps the same bytes per token at any sequence length, so one profiled length serves every run (as
Galvatron's own "sequence" memory mode scales its profile linearly in the length).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MEASURED_ACTIVATION_BYTES = 2
"""Bytes per activation element of Galvatron's memory profiles (bf16 or fp16 runs)."""


@dataclass(frozen=True)
class EdgeMemory:
    """Galvatron's "other" memory of the embedding and head at one pipeline position: `whole` (one stage
    holds both), `first` (the embedding's stage), `last` (the head's stage)."""

    states_bytes: float
    """Model-state bytes of the edge layers, unsharded, vocabulary not split (tp 1)."""
    activation_bytes_per_token: Mapping[int, float]
    """Vocabulary-parallel degree -> peak transient bytes per token beside the blocks' saved activations
    (embedding output, logits and their gradient, loss), 16-bit run."""

    def __hash__(self) -> int:  # by value, as equality is (the calibration that carries it is a cache key)
        return hash((self.states_bytes, tuple(sorted(self.activation_bytes_per_token.items()))))

    def activation(self, tp: int) -> float:
        """Bytes per token at vocabulary-parallel degree `tp`: the measured degree, else tp 1's divided by tp."""
        if tp in self.activation_bytes_per_token:
            return self.activation_bytes_per_token[tp]
        return self.activation_bytes_per_token.get(1, 0.0) / tp


@dataclass(frozen=True)
class MeasuredMemory:
    """Measured memory of one model's blocks (by layer kind) and its edges."""

    states_bytes_per_param: Mapping[str, float]
    """Layer kind -> model-state bytes per parameter (weights, gradients, optimizer state), unsharded:
    Galvatron's 4 x parameter_size over plait's parameter count (fp32 parameters, fp32 gradients and Adam's
    two moments: 16 bytes)."""
    activation_bytes_per_token: Mapping[tuple[str, int, str], float]
    """(layer kind, tp degree, recompute "none" or "full") -> bytes one block keeps per token on one device
    of its tensor-parallel group (16-bit run, no sequence parallelism)."""
    edges: Mapping[str, EdgeMemory]
    """"whole", "first", "last" -> the edges' memory at that pipeline position (absent: not profiled)."""

    def __hash__(self) -> int:  # by value, as equality is (the calibration that carries it is a cache key)
        return hash((tuple(sorted(self.states_bytes_per_param.items())),
                     tuple(sorted(self.activation_bytes_per_token.items())), tuple(sorted(self.edges.items()))))

    def block_activation(self, kind: str, tp: int, recompute: str, activation_bytes: int) -> float | None:
        """Bytes per token one block of `kind` keeps at `tp` and `recompute` in a run of `activation_bytes`
        per element, or None where the profile has no such point (selective recompute, another tp degree)."""
        measured = self.activation_bytes_per_token.get((kind, tp, recompute))
        return None if measured is None else measured * activation_bytes / MEASURED_ACTIVATION_BYTES

    def edge_activation(self, edge: str, pipelined: bool, tp: int, activation_bytes: int) -> float | None:
        """Bytes per token of the embedding's (`edge` "embedding") or the head's transients, or None if not
        profiled. The embedding takes the first stage's measurement; the head the last stage's on a stage of
        its own (`pipelined`), else the whole edges' (a stage's transients are the largest of its parts', so
        the head then stands for both edges, as Galvatron's pp-off "other" memory does)."""
        part = self.edges.get("first" if edge == "embedding" else "last" if pipelined else "whole")
        return part.activation(tp) * activation_bytes / MEASURED_ACTIVATION_BYTES if part is not None else None
