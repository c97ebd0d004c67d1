"""Run on local ranks by tests/test_launch_ranks.py: what a rank saw when its program started."""

import json
import os
import sys

PRELOADED_AT_START = "plait.runtime.train" in sys.modules  # before this program imported anything of plait

from rank_probe_sibling import SIBLING  # noqa: E402 - found in this script's directory, as `python script` finds it

if __name__ == "__main__":
    out = sys.argv[1]
    with open(f"{out}.{os.environ['RANK']}", "w") as f:
        json.dump({"preloaded": PRELOADED_AT_START, "argv": sys.argv[1:], "sibling": SIBLING,
                   "world": os.environ["WORLD_SIZE"], "parent": os.getppid()}, f)
