"""The caller's side: what an app uses to submit, follow, cancel and retry jobs, with or
without the stages' code. It records jobs and publishes them; it never imports the
worker's side (``.importlinter``).

``Client``, ``AsyncClient`` and ``connect`` are re-exported here, lazily, so that
``from conveyor.client import Client`` keeps working and importing one module of the
package does not load the others."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor import connect
    from conveyor.client.by_name import Client
    from conveyor.client.by_name_async import AsyncClient

__all__ = ["AsyncClient", "Client", "connect"]

_LAZY = {
    "Client": "conveyor.client.by_name",
    "AsyncClient": "conveyor.client.by_name_async",
    "connect": "conveyor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'conveyor.client' has no attribute {name!r}")
