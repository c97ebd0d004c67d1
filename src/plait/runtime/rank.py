"""A rank's program as the launcher's fork server starts it (`plait.runtime.launch`): `rank.py -m MODULE ARGS...`
or `rank.py SCRIPT ARGS...` runs in the forked rank as `python -u -m MODULE ARGS...` or `python -u SCRIPT
ARGS...` would run it in a fresh interpreter (its `sys.argv`, `sys.path[0]` and `__main__`). The program ends by
returning or `sys.exit`, not `os._exit(0)`: torchrun waits for each forked rank's return value (the fork then
leaves without the interpreter's teardown)."""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    """Run the module (`-m MODULE ARGS...`) or script (`SCRIPT ARGS...`) of `argv` as `__main__`."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
