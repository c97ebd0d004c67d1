"""Training data sources: memory-mapped token files (.bin/.npy), text datasets tokenized with a local tokenizer,
the sample order (a pure function of seed, step and row), and resuming at the exact sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from plait.cli import app
from plait.errors import PlaitError
from plait.runtime.data import TokenSource, prepare_data
from plait.runtime.token_files import open_tokens

pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

SEQ = 8
WORDS = ["plait", "weaves", "data", "tensor", "pipeline", "parallel", "layers", "into", "one", "plan"]
DOCS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 5)) for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A word-level tokenizer trained here on DOCS (no network): ids 0 <unk>, 1 <|endoftext|>, then words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"]))
    directory = tmp_path_factory.mktemp("tok")
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ds") / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))
    return path


def expected_stream(tokenizer: Path) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    return [i for d in DOCS for i in tok.encode(d).ids + [1]]


def test_bin_rows_are_the_seeded_windows(tmp_path) -> None:
    """Window j is tokens [8j, 8j + 9); step k's rows are windows perm(seed, epoch)[4k: 4k + 4]."""
    path = tmp_path / "train.bin"
    (np.arange(1000) % 500).astype(np.uint16).tofile(path)
    source = TokenSource(512, SEQ, 4, 3, str(path))
    windows = 999 // SEQ
    assert windows == 124
    order = np.random.default_rng((3, 0)).permutation(windows)
    ids = source.sample_ids(2, 0, 4)
    assert ids == order[8:12].tolist()
    batch = source.batch(2)
    for row, j in enumerate(ids):
        assert batch.inputs[row].tolist() == [(SEQ * j + t) % 500 for t in range(SEQ)]
        assert batch.targets[row].tolist() == [(SEQ * j + t + 1) % 500 for t in range(SEQ)]
    # any rows of a step are those rows of its global batch, whatever was read before
    fresh = TokenSource(512, SEQ, 4, 3, str(path))
    assert torch.equal(fresh.rows(2, 1, 2).inputs, batch.inputs[1:3])
    # one epoch visits every window once; the next epoch is another order
    seen = [i for step in range(31) for i in source.sample_ids(step, 0, 4)]
    assert sorted(seen) == list(range(124))
    assert source.sample_ids(31, 0, 4) == np.random.default_rng((3, 1)).permutation(windows)[:4].tolist()


def test_npy_and_named_bin_dtypes_read_the_same_tokens(tmp_path) -> None:
    tokens = 65_500 + (np.arange(300) * 7) % 4_000
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    tokens.astype(np.uint32).tofile(tmp_path / "t.uint32.bin")
    a = TokenSource(70_000, SEQ, 4, 0, str(tmp_path / "t.npy")).batch(5)
    b = TokenSource(70_000, SEQ, 4, 0, str(tmp_path / "t.uint32.bin")).batch(5)
    assert torch.equal(a.inputs, b.inputs) and a.inputs.dtype == torch.int64
    assert int(a.inputs.min()) >= 65_500  # read as 32-bit ids, not uint16 halves
    assert len(open_tokens(tmp_path / "t.uint32.bin")) == 300
    assert len(open_tokens(tmp_path / "t.uint32.bin", "uint16")) == 600  # the dtype given wins


