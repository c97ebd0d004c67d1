"""Tests for plait.io: output paths checked before work, all-or-nothing atomic writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import expect_error

import plait.io
from plait.io import check_writable_dir, output_path, write_atomically, write_files


def test_output_path_is_the_file_or_a_default_name_in_a_directory(tmp_path: Path) -> None:
    assert output_path(str(tmp_path / "a.json"), "plan.json", "--out") == tmp_path / "a.json"
    assert output_path(str(tmp_path), "plan.json", "--out") == tmp_path / "plan.json"
    assert output_path(str(tmp_path / "new") + "/", "plan.json", "--out") == tmp_path / "new" / "plan.json"
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_output_path_refusals_name_the_users_path(tmp_path: Path) -> None:
    expect_error(lambda: output_path("/proc/p.json", "profile.json", "--out"), "--out '/proc/p.json' is not writable")
    afile = tmp_path / "file"
    afile.write_text("x")
    expect_error(lambda: output_path(str(afile / "x.json"), "plan.json", "--out"), f"{str(afile)!r} is a file")
    (tmp_path / "d" / "plan.json").mkdir(parents=True)
    expect_error(lambda: output_path(str(tmp_path / "d"), "plan.json", "--out"), "is a directory")
    expect_error(lambda: output_path("", "plan.json", "--out"), "--out is empty")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        expect_error(lambda: check_writable_dir(ro / "sub", "--checkpoint-dir"), "is not writable")
    finally:
        ro.chmod(0o700)


def test_write_files_is_all_or_nothing(tmp_path: Path) -> None:
    ok = tmp_path / "ok.json"
    expect_error(lambda: write_files([(ok, "{}"), (Path("/proc/g.json"), "{}")]), "cannot write '/proc/g.json'")
    assert list(tmp_path.iterdir()) == []  # neither the first file nor a temporary one


def test_failed_replace_keeps_the_old_file_and_names_the_users_path(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    write_atomically(path, "old")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plait.io.os, "replace", full_disk)
    err = expect_error(lambda: write_atomically(path, "new"), f"cannot write {str(path)!r}: No space left on device")
    assert ".tmp" not in str(err)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["plan.json"]
