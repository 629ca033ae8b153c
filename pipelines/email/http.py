"""The email family over HTTP: send a message, show it, settle an unknown one.

``conveyor serve`` adds this router to the API (``HTTP_EXTENSIONS`` in
``config/celery_app.py``). ``POST /email/messages`` (scope ``submit``) takes the seed's
``EmailSendJobData`` fields, with ``html`` (stored; its sha256 becomes ``htmlRef``) or
``htmlRef``, and the seed's ``priority`` and ``delay``: 201 with the outbox id, 200 when the
same outboxId and message were sent before, 409 ``idempotency-conflict`` for another
message under that outboxId, 422 for an invalid one (nothing recorded either way). A
message belongs to the token's owner (its job's); another owner's is 404 unless admin.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.errors import IdempotencyConflict
from conveyor.platform import Platform
from conveyor.web import tokens
from conveyor.web.auth import Caller, Reader, Submitter, requires
from conveyor.web.problems import Problem, duplicate_of_another_owner, responses
from pipelines.email.messages import NotResolvable, resolve, send_email, show_message

router = APIRouter(tags=["email"])
AUTH = (401, 403)
HTML_MAX = 100_000  # characters of HTML: Gmail clips a message over 102 KB; within the 320 KiB body limit
_PLAIN_ID = re.compile(r"[A-Za-z0-9_.-]{1,36}")
Admin = Annotated[Caller, Depends(requires(tokens.ADMIN))]
OutboxId = Annotated[str, Path(min_length=1, max_length=36, description="the message's outboxId")]


class NewMessage(BaseModel):
    """A message: the seed's ``EmailSendJobData`` (checked as the stage checks it), the HTML
    or a reference to it, and the seed's job options."""

    model_config = ConfigDict(extra="allow")  # the payload's own fields, checked by its model

    html: str | None = Field(None, max_length=HTML_MAX, description="the HTML body (else htmlRef)")
    priority: int = Field(5, ge=1, le=10, description="the seed's: 1 first ... 10 last")
    delay: float = Field(0.0, ge=0, lt=86400, description="seconds before it is sent (under its 24 h expiry)")


class SentMessage(BaseModel):
    """A message recorded (or found): its outbox id, which is its job's id."""

    outbox_id: str
    job_id: str
    status: str
    deduplicated: bool


class MessageView(BaseModel):
    """One outbox row and its job, addresses masked (``u***@e***.com``)."""

    outbox_id: str
    company_id: str
    status: Literal["PENDING", "SENDING", "SENT", "FAILED", "UNKNOWN", "EXPIRED"]
    to: str
    message_id: str
    provider: str | None
    provider_message_id: str | None
    attempts: int
    refused: list[str]
    last_error: str | None
    duration_ms: int | None
    job_id: str
    job_status: str | None


class Resolution(BaseModel):
    """How an ``UNKNOWN`` message is settled."""

    model_config = ConfigDict(extra="forbid")

    delivered: bool = Field(
        description="true: it arrived, record SENT and send nothing; false: send it again"
    )


def _platform() -> Platform:
    from config.celery_app import platform

    return platform


def _owner_of(platform: Platform, job_id: str) -> str | None:
    try:
        owner = platform.job(job_id).row()["owner"]
    except LookupError:
        return None
    return None if owner is None else str(owner)


def _another_owners() -> Problem:
    return duplicate_of_another_owner(
        "this outboxId belongs to another owner's message; nothing was recorded"
    )


def _visible(platform: Platform, caller: Caller, outbox_id: str) -> dict[str, Any]:
    row = show_message(platform, outbox_id) if _PLAIN_ID.fullmatch(outbox_id) else None
    if row is None or not caller.sees(_owner_of(platform, outbox_id)):
        raise Problem(404, "not-found", "Not Found", "no such message")
    return row


@router.post(
    "/email/messages",
    status_code=201,
    response_model=SentMessage,
    operation_id="sendEmail",
    summary="Send a message through the outbox",
    description="Scope `submit`. 201 with the outbox id (the job's id); 200 when this outboxId "
    "was sent before with the same message; 409 `idempotency-conflict` when it holds another; "
    "422 for an invalid message. Nothing is recorded unless 201.",
    responses=responses(*AUTH, 409, 422, 503),
)
def send(request: Request, response: Response, caller: Submitter, body: NewMessage) -> SentMessage:
    """Record the message and its job for the caller's owner."""
    data = dict(body.model_extra or {})
    platform = _platform()
    try:
        sent = send_email(
            platform, data, html=body.html, priority=body.priority, delay=body.delay, owner=caller.owner
        )
    except IdempotencyConflict as exc:
        if not caller.sees(_owner_of(platform, exc.job_id)):
            raise _another_owners() from None
        raise
    if sent.deduplicated and not caller.sees(_owner_of(platform, sent.job_id)):
        raise _another_owners()
    response.headers["Location"] = f"{request.scope.get('root_path', '')}/email/messages/{sent.outbox_id}"
    if sent.deduplicated:
        response.status_code = 200
    return SentMessage(**sent.as_dict())


@router.get(
    "/email/messages/{outbox_id}",
    response_model=MessageView,
    operation_id="getEmail",
    summary="Show a message",
    description="Scope `read`. The outbox row and its job's status, addresses masked. Another "
    "owner's message is 404 unless the token is `admin`.",
    responses=responses(*AUTH, 404, 503),
)
def show(caller: Reader, outbox_id: OutboxId) -> MessageView:
    """One message."""
    return MessageView(**_visible(_platform(), caller, outbox_id))


@router.post(
    "/email/messages/{outbox_id}/resolve",
    response_model=MessageView,
    operation_id="resolveEmail",
    summary="Settle a message whose delivery is unknown",
    description="Scope `admin`. Only an `UNKNOWN` message (409 otherwise): `delivered: true` "
    "records it SENT and closes its dead letter, sending nothing; `false` retries its dead letter "
    "(it is sent again, and may then arrive twice).",
    responses=responses(*AUTH, 404, 409, 422, 503),
)
def settle(caller: Admin, outbox_id: OutboxId, body: Resolution) -> MessageView:
    """Settle an UNKNOWN message."""
    platform = _platform()
    _visible(platform, caller, outbox_id)
    try:
        resolve(platform, outbox_id, delivered=body.delivered, by=f"http:{caller.owner}")
    except NotResolvable as exc:
        raise Problem(409, "not-resolvable", "Conflict", str(exc)) from None
    return MessageView(**_visible(platform, caller, outbox_id))
