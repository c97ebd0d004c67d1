"""A module next to tests/rank_probe.py, imported by it as a script's sibling."""

SIBLING = "found"
