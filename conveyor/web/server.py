"""What ``conveyor serve`` runs: the app made from the environment in each server process
(uvicorn's factory), and the OpenAPI document kept in the repository."""

from __future__ import annotations

import json

from fastapi import FastAPI

from conveyor.logs import configure_logging
from conveyor.settings import ConveyorSettings
from conveyor.web.app import create_app


def app_from_environment() -> FastAPI:
    """The app of one server process: settings from ``CONVEYOR_*``, Conveyor's log renderer
    (uvicorn's own loggers included, with no access to request headers)."""
    settings = ConveyorSettings()
    configure_logging(settings)
    return create_app(settings)


def openapi_document() -> str:
    """The OpenAPI document as kept in ``docs/openapi.json`` (stable order, one per line)."""
    return json.dumps(create_app(ConveyorSettings()).openapi(), indent=2, sort_keys=True) + "\n"


__all__ = ["app_from_environment", "openapi_document"]
