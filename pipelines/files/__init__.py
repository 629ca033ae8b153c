"""The files family, caller's side: what apps and operators call (the stages and their
pure logic, the worker's side, are ``tasks/files/``).

- :mod:`pipelines.files.batches`: the canvas builders, and uploads, confirm, seal,
  cancel, retry and the status of a batch;
- :mod:`pipelines.files.retrieval`: search, and re-embedding after the embedder changes;
- :mod:`pipelines.files.cli`: ``conveyor files …`` (``CLI_EXTENSIONS`` in ``config``);
- :mod:`pipelines.files.http`: the batches router (``HTTP_EXTENSIONS`` in
  ``config/celery_app.py``).

This package re-exports the public names of ``batches`` and ``retrieval`` so that
``from pipelines.files import Upload, process_batch, search`` stays the family's one
import for apps, tests and benchmarks, whichever module a name lives in. They are loaded
on first use: ``conveyor --help`` imports :mod:`pipelines.files.cli` to list the group,
and must not load SQLAlchemy or Celery for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.files.batches import (
        BatchClosed,
        Upload,
        batch_status,
        cancel_batch,
        confirm,
        new_batch,
        process_batch,
        replace_content,
        retry_failed,
        seal_batch,
        upload,
    )
    from pipelines.files.retrieval import RANKINGS, Hit, Ranking, reembed, search

__all__ = [
    "RANKINGS",
    "BatchClosed",
    "Hit",
    "Ranking",
    "Upload",
    "batch_status",
    "cancel_batch",
    "confirm",
    "new_batch",
    "process_batch",
    "reembed",
    "replace_content",
    "retry_failed",
    "seal_batch",
    "search",
    "upload",
]
# The names of retrieval; every other one is batches'.
_RETRIEVAL = {"RANKINGS", "Hit", "Ranking", "reembed", "search"}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = "retrieval" if name in _RETRIEVAL else "batches"
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
