"""``/dead-letters``: list (filtered, cursor-paged), show, retry one, retry all matching a
filter, purge.

Every endpoint needs the ``admin`` scope, listing included: an entry holds a traceback
and the message's headers, which say more than a job's owner is shown of it, and the
issue makes dead-letter actions an operator's. Another owner's entry is therefore never
hidden (an admin sees all), and an unknown id is 404.

A retry is the client's (:class:`conveyor.client.by_name.DeadLetters`): it runs only for a stage
whose registry row says it has no ``on_retry`` hook, since a hook is deployment code the
API does not have. Any other entry is answered 409 ``retry-needs-deployment`` and stays
open for ``conveyor dlq retry``: a skipped hook would leave what ``on_dead`` recorded in
place. The retry itself is the platform's (one transaction moves the job back to
``queued`` and closes the entry, guarded by its attempt count), so the job runs once.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy.engine import RowMapping

from conveyor.errors import RetryNeedsDeployment, RetryRefused
from conveyor.web import tokens
from conveyor.web.auth import Caller, client_of, requires
from conveyor.web.links import job_links, link
from conveyor.web.models import STRICT, DateTime
from conveyor.web.problems import Problem, responses

router = APIRouter(prefix="/dead-letters", tags=["dead-letters"])

Admin = Annotated[Caller, Depends(requires(tokens.ADMIN))]
EntryId = Annotated[int, Path(ge=1, le=2**63 - 1, description="the entry's id")]
AUTH = (401, 403)
CURSOR_PREFIX = "dl1:"


def _entry_links(pointer: str, *names: str) -> dict[str, dict[str, Any]]:
    """Links from the entry id at ``pointer`` to the entry operations named."""
    value = f"$response.body#{pointer}"
    every = {
        "GetDeadLetter": link("getDeadLetter", "the entry, with its traceback", entry_id=value),
        "RetryDeadLetter": link("retryDeadLetter", "retry the entry", entry_id=value),
    }
    return {name: every[name] for name in names}


class DeadLetter(BaseModel):
    """One dead-letter entry: which job died, where, and why."""

    id: int
    job_id: str | None
    stage: str | None
    queue: str | None
    label: str | None
    error_type: str
    message: str
    attempts: int
    created_at: dt.datetime
    retried_at: dt.datetime | None
    retried_by: str | None
    retry_requested_at: dt.datetime | None = Field(
        description="a retry asked of a worker (its stage has an on_retry hook), not yet performed"
    )
    retry_refused: str | None = Field(description="why a worker refused the last requested retry")

    @classmethod
    def from_row(cls, row: RowMapping) -> DeadLetter:
        """The view of a ``dead_letters`` row."""
        fields = cls.model_fields
        return cls(**{k: row[k] for k in fields})


class DeadLetterDetail(DeadLetter):
    """An entry with its traceback and the message's headers."""

    traceback: str | None
    headers: dict[str, Any] | None


class DeadLetterPage(BaseModel):
    """Entries newest first; ``next_cursor`` (with the same filters) reads the ones after."""

    items: list[DeadLetter]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null: no more")
    next: str | None = Field(description="the next page's path and query; null: no more")


class Filter(BaseModel):
    """Which entries: every given condition holds (open entries only, unless ``all`` says
    otherwise for a purge)."""

    model_config = STRICT

    stage: str | None = Field(None, min_length=1, max_length=200)
    queue: str | None = Field(None, min_length=1, max_length=100)
    since: DateTime | None = Field(None, description="created at or after (naive means UTC)")
    until: DateTime | None = Field(None, description="created before (naive means UTC)")

    def empty(self) -> bool:
        """Whether no condition is given."""
        return not (self.stage or self.queue or self.since or self.until)


class PurgeRequest(Filter):
    """Entries to delete (open and retried ones); an empty filter needs ``all: true``."""

    all: bool = Field(False, description="true: delete every entry when no condition is given")


class RetryAllRequest(Filter):
    """Open entries to retry; an empty filter needs ``all: true``."""

    all: bool = Field(False, description="true: retry every open entry when no condition is given")


