"""Shared test helpers."""

from __future__ import annotations

import re

import pytest

from plait.errors import PlaitError


def expect_error(fn, *needles: str) -> PlaitError:
    """Call fn, require a one-line PlaitError (a ValueError) whose message contains every needle."""
    with pytest.raises(PlaitError) as info:
        fn()
    err = info.value
    assert isinstance(err, ValueError)
    msg = str(err)
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return err


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def assert_bad_input(result, *needles: str) -> None:
    """Exit code 2, one line on stderr starting with `error:`, nothing on stdout, no traceback."""
    stderr = ANSI.sub("", result.stderr)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        f"escaped exception {result.exception!r}"
    assert result.exit_code == 2, (result.exit_code, result.stdout, stderr)
    assert "Traceback" not in result.output
    lines = stderr.strip("\n").split("\n")
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error:"), stderr
    assert len(lines[0]) > len("error: ") + 10  # says what is wrong
    assert result.stdout == ""
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
