"""What a stage body sees: :class:`JobContext`, under the name stage code imports.

The class lives on the worker's side (:mod:`conveyor.worker.context`); stage code has
imported it from ``conveyor.context`` since before the layout was grouped by side, so the
name stays, as this one re-export (listed in ``.importlinter``)."""

from conveyor.worker.context import JobContext

__all__ = ["JobContext"]
