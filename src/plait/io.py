"""Output paths and atomic writes: every file plait writes goes through here.

Paths are checked before any work starts (so a long measurement or search is never lost to an unwritable
path), and files appear whole or not at all. Errors are PlaitErrors that name the user's path.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from plait.errors import PlaitError


def _existing_ancestor(path: Path) -> Path:
    """The nearest of `path` and its parents that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(directory: Path, what: str, shown: Path | None = None) -> None:
    """Raise PlaitError unless files can be created in `directory` (or in the directories plait would make
    for it): probes the nearest existing one with a temporary file, which also catches read-only mounts.
    Messages name `shown` (the path the user gave), else `directory`."""
    name = str(shown or directory)
    base = _existing_ancestor(directory)
    if not base.is_dir():
        raise PlaitError(f"{what} {name!r}: {str(base)!r} is a file, not a directory; choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".plait-probe.")
    except OSError as exc:
        raise PlaitError(f"{what} {name!r} is not writable ({exc.strerror or exc} in {str(base)!r}); choose a "
                         "writable path") from None
    os.close(fd)
    os.unlink(probe)


def output_path(text: str | os.PathLike[str], default_name: str, what: str) -> Path:
    """The file an output option names, checked before any work: `text` itself, or `text/default_name` when
    `text` is an existing directory or ends with a slash. PlaitError when it cannot be written."""
    raw = os.fspath(text)
    if not raw:
        raise PlaitError(f"{what} is empty; give a file path")
    path = Path(raw)
    if raw.endswith(("/", os.sep)) or path.is_dir():
        path = path / default_name
    if path.is_dir():
        raise PlaitError(f"{what} {str(path)!r} is a directory; give a file path")
    check_writable_dir(path.parent, what, path)
    return path


def free_bytes(directory: Path) -> int:
    """Bytes free on the file system that holds `directory` (or would hold it)."""
    return shutil.disk_usage(_existing_ancestor(directory)).free


def _write_temp(path: Path, data: str | bytes) -> str:
    """Write `data` to a new temporary file beside `path` (with the usual permissions); returns its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def write_files(files: Sequence[tuple[Path, str | bytes]]) -> None:
    """Write every (path, data) so that readers never see a file half-written, and all or none of them
    appear: nothing is replaced until every file's data is on disk. PlaitError names the user's path."""
    temps: list[tuple[str, Path]] = []
    current = Path()
    try:
        for current, data in files:
            temps.append((_write_temp(Path(current), data), Path(current)))
        for tmp, current in temps:
            os.replace(tmp, current)
    except OSError as exc:
        raise PlaitError(f"cannot write {str(current)!r}: {exc.strerror or exc}; choose a writable path with "
                         "free space") from None
    finally:
        for tmp, _ in temps:
            Path(tmp).unlink(missing_ok=True)


def write_atomically(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write one file so that readers never see it half-written (PlaitError names `path` on failure)."""
    write_files([(Path(path), data)])


def json_line(obj: object) -> str:
    """`obj` as one line of standard JSON: a non-finite number (inf, NaN) becomes null."""
    def finite(x: object) -> object:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(obj), allow_nan=False) + "\n"
