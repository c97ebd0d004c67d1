"""One computation run beside the caller on another core: a forked child process computes `fn(*args)` while the
caller goes on, and `Background.result()` waits for it and returns its value or raises its exception. The search
runs the uniform Megatron grid this way beside its layer-wise search (they share nothing but their inputs; each
prices with its own caches).

Start one only where `spare_core()` (Linux's `fork`, two cores or more). The child writes its pickled outcome to
a pipe and leaves with `os._exit`, running no exit handlers and flushing none of the caller's buffers.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def spare_core() -> bool:
    """Whether this process may fork a child onto another core (Linux, at least two cores to run on)."""
    return sys.platform == "linux" and hasattr(os, "fork") and len(os.sched_getaffinity(0)) > 1


class Background(Generic[T]):
    """`fn(*args)` under way in a forked child (see the module docstring)."""

    def __init__(self, fn: Callable[..., T], *args: object) -> None:
        self._done: tuple[bool, object] | None = None
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compute, send, leave without running the parent's exit handlers
            try:
                os.close(read)
                try:
                    payload = pickle.dumps(_outcome(fn, args))
                except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception
                    payload = pickle.dumps((False, RuntimeError(f"background computation failed: {exc!r}")))
                with os.fdopen(write, "wb") as out:
                    out.write(payload)
            finally:
                os._exit(0)
        os.close(write)
        self._pid, self._fd = pid, read

    def result(self) -> T:
        """The value of `fn(*args)` (waiting for the child), or its exception raised here."""
        if self._done is None:
            try:
                with os.fdopen(self._fd, "rb") as pipe:
                    data = pipe.read()
            finally:
                self._reap()
            self._done = pickle.loads(data) if data else \
                (False, RuntimeError("background computation ended without a result"))
        ok, value = self._done
        if not ok:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]

    def cancel(self) -> None:
        """Stop the child if it still runs (the caller no longer wants the result)."""
        if self._pid:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(self._fd)
            self._reap()

    def _reap(self) -> None:
        if self._pid:
            os.waitpid(self._pid, 0)
            self._pid = 0


def _outcome(fn: Callable[..., T], args: tuple) -> tuple[bool, object]:
    """(True, fn(*args)) or (False, the exception it raised): what the child sends."""
    try:
        return True, fn(*args)
    except Exception as exc:  # noqa: BLE001 - raised in the caller by Background.result
        return False, exc
