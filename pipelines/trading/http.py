"""The trading family over HTTP: submit imports and scores, connect a broker, a user's standing.

``conveyor serve`` adds this router to the API (``HTTP_EXTENSIONS`` in
``config/celery_app.py``). Bodies carry the seed's field names (``userId``, ``sinceIso``,
``broker``), so a Node producer posts them unchanged. ``POST /trading/imports`` and
``POST /trading/scores`` (scope ``submit``) answer 202 with the job: the same submit while
that job is pending is that job (``deduplicated: true``). A payload of the wrong shape is
422 naming the field, nothing recorded. Jobs belong to the token's owner (a duplicate of
another owner's job is 409). ``PUT /trading/users/{userId}/connections/{broker}`` keeps a
broker token, encrypted, and never answers it back. A user belongs to the owner whose token
first connected them: another owner's submits, connections and reads for that user are
404, as for a user never seen (an admin acts for any user).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.errors import ConfigurationError, PayloadInvalid
from conveyor.platform import Platform
from conveyor.web.auth import Caller, Reader, Submitter
from conveyor.web.links import job_links
from conveyor.web.problems import Problem, duplicate_of_another_owner, responses
from pipelines.trading.jobs import (
    UserOfAnotherOwner,
    check_user,
    connect_broker,
    ensure_owner,
    list_trades,
    submit_import,
    submit_score,
    user_status,
)
from tasks.trading.models import USER_ID_PATTERN, ImportJob, ScoreJob

router = APIRouter(tags=["trading"])
AUTH = (401, 403)
Broker = Literal["coinbase", "binance"]
UserId = Annotated[
    str,
    Path(min_length=1, max_length=64, pattern=USER_ID_PATTERN, description="the user's id, never an e-mail"),
]


class BrokerConnection(BaseModel):
    """A broker token (kept encrypted; never shown again)."""

    model_config = ConfigDict(extra="forbid")

    token: str = Field(min_length=1, max_length=4096, pattern=r"^\S+$", description="the broker's API token")


class SubmittedTradingJob(BaseModel):
    """The job a submit made, or (``deduplicated``) the pending one it returned."""

    job_id: str
    status: str
    deduplicated: bool


class TradingStanding(BaseModel):
    """One user's trading standing."""

    userId: str
    brokers: list[str] = Field(description="the brokers the user connected")
    trades: int = Field(description="trades stored")
    rejected: int = Field(description="broker rows refused (malformed)")
    tags: int = Field(description="bias tags")
    reflect_events: int = Field(description="coach.reflect events emitted")


def _platform() -> Platform:
    from config.celery_app import platform

    return platform


def _owner_of(platform: Platform, job_id: str) -> str | None:
    try:
        owner = platform.job(job_id).row()["owner"]
    except LookupError:
        return None
    return None if owner is None else str(owner)


def _refused(exc: PayloadInvalid, where: str) -> Problem:
    """422 naming the field: the family's checks say ``field: what`` (never the value)."""
    text = str(exc).removeprefix("invalid payload for ")
    text = text.split(": ", 1)[1] if text.startswith("conveyor.") and ": " in text else text
    errors = []
    for part in text.split("; "):
        field, sep, message = part.partition(": ")
        errors.append({"field": f"{where}.{field}" if sep else where, "message": message if sep else part})
    return Problem(422, "invalid-payload", "Invalid payload", str(exc), errors=errors)


def _acting_as(caller: Caller) -> str | None:
    """The owner whose users this caller may act for (None: an admin, any user)."""
    return None if caller.token.admin else caller.owner


def _not_yours(user_id: str) -> Problem:
    return Problem(404, "not-found", "Not found", f"no trading user {user_id}")


def _submitted(
    request: Request, response: Response, caller: Caller, user_id: str, submit: Any
) -> SubmittedTradingJob:
    platform = _platform()
    try:
        ensure_owner(platform, user_id, _acting_as(caller))
        handle = submit(platform)
    except UserOfAnotherOwner:
        raise _not_yours(user_id) from None
    except PayloadInvalid as exc:
        raise _refused(exc, "body") from None
    if handle.deduplicated and not caller.sees(_owner_of(platform, handle.id)):
        raise duplicate_of_another_owner(
            "a pending job of another owner holds this submit's key; nothing was submitted"
        )
    response.headers["Location"] = f"{request.scope.get('root_path', '')}/jobs/{handle.id}"
    return SubmittedTradingJob(job_id=handle.id, status=handle.status(), deduplicated=handle.deduplicated)


_SUBMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {"links": job_links("/job_id", "GetJob", "CancelJob", "JobEvents")},
    **responses(*AUTH, 404, 409, 422, 503),
}


