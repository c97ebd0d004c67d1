"""Memory-mapped token files, the nanoGPT/Megatron convention: a flat stream of token ids on disk.

`.bin` is raw little-endian integers (nanoGPT writes uint16); its dtype is given, or read from the name
(`train.uint32.bin`), else uint16. `.npy` carries its own dtype (a 1-D integer array, opened with
`mmap_mode="r"`). Nothing is read into memory beyond the windows a rank asks for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.errors import PlaitError

TOKEN_SUFFIXES = (".bin", ".npy")
"""File name endings read as memory-mapped token ids."""

BIN_DTYPES = ("uint8", "uint16", "int32", "uint32", "int64")
"""Element types a `.bin` token file may hold."""

DEFAULT_BIN_DTYPE = "uint16"
"""nanoGPT's `.bin` element type (GPT-2's 50,257-token vocabulary fits)."""

MAX_CHUNK_TOKENS = 1 << 24
"""Tokens scanned at once when checking the largest id (16 Mi tokens: bounded memory on large files)."""


def is_token_file(path: str | Path) -> bool:
    return Path(path).suffix in TOKEN_SUFFIXES


def bin_dtype(path: str | Path, dtype: str | None = None) -> str:
    """The element type of a `.bin` file: `dtype`, else the name's second suffix (`x.uint32.bin`), else uint16."""
    if dtype is None:
        inner = Path(path).with_suffix("").suffix.lstrip(".")
        dtype = inner if inner in BIN_DTYPES else DEFAULT_BIN_DTYPE
    if dtype not in BIN_DTYPES:
        raise PlaitError(f"--data-dtype {dtype!r} is not a token type; use one of {', '.join(BIN_DTYPES)}")
    return dtype


def open_tokens(path: str | Path, dtype: str | None = None, vocab: int | None = None) -> np.ndarray:
    """The 1-D token ids of a `.bin` or `.npy` file, memory-mapped; with `vocab`, every id is checked to be
    below it (PlaitError naming the largest id)."""
    file = Path(path)
    if not file.is_file():
        raise PlaitError(f"token file {str(path)!r} does not exist; give a .bin or .npy file of token ids")
    if file.stat().st_size == 0:
        raise PlaitError(f"token file {str(path)!r} is empty; give a file of token ids")
    if file.suffix == ".npy":
        if dtype is not None:
            raise PlaitError(f"{str(path)!r} is a .npy file that stores its own type; drop --data-dtype")
        try:
            tokens = np.load(file, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise PlaitError(f"cannot read {str(path)!r} as a .npy array ({exc}); save it with numpy.save") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise PlaitError(f"{str(path)!r} holds a {tokens.dtype} array of shape {tokens.shape}; token files "
                             "hold one row of integer ids")
    else:
        kind = np.dtype(bin_dtype(file, dtype))
        if file.stat().st_size % kind.itemsize:
            raise PlaitError(f"{str(path)!r} has {file.stat().st_size} bytes, not a whole number of {kind} ids; "
                             "give the right --data-dtype")
        tokens = np.memmap(file, dtype=kind, mode="r")
    if len(tokens) == 0:
        raise PlaitError(f"token file {str(path)!r} holds no tokens; give a file of token ids")
    if vocab is not None:
        check_vocab(tokens, vocab, str(path))
    return tokens


def check_vocab(tokens: np.ndarray, vocab: int, what: str) -> None:
    """PlaitError unless every id in `tokens` is in [0, vocab)."""
    top, low = -1, 0
    for start in range(0, len(tokens), MAX_CHUNK_TOKENS):
        chunk = tokens[start: start + MAX_CHUNK_TOKENS]
        top, low = max(top, int(chunk.max())), min(low, int(chunk.min()))
    if low < 0:
        raise PlaitError(f"{what} holds a negative token id ({low}); token ids start at 0")
    if top >= vocab:
        raise PlaitError(f"{what} holds token id {top} but the model's vocabulary has {vocab} entries; use a model "
                         "with a larger vocabulary or the tokenizer it was trained with")