def test_jsonl_parquet_and_saved_dataset_tokenize_to_the_same_stream(tmp_path, tokenizer, jsonl) -> None:
    cache = tmp_path / "cache"
    path, dtype = prepare_data(str(jsonl), 512, str(tokenizer), cache_dir=str(cache))
    assert dtype is None and path.endswith(".uint16.bin") and Path(path).parent == cache
    stream = expected_stream(tokenizer)
    assert open_tokens(path).tolist() == stream
    assert len(stream) == 160 + 40  # 40 documents of 2..6 words, each ended by <|endoftext|>
    mtime = Path(path).stat().st_mtime_ns
    assert prepare_data(str(jsonl), 512, str(tokenizer), cache_dir=str(cache))[0] == path  # cached
    assert Path(path).stat().st_mtime_ns == mtime
    table = datasets.Dataset.from_dict({"body": DOCS})
    table.to_parquet(str(tmp_path / "docs.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    for data in (str(tmp_path / "docs.parquet"), str(tmp_path / "saved")):
        other, _ = prepare_data(data, 512, str(tokenizer), text_field="body", cache_dir=str(cache))
        assert other != path and open_tokens(other).tolist() == stream
    source = TokenSource(512, SEQ, 4, 0, path)
    j = source.sample_ids(1, 0, 1)[0]
    assert source.batch(1).inputs[0].tolist() == stream[SEQ * j: SEQ * j + SEQ]


def fails(*args: str) -> str:
    result = CliRunner().invoke(app, ["train", "--model", "tiny-llama", "--strategy", "dp=1,gbs=2", "--nproc", "1",
                                      "--steps", "1", *map(str, args)])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


def test_bad_data_is_one_line(tmp_path, tokenizer, jsonl) -> None:
    cache = tmp_path / "cache"
    assert "give --tokenizer" in fails("--data", jsonl, "--data-cache", cache)
    assert "has no tokenizer.json" in fails("--data", jsonl, "--tokenizer", tmp_path, "--data-cache", cache)
    assert "no text field 'body'" in fails("--data", jsonl, "--tokenizer", tokenizer, "--text-field", "body",
                                           "--data-cache", cache)
    (np.arange(600) % 600).astype(np.uint16).tofile(tmp_path / "big.bin")
    line = fails("--data", tmp_path / "big.bin")
    assert "token id 599" in line and "vocabulary has 512" in line
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "is empty" in fails("--data", tmp_path / "empty.bin")
    (tmp_path / "empty.jsonl").write_text("")
    assert "is empty" in fails("--data", tmp_path / "empty.jsonl", "--tokenizer", tokenizer)
    assert "--tokenizer reads datasets" in fails("--data", tmp_path / "big.bin", "--tokenizer", tokenizer)
    assert not list(cache.glob("*.bin"))  # nothing half-written


def test_vocab_check_names_the_largest_id(tmp_path) -> None:
    np.save(tmp_path / "t.npy", np.array([3, 900, 12] * 10, dtype=np.int64))
    with pytest.raises(PlaitError, match="token id 900 but the model's vocabulary has 512"):
        TokenSource(512, SEQ, 2, 0, str(tmp_path / "t.npy"))


def _train(tmp: Path, data: Path, steps: int, ckpt: Path, log: Path, metrics: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "plait.cli", "train", "--model", "tiny-llama", "--strategy", "dp=2,gbs=4",
           "--nproc", "2", "--steps", str(steps), "--lr", "0.01", "--seq-len", "16", "--data", str(data),
           "--metrics-out", str(metrics), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PLAIT_SAMPLES_LOG": str(log)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _reads(log: Path) -> dict[tuple[int, int], list[int]]:
    return {(json.loads(line)["step"], rank): json.loads(line)["samples"]
            for rank in (0, 1) for line in (log / f"rank-{rank}.jsonl").read_text().splitlines()}


def test_resumed_run_reads_the_samples_of_the_uninterrupted_run(tmp_path, tokenizer, jsonl) -> None:
    """2 data-parallel ranks, 4 steps; the same run stopped after step 2 and resumed from its checkpoint
    reads exactly the same samples on each rank, and trains to the same losses."""
    data, _ = prepare_data(str(jsonl), 512, str(tokenizer), cache_dir=str(tmp_path / "cache"))
    whole = _train(tmp_path, Path(data), 4, tmp_path / "a", tmp_path / "log-a", tmp_path / "a.jsonl")
    _train(tmp_path, Path(data), 2, tmp_path / "b", tmp_path / "log-b", tmp_path / "b.jsonl")
    resumed = _train(tmp_path, Path(data), 4, tmp_path / "b", tmp_path / "log-b", tmp_path / "b.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    reads_a, reads_b = _reads(tmp_path / "log-a"), _reads(tmp_path / "log-b")
    assert sorted(reads_b) == sorted(reads_a) == [(s, r) for s in range(4) for r in (0, 1)]  # no step read twice
    assert reads_b == reads_a
    source = TokenSource(512, 16, 4, 0, data)
    for step in range(4):  # mbs=1 with dp=2: rank r reads row r of each micro-batch of 2 rows, and only those
        ids = source.sample_ids(step, 0, 4)
        assert reads_a[step, 0] == sorted(ids[0::2]) and reads_a[step, 1] == sorted(ids[1::2])
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], rel=1e-6, abs=0)


def test_variable_length_documents_read_a_token_file(tmp_path) -> None:
    """--varlen's documents come from a token file's spans as they do from a text file's bytes."""
    from plait.runtime.varlen import DocumentSource

    tokens = (np.arange(2000) * 3) % 290
    tokens.astype(np.uint16).tofile(tmp_path / "t.bin")
    source = DocumentSource(np.array([5, 40, 300]), 4, 1, 300, 256, str(tmp_path / "t.bin"))
    lengths = source.lengths(2)
    for i, (n, doc) in enumerate(zip(lengths, source.documents(2))):
        start = (2 * 4 + i) * 7_919 % (2000 - (n + 1))
        assert doc.dtype == torch.int64 and doc.tolist() == tokens[start: start + n + 1].tolist()
