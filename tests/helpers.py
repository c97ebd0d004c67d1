"""Shared test helpers."""

from __future__ import annotations

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
