"""Errors as RFC 9457 problem details: ``application/problem+json`` with ``type``,
``title``, ``status``, ``detail`` and ``instance``, plus members of our own (``errors``:
each bad field; ``suggestions``: stage names close to an unknown one).

Every error the API answers is one: its own (:class:`Problem`), Conveyor's (an unknown
stage, an invalid payload, a database outage), a malformed request (FastAPI's 422), an
unknown route or method, and anything unexpected (a 500 that says nothing more). A
problem never echoes what the request sent (a payload's values, a token).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DataError, DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.errors import (
    ConfigurationError,
    IdempotencyConflict,
    JobIdInvalid,
    NotRunning,
    PayloadInvalid,
    PayloadTooLarge,
    SubmitFailed,
    UnknownStage,
    describe,
)

log = logging.getLogger("conveyor.web")

MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:conveyor:problem:"
RETRY_AFTER = "5"  # seconds: how long a client waits before trying again after a 503


class FieldError(BaseModel):
    """One thing wrong with a request: where (``payload.n``, ``body.stage``) and what."""

    field: str
    message: str


class ProblemDetail(BaseModel):
    """An RFC 9457 problem document."""

    model_config = ConfigDict(extra="allow")

    type: str = Field("about:blank", description="a URI naming the kind of problem")
    title: str = Field(description="the kind of problem, the same for every occurrence")
    status: int = Field(description="the HTTP status code")
    detail: str | None = Field(None, description="this occurrence, for people")
    instance: str | None = Field(None, description="the request path it happened at")
    errors: list[FieldError] | None = Field(None, description="each bad field (422)")
    suggestions: list[str] | None = Field(None, description="stage names close to an unknown one")


class Problem(Exception):
    """An error answered as a problem document (raise it from an endpoint)."""

    def __init__(
        self,
        status: int,
        kind: str | None,
        title: str,
        detail: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        **members: Any,
    ) -> None:
        super().__init__(detail or title)
        self.status = status
        self.type = f"{TYPE_PREFIX}{kind}" if kind else "about:blank"
        self.title = title
        self.detail = detail
        self.headers = dict(headers or {})
        self.members = members


def problem_response(request: Request, problem: Problem) -> JSONResponse:
    """The response for ``problem`` at ``request``."""
    body: dict[str, Any] = {
        "type": problem.type,
        "title": problem.title,
        "status": problem.status,
        "instance": request.url.path,
    }
    if problem.detail:
        body["detail"] = problem.detail
    body.update({k: v for k, v in problem.members.items() if v is not None})
    return JSONResponse(body, status_code=problem.status, headers=problem.headers, media_type=MEDIA_TYPE)


def field_errors(lines: Sequence[str], *, under: str) -> list[dict[str, str]]:
    """``field: message`` lines (a :class:`PayloadInvalid`'s) as ``errors`` members."""
    out = []
    for line in lines:
        field, sep, message = line.partition(": ")
        if sep:
            out.append({"field": f"{under}.{field}" if field != under else field, "message": message})
        else:
            out.append({"field": under, "message": line})
    return out


NOT_MIGRATED = "the database lacks Conveyor's tables of this version: run `conveyor db upgrade`"


def _missing_table(exc: Exception) -> bool:
    """Postgres' undefined_table, or SQLite's "no such table": a database not upgraded."""
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) == "42P01" or "no such table" in str(orig)


def duplicate_of_another_owner(detail: str) -> Problem:
    """409: the submit names a job (its id, its dedup key) of an owner the caller may not
    see; neither that job's existence nor its state is said."""
    return Problem(409, "duplicate-of-another-owner", "Conflict", detail)


def unavailable(detail: str) -> Problem:
    """503: the database did not answer; nothing was done, try again."""
    return Problem(503, "unavailable", "Service unavailable", detail, headers={"Retry-After": RETRY_AFTER})


