"""The HTTP API's application: :func:`create_app` builds it around a
:class:`conveyor.Client` (given, or made from settings), to serve with ``conveyor serve``
or to mount in an app's own ASGI application (``parent.mount("/conveyor", create_app())``).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from sqlalchemy import text

from conveyor.client import Client
from conveyor.db.engine import reading
from conveyor.db.namespace import table_exists
from conveyor.db.schema import tokens
from conveyor.settings import ConveyorSettings
from conveyor.web import dead_letters, dry_run, events, jobs, problems
from conveyor.web.auth import client_of
from conveyor.web.limits import BodyLimit, body_limit
from conveyor.web.problems import DESCRIPTIONS, MEDIA_TYPE, NOT_MIGRATED, unavailable

TITLE = "Conveyor"
DESCRIPTION = (
    "Submit jobs by stage name, follow and cancel them. Every request but `/health` needs a "
    "bearer token (`conveyor tokens create`); a token sees only its owner's jobs unless it is "
    "`admin`. Errors are RFC 9457 problem details (`application/problem+json`)."
)


def _version() -> str:
    try:
        return version("conveyor")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout without metadata
        return "0"


def create_app(client_or_settings: Client | ConveyorSettings | None = None) -> FastAPI:
    """The HTTP API on ``client_or_settings``: a :class:`conveyor.Client` (the caller's,
    left open), or settings (default: the ``CONVEYOR_*`` environment) for a client of its
    own, closed when the app shuts down. Nothing connects before the first request."""
    owned = not isinstance(client_or_settings, Client)
    client = client_or_settings if isinstance(client_or_settings, Client) else Client(client_or_settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:
            client.close()

    app = FastAPI(
        title=TITLE,
        version=_version(),
        description=DESCRIPTION,
        lifespan=lifespan,
        # The errors the docs pages would show are ours: problem details, below.
        redoc_url=None,
    )
    app.state.conveyor_client = client
    app.state.conveyor_streams_end = threading.Event()  # see conveyor.web.events.streams_end
    app.add_middleware(BodyLimit, max_bytes=body_limit(client.settings.max_payload_bytes))
    problems.install(app)
    app.include_router(dry_run.router)  # before /jobs/{job_id}
    app.include_router(jobs.router)
    app.include_router(dead_letters.router)
    app.include_router(events.router)
    app.add_api_route(
        "/health",
        health,
        methods=["GET"],
        tags=["health"],
        operation_id="health",
        summary="Whether the database answers",
        description="No token needed. 200 when the database answers and is migrated, else 503.",
        responses=problems.responses(503),
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def health(request: Request) -> dict[str, str]:
    """``{"status": "ok"}`` when the database answers and has Conveyor's tables."""
    engine = client_of(request).connections.engine
    try:
        with reading(engine) as conn:
            conn.execute(text("SELECT 1"))
            migrated = table_exists(conn, tokens)
    except Exception as exc:
        raise unavailable("the database did not answer; try again") from exc
    if not migrated:
        raise unavailable(NOT_MIGRATED)
    return {"status": "ok"}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with every error as ``application/problem+json`` (its own 422
    included: malformed requests are answered as problems too)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=[
            {"name": "jobs", "description": "Submit by stage name, show, cancel."},
            {"name": "dead-letters", "description": "List, show, retry and purge (scope `admin`)."},
            {"name": "events", "description": "The event outbox in commit order: pages and a stream."},
            {"name": "health", "description": "Liveness of the database."},
        ],
    )
    problem_ref = {"$ref": "#/components/schemas/ProblemDetail"}
    for path in doc.get("paths", {}).values():
        for operation in path.values():
            if "requestBody" in operation:
                # Any body may be unparseable (FastAPI's 400) or too large (BodyLimit's 413).
                for status in (400, 413):
                    operation["responses"].setdefault(str(status), {"description": DESCRIPTIONS[status]})
            for status, answer in operation.get("responses", {}).items():
                if int(status) >= 400:
                    answer["content"] = {MEDIA_TYPE: {"schema": problem_ref}}
                    if status == "422":
                        answer["description"] = "Unprocessable Content"
    schemas = doc.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    app.openapi_schema = doc
    return doc


__all__ = ["create_app"]