def _refuse_empty(body: PurgeRequest | RetryAllRequest, action: str) -> None:
    """422 for a filter that names nothing without ``all: true`` (a slip, not a wish)."""
    if body.empty() and not body.all:
        detail = f"give stage, queue, since or until, or all: true to {action} every entry"
        raise Problem(422, "empty-filter", "Empty filter", detail)


class Retried(BaseModel):
    """What a retry-all did: the jobs sent back to ``queued``, and the entries refused."""

    retried: int
    job_ids: list[str]
    requested: list[int] = Field(
        description="entries whose stage has an on_retry hook: asked of a worker, which retries them "
        "on its next reconciling pass"
    )
    refused: list[str] = Field(description="why each refused entry stays open")


class RetriedOne(BaseModel):
    """The job a retry sent back to ``queued`` (200), or will (202, ``requested``)."""

    job_id: str
    entry_id: int
    requested: bool = Field(
        description="true: the stage has an on_retry hook, so a worker performs the retry on its "
        "next reconciling pass (watch the job, or the entry's retried_at and retry_refused)"
    )


class Purged(BaseModel):
    """How many entries a purge deleted."""

    purged: int


def _utc(when: dt.datetime | None) -> dt.datetime | None:
    return when.replace(tzinfo=dt.UTC) if when is not None and when.tzinfo is None else when


def _cursor(entry_id: int) -> str:
    return base64.urlsafe_b64encode(f"{CURSOR_PREFIX}{entry_id}".encode()).decode().rstrip("=")


def _before(cursor: str | None) -> int | None:
    """The id a cursor pages below (422 for anything not made by :func:`_cursor`)."""
    if cursor is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if raw.startswith(CURSOR_PREFIX) and raw[len(CURSOR_PREFIX) :].isdigit():
            return int(raw[len(CURSOR_PREFIX) :])
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise Problem(422, "invalid-cursor", "Invalid cursor", "cursor is not a cursor of this API")


def _not_found(entry_id: int) -> Problem:
    return Problem(404, "not-found", "Not Found", f"no dead-letter entry {entry_id}")


@router.get(
    "",
    response_model=DeadLetterPage,
    operation_id="listDeadLetters",
    summary="List dead-letter entries",
    description="Scope `admin`. Open entries (not yet retried) newest first, filtered by stage, "
    "queue and creation time; page on with `cursor` (entries added meanwhile never repeat nor "
    "shift a page).",
    responses={
        200: {"links": _entry_links("/items/0/id", "GetDeadLetter", "RetryDeadLetter")},
        **responses(*AUTH, 422, 503),
    },
)
def list_entries(
    request: Request,
    caller: Admin,
    stage: Annotated[str | None, Query(max_length=200)] = None,
    queue: Annotated[str | None, Query(max_length=100)] = None,
    since: Annotated[DateTime | None, Query(description="created at or after (naive: UTC)")] = None,
    until: Annotated[DateTime | None, Query(description="created before (naive: UTC)")] = None,
    include_retried: bool = False,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=100, description="a next_cursor")] = None,
) -> DeadLetterPage:
    """One page of entries matching the filters."""
    rows = client_of(request).dlq.scan(
        stage=stage,
        queue=queue,
        since=_utc(since),
        until=_utc(until),
        include_retried=include_retried,
        before=_before(cursor),
        limit=limit + 1,  # one more says whether there is a next page
    )
    items = [DeadLetter.from_row(r) for r in rows[:limit]]
    if len(rows) <= limit:
        return DeadLetterPage(items=items, next_cursor=None, next=None)
    token = _cursor(items[-1].id)
    query = request.url.include_query_params(cursor=token).query
    # The request's whole path: a mounted API's prefix (root_path) is already in it.
    return DeadLetterPage(items=items, next_cursor=token, next=f"{request.url.path}?{query}")


@router.get(
    "/{entry_id:int}",
    response_model=DeadLetterDetail,
    operation_id="getDeadLetter",
    summary="Show a dead-letter entry",
    description="Scope `admin`. The entry with its traceback and headers.",
    responses={200: {"links": _entry_links("/id", "RetryDeadLetter")}, **responses(*AUTH, 404, 503)},
)
def show(request: Request, caller: Admin, entry_id: EntryId) -> DeadLetterDetail:
    """One entry, open or retried."""
    row = client_of(request).dlq.show(entry_id)
    if row is None:
        raise _not_found(entry_id)
    return DeadLetterDetail(
        **DeadLetter.from_row(row).model_dump(), traceback=row["traceback"], headers=row["headers"]
    )