@router.post(
    "/trading/imports",
    status_code=202,
    response_model=SubmittedTradingJob,
    operation_id="submitTradingImport",
    summary="Import a user's broker trades",
    description="Scope `submit`. 202 with the job (`conveyor.trading.import_trades`; a score "
    "follows it). The same `userId`, `sinceIso` and `broker` while that import is pending: the "
    "pending job, `deduplicated: true`. 422 naming the field of a bad payload, nothing recorded; "
    "404 for a user another owner connected.",
    responses=_SUBMIT_RESPONSES,
)
def submit_import_job(
    request: Request, response: Response, caller: Submitter, body: ImportJob
) -> SubmittedTradingJob:
    """Submit an import for the caller's owner."""
    return _submitted(
        request,
        response,
        caller,
        body.userId,
        lambda platform: submit_import(
            platform, body.userId, since=body.sinceIso, broker=body.broker, owner=caller.owner
        ),
    )


@router.post(
    "/trading/scores",
    status_code=202,
    response_model=SubmittedTradingJob,
    operation_id="submitTradingScore",
    summary="Score a user's trades",
    description="Scope `submit`. 202 with the job (`conveyor.trading.score_bias`): bias tags "
    "and one `coach.reflect` event per trade. The same `userId` and `sinceIso` while that score "
    "is pending: the pending job, `deduplicated: true`. 422 naming the field of a bad payload; "
    "404 for a user another owner connected.",
    responses=_SUBMIT_RESPONSES,
)
def submit_score_job(
    request: Request, response: Response, caller: Submitter, body: ScoreJob
) -> SubmittedTradingJob:
    """Submit a score for the caller's owner."""
    return _submitted(
        request,
        response,
        caller,
        body.userId,
        lambda platform: submit_score(platform, body.userId, since=body.sinceIso, owner=caller.owner),
    )


@router.put(
    "/trading/users/{userId}/connections/{broker}",
    status_code=204,
    response_class=Response,
    operation_id="connectTradingBroker",
    summary="Connect a user's broker",
    description="Scope `submit`. Keep (or replace) the user's token for the broker, encrypted; "
    "204, the token never answered back. 422 naming the field of a bad value; 404 for a user "
    "another owner connected.",
    responses=responses(*AUTH, 404, 422, 503),
)
def connect(
    caller: Submitter,
    body: BrokerConnection,
    userId: UserId,  # the seed's name, as in the bodies
    broker: Annotated[Broker, Path(description="coinbase or binance")],
) -> Response:
    """Store the token."""
    try:
        connect_broker(_platform(), userId, broker, body.token, owner=_acting_as(caller))
    except UserOfAnotherOwner:
        raise _not_yours(userId) from None
    except PayloadInvalid as exc:
        where = "body" if str(exc).startswith("token") else "path"
        raise _refused(exc, where) from None
    except ConfigurationError as exc:  # a token_key that is no Fernet key: the operator's to fix
        raise Problem(503, "not-configured", "Service unavailable", str(exc)) from None
    return Response(status_code=204)


@router.get(
    "/trading/users/{userId}",
    response_model=TradingStanding,
    operation_id="getTradingUser",
    summary="A user's trading standing",
    description="Scope `read`. The brokers connected, trades stored, rows rejected, bias tags "
    "and `coach.reflect` events of the user (zeros for a user not seen; 404 for a user another "
    "owner connected).",
    responses=responses(*AUTH, 404, 422, 503),
)
def standing(caller: Reader, userId: UserId) -> TradingStanding:
    """The user's counts."""
    try:
        platform = _platform()
        ensure_owner(platform, check_user(userId), _acting_as(caller))
        return TradingStanding(**user_status(platform, userId))
    except UserOfAnotherOwner:
        raise _not_yours(userId) from None
    except PayloadInvalid as exc:
        raise _refused(exc, "path") from None


class StoredTrade(BaseModel):
    """A stored trade: its ``tradeId`` (what a sim takes) and its bias labels."""

    tradeId: str
    broker: str
    symbol: str
    side: str
    qty: str
    price: str
    ts: str
    labels: list[str] = Field(description="bias labels, most confident first")


@router.get(
    "/trading/users/{userId}/trades",
    response_model=list[StoredTrade],
    operation_id="listTradingTrades",
    summary="A user's stored trades",
    description="Scope `read`. The newest first, with each trade's `tradeId` (the id a sim "
    "takes) and bias labels. 404 for a user another owner connected.",
    responses=responses(*AUTH, 404, 422, 503),
)
def user_trades(
    caller: Reader,
    userId: UserId,
    limit: Annotated[int, Query(ge=1, le=1000, description="how many, newest first")] = 50,
) -> list[StoredTrade]:
    """The user's trades."""
    try:
        platform = _platform()
        ensure_owner(platform, check_user(userId), _acting_as(caller))
        return [StoredTrade(**row) for row in list_trades(platform, userId, limit=limit)]
    except UserOfAnotherOwner:
        raise _not_yours(userId) from None
    except PayloadInvalid as exc:
        raise _refused(exc, "path") from None
