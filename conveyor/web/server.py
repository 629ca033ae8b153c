"""What ``conveyor serve`` runs: the app made from the environment in each server process
(uvicorn's factory), and the OpenAPI document kept in the repository.

Both include the deployment's own endpoints: its app module (``CONVEYOR_APP``, loaded as
the CLI loads it) names FastAPI routers by module path in ``HTTP_EXTENSIONS``, e.g.
``{"files": "pipelines.files.http:router"}`` (as its package names ``CLI_EXTENSIONS``, the
command groups: :mod:`conveyor.cli.common`). Where there is no deployment (its module
cannot be imported) the core API is served, and one log line says so; a deployment that
is there but broken fails the server at start, loudly.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from fastapi import APIRouter, FastAPI

from conveyor import tracing
from conveyor.deployment import import_object, load_app_module
from conveyor.errors import ConfigurationError
from conveyor.logs import configure_logging
from conveyor.settings import ConveyorSettings
from conveyor.web.app import create_app
from conveyor.web.events import streams_end

log = logging.getLogger("conveyor.web")


def app_from_environment() -> FastAPI:
    """The app of one server process: settings from ``CONVEYOR_*``, Conveyor's log renderer
    (uvicorn's own loggers included, with no access to request headers), the deployment's
    routers."""
    settings = ConveyorSettings()
    configure_logging(settings)
    tracing.configure(settings)  # CONVEYOR_TRACING=on: submits join their callers' traces
    app = create_app(settings, routers=deployment_routers(settings))
    _end_streams_on_exit(app)
    return app


def deployment_routers(settings: ConveyorSettings | None = None) -> list[APIRouter]:
    """The routers the deployment's app module names in ``HTTP_EXTENSIONS`` (none without one).

    Raises:
        ConfigurationError: the app module is there but builds no platform, or an entry
            is not an importable ``APIRouter``; any error importing them propagates.
    """
    settings = settings or ConveyorSettings()
    try:
        module = load_app_module(settings)
    except ConfigurationError as exc:
        if _importable(settings.app.partition(":")[0]):
            raise  # the deployment is there, and broken
        log.warning("no deployment found, serving the core API only: %s", exc)
        return []
    extensions = getattr(module, "HTTP_EXTENSIONS", {})
    if not isinstance(extensions, Mapping):
        raise ConfigurationError(f"{settings.app}.HTTP_EXTENSIONS must map names to 'module:router' paths")
    routers = []
    for name, path in extensions.items():
        router = import_object(str(path), settings)
        if not isinstance(router, APIRouter):
            raise ConfigurationError(
                f"{settings.app}.HTTP_EXTENSIONS[{name!r}] = {path!r} is a {type(router).__name__}, "
                "not a fastapi.APIRouter"
            )
        routers.append(router)
    return routers


def _importable(module: str) -> bool:
    """Whether ``module`` can be found (on the path the failed load set up)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is not there
        return False


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
    settings = ConveyorSettings()
    app = create_app(settings, routers=deployment_routers(settings))
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


__all__ = ["app_from_environment", "deployment_routers", "openapi_document"]
