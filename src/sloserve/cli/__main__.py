"""``python -m sloserve.cli``: the ``sloserve`` command."""

from sloserve.cli import main

main()
