"""`python -m plait.cli`: the `plait` command."""

from plait.cli import main

main()
