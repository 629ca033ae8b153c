"""The HTTP API's application: :func:`create_app` builds it around a
:class:`conveyor.Client` (given, or made from settings), to serve with ``conveyor serve``
or to mount in an app's own ASGI application (``parent.mount("/conveyor", create_app())``).

A deployment adds endpoints of its own as FastAPI routers (``routers=``; ``conveyor serve``
loads those its app module names in ``HTTP_EXTENSIONS``: see :mod:`conveyor.web.server`).
They use the same tokens (:mod:`conveyor.web.auth`) and problem details.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import RedirectResponse
from sqlalchemy import text

from conveyor.client.by_name import Client
from conveyor.settings import ConveyorSettings
from conveyor.store.db.engine import reading
from conveyor.store.db.namespace import table_exists
from conveyor.store.db.schema import tokens
from conveyor.web import console, dead_letters, dry_run, events, jobs, problems
from conveyor.web.auth import client_of
from conveyor.web.limits import BodyLimit, HeldLimit, body_limit, streamed_routes
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


TAGS = [
    {"name": "jobs", "description": "Submit by stage name, show, cancel."},
    {"name": "dead-letters", "description": "List, show, retry and purge (scope `admin`)."},
    {"name": "events", "description": "The event outbox in commit order: pages and a stream."},
    {"name": "health", "description": "Liveness of the database."},
]


def create_app(
    client_or_settings: Client | ConveyorSettings | None = None, routers: Sequence[APIRouter] = ()
) -> FastAPI:
    """The HTTP API on ``client_or_settings``: a :class:`conveyor.Client` (the caller's,
    left open), or settings (default: the ``CONVEYOR_*`` environment) for a client of its
    own, closed when the app shuts down. Nothing connects before the first request.

    ``routers``: a deployment's own endpoints, after Conveyor's. Their tags join the
    document's list, described by the first paragraph of their module's docstring."""
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
    app.state.conveyor_held = HeldLimit(client.settings.http_max_held)
    streamed = streamed_routes([route for router in routers for route in router.routes])
    app.add_middleware(BodyLimit, max_bytes=body_limit(client.settings.max_payload_bytes), exempt=streamed)
    problems.install(app)
    app.include_router(dry_run.router)  # before /jobs/{job_id}
    app.include_router(jobs.router)
    app.include_router(dead_letters.router)
    app.include_router(events.router)
    console.install(app)
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
    app.add_api_route("/", home, methods=["GET"], include_in_schema=False)
    for router in routers:
        app.include_router(router)
    tags = TAGS + _tags_of(routers, {str(t["name"]) for t in TAGS})
    app.openapi = lambda: _openapi(app, tags)  # type: ignore[method-assign]
    return app


def _tags_of(routers: Sequence[APIRouter], known: set[str]) -> list[dict[str, str]]:
    """The OpenAPI tags of ``routers`` not in ``known``, in order, each described by the
    first paragraph of its router's module docstring (when it has one)."""
    out: list[dict[str, str]] = []
    for router in routers:
        endpoints = [e for e in (getattr(r, "endpoint", None) for r in router.routes) if e is not None]
        module = sys.modules.get(endpoints[0].__module__) if endpoints else None
        doc = " ".join((inspect.getdoc(module) or "").split("\n\n")[0].split()) if module else ""
        for tag in router.tags:
            name = str(getattr(tag, "value", tag))
            if name not in known:
                known.add(name)
                out.append({"name": name, "description": doc} if doc else {"name": name})
    return out


def home(request: Request) -> RedirectResponse:
    """The URL ``conveyor up`` prints leads a person to the console (its sign-in page)."""
    return RedirectResponse(f"{request.scope.get('root_path', '')}/console", status_code=307)


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


def _openapi(app: FastAPI, tags: list[dict[str, str]]) -> dict[str, Any]:
    """FastAPI's document, with every error as ``application/problem+json`` (its own 422
    included: malformed requests are answered as problems too)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=tags,
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
