"""What ``conveyor serve`` runs: the app made from the environment in each server process
(uvicorn's factory), and the OpenAPI document kept in the repository."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from fastapi import FastAPI

from conveyor.logs import configure_logging
from conveyor.settings import ConveyorSettings
from conveyor.web.app import create_app
from conveyor.web.events import streams_end


def app_from_environment() -> FastAPI:
    """The app of one server process: settings from ``CONVEYOR_*``, Conveyor's log renderer
    (uvicorn's own loggers included, with no access to request headers)."""
    settings = ConveyorSettings()
    configure_logging(settings)
    app = create_app(settings)
    _end_streams_on_exit(app)
    return app


def _end_streams_on_exit(app: FastAPI) -> None:
    """Chain ahead of the server's own SIGTERM/SIGINT handlers (uvicorn installs them before
    it builds the app, and restores its predecessors after): open event streams end at once,
    or the graceful shutdown would wait out its timeout for clients that never hang up."""
    if threading.current_thread() is not threading.main_thread():
        return
    end = streams_end(app)
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum: int, frame: FrameType | None, previous: Callable[..., Any] = previous) -> None:
            end.set()
            previous(signum, frame)

        signal.signal(sig, handler)


def openapi_document() -> str:
    """The OpenAPI document as kept in ``docs/openapi.json`` (stable order, one per line)."""
    return json.dumps(create_app(ConveyorSettings()).openapi(), indent=2, sort_keys=True) + "\n"


__all__ = ["app_from_environment", "openapi_document"]
