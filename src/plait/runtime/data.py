"""Deterministic training data: the same global batch at every step, whatever the plan.

Three sources: a synthetic token stream (seeded per step), a text file read as bytes (a byte-level
tokenizer: token = byte value, so the vocabulary needs at least 256 entries), and a token file (`.bin` /
`.npy`, memory-mapped: `plait.runtime.token_files`; text datasets are tokenized into one,
`plait.runtime.tokenize`). A global batch is `[global_batch, seq_len + 1]` tokens; inputs are the first
seq_len columns, targets the last seq_len. Plans take their share with `rows`: pipelines, then
micro-batches, then data-parallel ranks, and a rank reads only the rows it trains on.

Sample order is a pure function of (seed, step, row): sample g = step * global_batch + row. A token file
is cut into windows of seq_len + 1 tokens (window j starts at token j * seq_len); epoch e = g // windows
visits them in the order of a permutation seeded by (seed, e). Resuming at step k reads exactly the
samples the uninterrupted run reads at step k.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plait.errors import PlaitError
from plait.runtime.token_files import is_token_file, open_tokens

BYTE_VOCAB = 256

SAMPLES_LOG_ENV = "PLAIT_SAMPLES_LOG"
"""Environment variable naming a directory where every rank appends the sample ids it reads each step
(`rank-R.jsonl`, one {"step", "samples"} line per step): a debugging and test aid."""


@dataclass(frozen=True)
class Batch:
    """Token ids [sequences, seq_len] and the next-token targets of the same shape."""

    inputs: torch.Tensor
    targets: torch.Tensor


class TokenSource:
    """Global batches of `global_batch` sequences of `seq_len` tokens for any step, or any rows of one."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int, path: str | None = None,
                 dtype: str | None = None) -> None:
        self.vocab, self.seq_len, self.global_batch, self.seed = vocab, seq_len, global_batch, seed
        self.tokens: torch.Tensor | None = None  # a text file's bytes
        self.stream: np.ndarray | None = None  # a token file's ids
        self._synthetic: tuple[int, torch.Tensor] | None = None  # (step, its rows)
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its window order)
        if path is not None and is_token_file(path):
            self.stream = open_tokens(path, dtype, vocab)
            if len(self.stream) < seq_len + 1:
                raise PlaitError(f"token file {path!r} has {len(self.stream)} tokens; it needs at least seq_len + 1 "
                                 f"= {seq_len + 1}")
        elif path is not None:
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

    @property
    def length(self) -> int:
        """Tokens in the file (0 for synthetic tokens)."""
        return len(self.stream) if self.stream is not None else len(self.tokens) if self.tokens is not None else 0

    def span(self, start: int, count: int) -> torch.Tensor:
        """Tokens [start, start + count) of the file, as int64."""
        if self.stream is not None:
            return torch.from_numpy(np.asarray(self.stream[start: start + count], dtype=np.int64))
        assert self.tokens is not None
        return self.tokens[start: start + count]

    def batch(self, step: int) -> Batch:
        """The global batch of optimizer step `step` (0-based)."""
        return self.rows(step, 0, self.global_batch)

    def sample_ids(self, step: int, start: int, count: int) -> list[int]:
        """The samples rows [start, start + count) of step `step` read: a token file's window numbers, else
        the global sample numbers."""
        first = step * self.global_batch + start
        if self.stream is None:
            return list(range(first, first + count))
        windows = (len(self.stream) - 1) // self.seq_len
        out = []
        for g in range(first, first + count):
            epoch = g // windows
            if self._order is None or self._order[0] != epoch:
                self._order = (epoch, window_order(self.seed, epoch, windows))
            out.append(int(self._order[1][g % windows]))
        return out

    def rows(self, step: int, start: int, count: int) -> Batch:
        """Rows [start, start + count) of step `step`'s global batch."""
        n, s = self.global_batch, self.seq_len
        if self.stream is not None:
            rows = torch.stack([self.span(j * s, s + 1) for j in self.sample_ids(step, start, count)])
        elif self.tokens is not None:
            span = len(self.tokens) - (s + 1)
            starts = (torch.arange(start, start + count) + step * n) * s % max(span, 1)
            rows = torch.stack([self.tokens[i: i + s + 1] for i in starts.tolist()])
        else:
            if self._synthetic is None or self._synthetic[0] != step:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
                self._synthetic = (step, torch.randint(0, self.vocab, (n, s + 1), generator=gen))
            rows = self._synthetic[1][start: start + count]
        return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def window_order(seed: int, epoch: int, windows: int) -> np.ndarray:
    """The order epoch `epoch` visits a token file's windows in (uint32 ids: half the memory of int64)."""
    ids = np.arange(windows, dtype=np.uint32 if windows < 1 << 32 else np.int64)
    return np.random.default_rng((seed, epoch)).permutation(ids)


def shard(batch: Batch, start: int, count: int) -> Batch:
    """Sequences [start, start + count) of a batch."""
    return Batch(batch.inputs[start: start + count], batch.targets[start: start + count])


def log_samples(directory: str, rank: int, step: int, samples: list[int]) -> None:
    """Append the samples rank `rank` read at `step` to DIRECTORY/rank-RANK.jsonl (see SAMPLES_LOG_ENV)."""
    path = Path(directory) / f"rank-{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps({"step": step, "samples": samples}) + "\n")


def prepare_data(data: str | None, vocab: int, tokenizer: str | None = None, text_field: str = "text",
                 dtype: str | None = None, cache_dir: str | None = None) -> tuple[str | None, str | None]:
    """Before a run: what `--data` names, checked, as (the file the ranks read, its .bin element type).
    A `datasets` source is tokenized (once, cached) into a token file; token ids must be below `vocab`."""
    from plait.runtime.tokenize import is_dataset, tokenize_dataset

    if data is None:
        if tokenizer is not None or dtype is not None:
            raise PlaitError("--tokenizer and --data-dtype describe --data; give --data or drop them")
        return None, None
    if is_dataset(data) or "*" in data:
        if dtype is not None:
            raise PlaitError("--data-dtype describes .bin token files; drop it for a text dataset")
        path = str(tokenize_dataset(data, tokenizer, text_field, cache_dir))
        open_tokens(path, None, vocab)
        return path, None
    if tokenizer is not None:
        raise PlaitError(f"--tokenizer reads datasets (.jsonl, .parquet, a save_to_disk directory), not {data!r}; "
                         "drop it (token files hold ids, text files are read as bytes)")
    if is_token_file(data):
        open_tokens(data, dtype, vocab)
        return data, dtype
    if dtype is not None:
        raise PlaitError(f"--data-dtype describes .bin token files, not {data!r}; drop it")
    if not Path(data).is_file():
        raise PlaitError(f"data file {data!r} does not exist; give a text file, token file or dataset, or omit "
                         "--data")
    return data, None
