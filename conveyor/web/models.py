"""The JSON documents of the HTTP API: what a request sends and what a job looks like."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict

from conveyor.client.handle import JobEvent
from conveyor.client.owners import callers_key
from conveyor.store.claims import counted_attempts
from conveyor.store.db.schema import Row
from conveyor.store.jobs import MAX_SECONDS

TEN_YEARS = MAX_SECONDS  # bounds on relative times: what a submit takes (conveyor.store.jobs)

# Request bodies are strict (their JSON types are the document's: no `"priority": false`, no
# `"dedup": 0`), but for date-times, which JSON carries as text: ISO 8601 text only, never a
# number of seconds (pydantic's lax mode reads 5 and "5" as 1970-01-01T00:00:05Z).
STRICT = ConfigDict(extra="forbid", strict=True)


def _iso_text(value: Any) -> Any:
    if isinstance(value, str) and not value.strip().lstrip("+-").replace(".", "", 1).isdigit():
        return value
    if isinstance(value, dt.datetime):
        return value
    raise ValueError("Input should be an ISO 8601 date-time string")


DateTime = Annotated[dt.datetime, Strict(False), BeforeValidator(_iso_text)]


class SubmitRequest(BaseModel):
    """A job to submit by stage name (the options of :meth:`conveyor.Client.submit`)."""

    model_config = STRICT

    stage: str = Field(min_length=1, max_length=200, examples=["conveyor.demo.square"])
    payload: dict[str, Any] = Field(
        default_factory=dict, description="checked against the stage's JSON Schema", examples=[{"n": 7}]
    )
    idempotency_key: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="a key seen before (for this owner) returns the job it made, whatever the payload",
    )
    job_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,36}$",
        description="the job's id (a UUID fits); a job of that id already recorded is returned "
        "(200, deduplicated), or 409 idempotency-conflict for a strict stage when it holds "
        "another stage or payload",
    )
    delay: float = Field(0.0, ge=0, le=TEN_YEARS, description="seconds from now (the database's clock)")
    run_at: DateTime | None = Field(None, description="when to run it (naive means UTC); wins over delay")
    expires_in: float | None = Field(
        None, gt=0, le=TEN_YEARS, description="seconds after which it is not run any more"
    )
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1, description="default: the stage's")
    label: str | None = Field(None, max_length=200, description="a short label for people (no PII)")
    max_attempts: int | None = Field(None, ge=1, le=1000, description="default: the stage's")
    dedup: bool = Field(True, description="false turns the stage's declared dedup policy off")
    reuse: Literal["never", "if_failed", "always"] = Field(
        "never", description="for a stage deduplicating by id: when a finished job's id is reused"
    )


class CancelRequest(BaseModel):
    """Why a job is cancelled (recorded with it)."""

    model_config = STRICT

    reason: str | None = Field(None, max_length=500)


class Attempts(BaseModel):
    """A job's attempts: ``counted`` ones spend its budget (``max``); ``uncounted`` ones
    were cut short by an outage, a shutdown or a preemption (``requeued``: by an outage or
    a shutdown) and do not. ``claims`` is every start (counted + uncounted)."""

    counted: int
    uncounted: int
    requeued: int
    claims: int
    max: int


class JobError(BaseModel):
    """Why a job failed (its last error), scrubbed of secrets."""

    type: str | None
    message: str | None


class Cancellation(BaseModel):
    """A cancel request: when, by whom (a token id, ``cli@host``, ...), why."""

    requested_at: dt.datetime | None
    by: str | None
    reason: str | None


class Event(BaseModel):
    """One event of the job's outbox, in commit order."""

    id: int
    topic: str
    body: dict[str, Any]
    position: str


class Job(BaseModel):
    """A job: its state, attempts, progress, and result or error."""

    id: str
    stage: str
    queue: str
    status: str = Field(
        description="queued, running, retrying, throttled, waiting_lease, waiting_dedup; "
        "terminal: succeeded, dead, cancelled, expired, skipped"
    )
    owner: str | None
    label: str | None
    priority: int
    idempotency_key: str | None
    attempts: Attempts
    progress: Any = None
    result: Any = Field(None, description="a succeeded (or skipped) job's result")
    error: JobError | None = Field(
        None, description="the last failure (kept by a job that succeeded on a retry)"
    )
    cancel: Cancellation | None = None
    created_at: dt.datetime
    updated_at: dt.datetime
    run_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    expires_at: dt.datetime | None

    @classmethod
    def from_row(cls, row: Row) -> Job:
        """The view of a ``jobs`` row."""
        failed = row["error_type"] is not None or row["last_error"] is not None
        cancelled = row["cancel_requested_at"] is not None or row["cancelled_by"] is not None
        return cls(
            id=row["id"],
            stage=row["stage"],
            queue=row["queue"],
            status=row["status"],
            owner=row["owner"],
            label=row["label"],
            priority=row["priority"],
            idempotency_key=callers_key(row["owner"], row["idempotency_key"]),
            attempts=Attempts(
                counted=counted_attempts(row),
                uncounted=int(row["uncounted"] or 0),
                requeued=int(row["requeues"] or 0),
                claims=int(row["attempts"]),
                max=int(row["max_attempts"]),
            ),
            progress=row["progress"],
            result=row["result"],
            error=JobError(type=row["error_type"], message=row["last_error"]) if failed else None,
            cancel=Cancellation(
                requested_at=row["cancel_requested_at"], by=row["cancelled_by"], reason=row["cancel_reason"]
            )
            if cancelled
            else None,
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            run_at=row["run_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            expires_at=row["expires_at"],
        )


class SubmittedJob(Job):
    """The job a submit made, or (``deduplicated``) the existing one it returned."""

    deduplicated: bool = Field(
        description="true: an existing job was returned (same idempotency key, or the stage's dedup "
        "policy); nothing new was submitted"
    )


class JobDetail(Job):
    """A job with its events (up to 500 after ``events_since``; page on with ``events_cursor``)."""

    events: list[Event]
    events_cursor: str | None = Field(description="pass as events_since to read the events after these")


def events_of(found: list[JobEvent]) -> list[Event]:
    """The API's view of a handle's events."""
    return [Event(id=e.id, topic=e.topic, body=e.body, position=e.position) for e in found]


__all__ = [
    "STRICT",
    "CancelRequest",
    "DateTime",
    "Event",
    "Job",
    "JobDetail",
    "SubmitRequest",
    "SubmittedJob",
    "events_of",
]
