"""The ``conveyor`` command, one module per command group (``main`` is the entry point)."""
