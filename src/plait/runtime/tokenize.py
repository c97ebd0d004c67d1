"""Text datasets to a token file: Hugging Face `datasets` (a `save_to_disk` directory, or `.jsonl` / `.parquet`
files) tokenized with a local `tokenizers` tokenizer, documents joined by the end-of-text token.

Tokenized once: the stream is cached as `tokens-HASH.DTYPE.bin` (HASH of the data files' paths, sizes and
modification times, the tokenizer file's bytes and the text field), so a run reads it memory-mapped like any
`.bin` token file (`plait.runtime.token_files`). Needs the `data` extra (`pip install plait[data]`).
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

import numpy as np

from plait.errors import PlaitError
from plait.io import write_atomically

DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")
"""File name endings read with `datasets` (a directory is read with `load_from_disk`)."""

EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
"""End-of-document tokens looked up in the tokenizer's vocabulary, first found wins (GPT-2, Llama/T5, Llama-3,
Gemma, BERT)."""

ENCODE_BATCH_DOCUMENTS = 1000
"""Documents tokenized per `encode_batch` call."""

UINT16_VOCAB = 1 << 16
"""Vocabularies up to this size are cached as uint16 ids (nanoGPT's `.bin`), larger ones as uint32."""


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/plait/tokens (default ~/.cache/plait/tokens)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "plait" / "tokens"


def is_dataset(data: str) -> bool:
    """Whether `--data` names a `datasets` source: a directory, or (a glob of) .jsonl/.json/.parquet files."""
    return Path(data).is_dir() or Path(data).suffix in DATASET_SUFFIXES


def dataset_files(data: str) -> list[Path]:
    """The files of a `datasets` source: the directory's, or those the path (or glob pattern) names."""
    path = Path(data)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    files = sorted(Path(p) for p in glob.glob(data)) if glob.has_magic(data) else [path]
    if not files:
        raise PlaitError(f"data {data!r} matches no file; give a dataset directory, .jsonl or .parquet files")
    if missing := [f for f in files if not f.is_file()]:
        raise PlaitError(f"data file {str(missing[0])!r} does not exist; give a dataset directory, .jsonl or "
                         ".parquet files")
    if empty := [f for f in files if f.stat().st_size == 0]:
        raise PlaitError(f"data file {str(empty[0])!r} is empty; give files with documents")
    return files


def tokenizer_file(tokenizer: str | None, data: str) -> Path:
    """The tokenizer.json of `--tokenizer` (a directory holding it, or the file itself)."""
    if tokenizer is None:
        raise PlaitError(f"--data {data!r} is text; give --tokenizer DIR (a directory with tokenizer.json)")
    path = Path(tokenizer)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise PlaitError(f"tokenizer {tokenizer!r} has no tokenizer.json; give a local tokenizer directory "
                         "(Hugging Face tokenizers format)")
    return file


def cache_key(files: list[Path], tokenizer: Path, text_field: str) -> str:
    """A hash of what the token stream depends on (16 hex digits)."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(tokenizer.read_bytes())
    h.update(text_field.encode())
    return h.hexdigest()[:16]


def _load(data: str, files: list[Path], cache: Path):
    try:
        import datasets
    except ImportError:
        raise PlaitError("reading datasets needs the `data` extra; pip install 'plait[data]'") from None
    datasets.disable_progress_bars()
    if Path(data).is_dir():
        try:
            loaded = datasets.load_from_disk(data)
        except FileNotFoundError:
            raise PlaitError(f"{data!r} is not a directory saved with Dataset.save_to_disk; give one, or "
                             ".jsonl/.parquet files") from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise PlaitError(f"dataset {data!r} has splits {sorted(loaded)} but no 'train'; save the split to "
                                 "train on")
            loaded = loaded["train"]
        return loaded
    kind = "parquet" if files[0].suffix == ".parquet" else "json"
    if any((f.suffix == ".parquet") != (kind == "parquet") for f in files):
        raise PlaitError(f"data {data!r} mixes parquet and json files; give one kind")
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train",
                                     cache_dir=str(cache / "hf"))
    except Exception as exc:  # datasets raises many kinds on malformed files
        raise PlaitError(f"cannot read {data!r} as {kind}: {str(exc).splitlines()[0] if str(exc) else exc}") from None


def eos_id(tok) -> int:
    for name in EOS_TOKENS:
        if (i := tok.token_to_id(name)) is not None:
            return i
    raise PlaitError(f"the tokenizer has no end-of-text token (one of {', '.join(EOS_TOKENS)}); use a tokenizer "
                     "that has one")


def tokenize_dataset(data: str, tokenizer: str | None, text_field: str = "text",
                     cache_dir: str | Path | None = None) -> Path:
    """The cached token file of a `datasets` source (tokenized now if not cached yet); PlaitError on bad input."""
    files = dataset_files(data)
    tok_file = tokenizer_file(tokenizer, data)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PlaitError("tokenizing needs the `data` extra; pip install 'plait[data]'") from None
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as exc:
        raise PlaitError(f"cannot load tokenizer {str(tok_file)!r} ({exc}); give a tokenizers tokenizer.json") from None
    dtype = "uint16" if tok.get_vocab_size() <= UINT16_VOCAB else "uint32"
    out = cache / f"tokens-{cache_key(files, tok_file, text_field)}.{dtype}.bin"
    if out.is_file():
        return out
    table = _load(data, files, cache)
    if len(table) == 0:
        raise PlaitError(f"dataset {data!r} holds no documents; give a dataset with text")
    if text_field not in table.column_names:
        raise PlaitError(f"dataset {data!r} has no text field {text_field!r} (fields: "
                         f"{', '.join(table.column_names)}); give --text-field")
    eos = eos_id(tok)
    pieces: list[np.ndarray] = []
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("tokenizing", total=len(table))
        for start in range(0, len(table), ENCODE_BATCH_DOCUMENTS):
            texts = table[start: start + ENCODE_BATCH_DOCUMENTS][text_field]
            for enc in tok.encode_batch([t or "" for t in texts]):
                pieces.append(np.asarray(enc.ids + [eos], dtype=dtype))
            bar.update(task, advance=len(texts))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    if len(tokens) == len(pieces):
        raise PlaitError(f"dataset {data!r} holds no text in field {text_field!r}; give a dataset with text")
    write_atomically(out, tokens.tobytes())
    return out
