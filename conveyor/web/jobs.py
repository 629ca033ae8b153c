"""``/jobs``: submit by stage name, show, cancel.

Each request goes through the same :class:`conveyor.Client` an app uses: the same stage
registry check, dedup and idempotency. A job belongs to the owner of the token that
submitted it; another owner's job is answered 404, as if it did not exist, unless the
token is ``admin``. An idempotency key is the owner's own (:mod:`conveyor.client.owners`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Query, Request, Response

from conveyor import tracing
from conveyor.client.by_name import Client
from conveyor.client.handle import JobHandle
from conveyor.errors import IdempotencyConflict
from conveyor.store.db.schema import TERMINAL, Row
from conveyor.web.auth import Caller, Reader, Submitter, client_of
from conveyor.web.limits import held_limit
from conveyor.web.links import job_links
from conveyor.web.models import CancelRequest, JobDetail, SubmitRequest, SubmittedJob, events_of
from conveyor.web.models import Job as JobView
from conveyor.web.problems import Problem, duplicate_of_another_owner, responses

router = APIRouter(prefix="/jobs", tags=["jobs"])

JobId = Annotated[str, Path(min_length=1, max_length=64, description="the job's id")]
AUTH = (401, 403)


def _not_found(job_id: str) -> Problem:
    return Problem(404, "not-found", "Not Found", f"no job {job_id}")


def _visible_row(handle: JobHandle, caller: Caller) -> Row:
    """The job's row, if it exists and ``caller`` may see it (else 404, either way)."""
    try:
        row = handle.row()
    except LookupError:
        raise _not_found(handle.id) from None
    if not caller.sees(row["owner"]):
        raise _not_found(handle.id)
    return row


@router.post(
    "",
    status_code=201,
    operation_id="submitJob",
    response_model=SubmittedJob,
    summary="Submit a job by stage name",
    description="Scope `submit`. 201 with the new job; 200 with the existing one when the submit "
    "was deduplicated (the same job_id or idempotency key, or the stage's dedup policy); 409 "
    "`idempotency-conflict` when a stage declared strict finds another request under that id "
    "or key. The job's owner is the token's.",
    responses={
        201: {"links": job_links("/id", "GetJob", "CancelJob", "JobEvents")},
        200: {
            "model": SubmittedJob,
            "description": "deduplicated: the existing job",
            "links": job_links("/id", "GetJob", "CancelJob", "JobEvents"),
        },
        **responses(*AUTH, 409, 413, 422, 503),
    },
)
def submit(request: Request, response: Response, caller: Submitter, body: SubmitRequest) -> SubmittedJob:
    """Submit a job of ``body.stage`` for the caller's owner."""
    client = client_of(request)
    # A caller that sends a W3C trace context gets the job in its trace.
    incoming = {k: request.headers[k] for k in ("traceparent", "tracestate") if k in request.headers}
    with tracing.attached(incoming):
        try:
            handle = _submit(client, body, caller)
        except IdempotencyConflict as exc:
            if not caller.sees(client.job(exc.job_id).row()["owner"]):
                raise _taken_by_another_owner() from None
            raise
    row = handle.row()
    if handle.deduplicated and not caller.sees(row["owner"]):
        # The stage's dedup policy, or a job_id, found a job of someone else: not this
        # caller's to see.
        raise _taken_by_another_owner()
    response.headers["Location"] = f"{request.scope.get('root_path', '')}/jobs/{handle.id}"
    if handle.deduplicated:
        response.status_code = 200
    return SubmittedJob(**JobView.from_row(row).model_dump(), deduplicated=handle.deduplicated)


def _taken_by_another_owner() -> Problem:
    return duplicate_of_another_owner(
        "a job of another owner holds this job_id or the stage's dedup key; nothing was submitted"
    )


def _submit(client: Client, body: SubmitRequest, caller: Caller) -> JobHandle:
    return client.submit(
        body.stage,
        body.payload,
        idempotency_key=body.idempotency_key,
        job_id=body.job_id,
        delay=body.delay,
        run_at=body.run_at,
        expires_in=body.expires_in,
        priority=body.priority,
        label=body.label,
        max_attempts=body.max_attempts,
        dedup=None if body.dedup else False,
        reuse=body.reuse,
        owner=caller.owner,
    )


@router.get(
    "/{job_id}",
    response_model=JobDetail,
    operation_id="getJob",
    summary="Show a job and its events",
    description="Scope `read`. Another owner's job is 404 unless the token is `admin`. With "
    "`wait=S`, answers when the job is terminal or after S seconds, whichever comes first (the job "
    "as it is then either way; 503 `busy` when the server holds its most waits and streams open).",
    responses={200: {"links": job_links("/id", "CancelJob", "JobEvents")}, **responses(*AUTH, 404, 503)},
)
def show(
    request: Request,
    caller: Reader,
    job_id: JobId,
    events_since: Annotated[
        str | None, Query(max_length=100, description="an events_cursor from an earlier answer")
    ] = None,
    wait: Annotated[
        float | None, Query(ge=0, le=30, description="seconds to wait for the job to be terminal")
    ] = None,
) -> JobDetail:
    """The job's state, attempts, progress, result or error, and its events."""
    handle = client_of(request).job(job_id)
    row = _visible_row(handle, caller)
    if wait and row["status"] not in TERMINAL:
        held = held_limit(request.app).hold("a wait")
        try:
            handle.wait(timeout=wait)
        except TimeoutError:
            pass  # answered as it is now
        finally:
            held.release()
        row = handle.row()
    try:
        found, cursor = handle.events(since=events_since)
    except ValueError:
        detail = "events_since is not an events_cursor of this API"
        raise Problem(422, "invalid-cursor", "Invalid cursor", detail) from None
    return JobDetail(**JobView.from_row(row).model_dump(), events=events_of(found), events_cursor=cursor)


@router.post(
    "/{job_id}/cancel",
    response_model=JobView,
    operation_id="cancelJob",
    summary="Cancel a job",
    description="Scope `submit`. Idempotent: a queued, delayed or parked job ends `cancelled` at "
    "once; a running one is asked to stop (`cancel.requested_at` set; it ends `cancelled` at its "
    "next checkpoint); a finished job keeps its state. Returns the job as it is now.",
    responses={200: {"links": job_links("/id", "GetJob", "JobEvents")}, **responses(*AUTH, 404, 503)},
)
def cancel(
    request: Request,
    caller: Submitter,
    job_id: JobId,
    body: Annotated[CancelRequest | None, Body()] = None,
) -> JobView:
    """Cancel the job (or ask it to stop), recording the caller's token as who did."""
    client = client_of(request)
    handle = client.job(job_id)
    _visible_row(handle, caller)
    try:
        client.cancel(job_id, by=caller.name, reason=body.reason if body else None)
    except LookupError:
        raise _not_found(job_id) from None
    return JobView.from_row(handle.row())


__all__ = ["router"]