@router.post(
    "/retry",
    response_model=Retried,
    operation_id="retryDeadLetters",
    summary="Retry every open entry matching a filter",
    description="Scope `admin`. An empty filter is refused (422) unless `all` is true. Entries of "
    "stages with an `on_retry` hook are asked of a worker (listed in `requested`); those whose dedup "
    "id a submit would find held by another job are refused and stay open (listed in `refused`).",
    responses={200: {"links": job_links("/job_ids/0", "GetJob")}, **responses(*AUTH, 422, 503)},
)
def retry_all(request: Request, caller: Admin, body: RetryAllRequest) -> Retried:
    """Retry the matching entries, as the caller's token."""
    _refuse_empty(body, "retry")
    refused: list[RetryRefused] = []
    requested: list[int] = []
    ids = client_of(request).dlq.retry_all(
        stage=body.stage,
        queue=body.queue,
        since=_utc(body.since),
        until=_utc(body.until),
        by=caller.name,
        refused=refused,
        requested=requested,
    )
    return Retried(retried=len(ids), job_ids=ids, requested=requested, refused=[str(e) for e in refused])


@router.post(
    "/purge",
    response_model=Purged,
    operation_id="purgeDeadLetters",
    summary="Delete the entries matching a filter",
    description="Scope `admin`. Deletes open and retried entries alike (their jobs stay `dead`). "
    "An empty filter is refused (422) unless `all` is true.",
    responses=responses(*AUTH, 422, 503),
)
def purge(request: Request, caller: Admin, body: PurgeRequest) -> Purged:
    """Delete the matching entries."""
    _refuse_empty(body, "delete")
    n = client_of(request).dlq.purge(
        stage=body.stage, queue=body.queue, since=_utc(body.since), until=_utc(body.until)
    )
    return Purged(purged=n)


@router.post(
    "/{entry_id:int}/retry",
    response_model=RetriedOne,
    operation_id="retryDeadLetter",
    summary="Retry one entry",
    description="Scope `admin`. Sends the job back to `queued` with a fresh attempt budget and "
    "closes the entry (200). When its stage has an `on_retry` hook (deployment code), the retry is "
    "asked of a worker instead (202, `requested`), which performs it on its next reconciling pass "
    "or records why not in the entry's `retry_refused`. 409 when the entry is already retried or "
    "its job is not dead, or when a submit of the job would now be deduplicated into another job "
    "(the detail names it).",
    responses={
        200: {"links": {**job_links("/job_id", "GetJob"), **_entry_links("/entry_id", "GetDeadLetter")}},
        202: {
            "model": RetriedOne,
            "description": "asked of a worker",
            "links": {**job_links("/job_id", "GetJob"), **_entry_links("/entry_id", "GetDeadLetter")},
        },
        **responses(*AUTH, 404, 409, 503),
    },
)
def retry(request: Request, response: Response, caller: Admin, entry_id: EntryId) -> RetriedOne:
    """Retry one entry, as the caller's token (or ask a worker to, for a stage with a hook)."""
    dlq = client_of(request).dlq
    row = dlq.show(entry_id)
    if row is None:
        raise _not_found(entry_id)
    try:
        job_id = dlq.retry(entry_id, by=caller.name)
    except RetryNeedsDeployment:
        if dlq.request_retry(entry_id, by=caller.name):
            response.status_code = 202
            return RetriedOne(job_id=row["job_id"], entry_id=entry_id, requested=True)
        job_id = None
    except RetryRefused as exc:
        raise Problem(409, "retry-refused", "Retry refused", str(exc)) from None
    if job_id is None:
        detail = f"entry {entry_id} is already retried, or its job is not dead"
        raise Problem(409, "not-retryable", "Not retryable", detail)
    return RetriedOne(job_id=job_id, entry_id=entry_id, requested=False)


__all__ = ["router"]