def invalid_value(exc: DataError) -> Problem:
    """422: the database refused a value the request carried (SQLSTATE class 22, or the
    driver's own refusal of a NUL character): sending it again fails again, so not a 503.
    The detail never quotes the value (the driver's words may)."""
    nul = "NUL" in str(exc.orig) or getattr(exc.orig, "sqlstate", None) == "22P05"
    detail = (
        "text cannot contain NUL (\\u0000) characters"
        if nul
        else "a value of this request cannot be stored or compared by the database"
    )
    return Problem(422, "invalid-value", "Invalid value", detail)


def _from_conveyor(exc: Exception) -> Problem:
    """The problem a Conveyor error raised by the client means."""
    if isinstance(exc, UnknownStage):
        return Problem(422, "unknown-stage", "Unknown stage", str(exc), suggestions=list(exc.suggestions))
    if isinstance(exc, PayloadTooLarge):
        return Problem(413, "payload-too-large", "Payload too large", str(exc))
    if isinstance(exc, PayloadInvalid):
        return Problem(
            422,
            "invalid-payload",
            "Invalid payload",
            str(exc),
            errors=field_errors(exc.problems, under="payload") or None,
        )
    if isinstance(exc, SubmitFailed):
        cause = exc.__cause__
        return invalid_value(cause) if isinstance(cause, DataError) else unavailable(str(exc))
    if isinstance(exc, NotRunning):
        return unavailable("no database is configured")
    if isinstance(exc, IdempotencyConflict):
        return Problem(409, "idempotency-conflict", "Idempotency conflict", str(exc), job_id=exc.job_id)
    if isinstance(exc, JobIdInvalid):
        return Problem(422, "invalid-job-id", "Invalid job id", str(exc))
    assert isinstance(exc, ConfigurationError)
    # A stage whose dedup key only the deployment's code computes (see conveyor.client.registry).
    return Problem(422, "not-submittable", "Stage cannot be submitted here", str(exc))


def _validation(exc: RequestValidationError) -> Problem:
    errors = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        # Never the input (a payload's values): only where and what.
        errors.append({"field": loc or "body", "message": str(err.get("msg", "invalid"))})
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5]) or "the request is invalid"
    return Problem(422, "invalid-request", "Invalid request", detail, errors=errors)


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` with a problem document."""

    async def on_problem(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, Problem)
        return problem_response(request, exc)

    async def on_conveyor(request: Request, exc: Exception) -> JSONResponse:
        return problem_response(request, _from_conveyor(exc))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return problem_response(request, _validation(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        title = HTTPStatus(exc.status_code).phrase
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail != title else None
        problem = Problem(exc.status_code, None, title, detail, headers=exc.headers)
        return problem_response(request, problem)

    async def on_database(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, DataError):
            return problem_response(request, invalid_value(exc))
        log.warning("database unavailable: %s", describe(exc))
        if _missing_table(exc):
            return problem_response(request, unavailable(NOT_MIGRATED))
        return problem_response(request, unavailable("the database did not answer; try again"))

    async def on_anything(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
        return problem_response(request, Problem(500, None, "Internal Server Error"))

    app.add_exception_handler(Problem, on_problem)
    kinds = (UnknownStage, PayloadInvalid, SubmitFailed, NotRunning, ConfigurationError)
    for kind in (*kinds, IdempotencyConflict, JobIdInvalid):
        app.add_exception_handler(kind, on_conveyor)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(DBAPIError, on_database)
    app.add_exception_handler(PoolTimeout, on_database)
    app.add_exception_handler(Exception, on_anything)


# RFC 9110's words (Python's HTTPStatus phrases differ between versions).
DESCRIPTIONS = {
    400: "Bad Request: the body could not be parsed (not UTF-8 text, say)",
    401: "Unauthorized: no token, or not a live one",
    403: "Forbidden: the token lacks the scope",
    404: "Not Found (another owner's too)",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    503: "Service Unavailable: the database did not answer",
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for problem statuses (``application/problem+json``)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {
            "model": ProblemDetail,
            "description": DESCRIPTIONS[status],
            "content": {MEDIA_TYPE: {}},
        }
    return out


__all__ = [
    "DESCRIPTIONS",
    "MEDIA_TYPE",
    "FieldError",
    "Problem",
    "ProblemDetail",
    "install",
    "problem_response",
    "responses",
]
