"""``python -m conveyor``: the ``conveyor`` command without a console script on PATH."""

from conveyor.cli.main import main

main()
