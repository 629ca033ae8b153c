"""The publisher family over HTTP: schedule, list, show, edit, cancel, replay and test posts.

``conveyor serve`` adds this router to the API (``HTTP_EXTENSIONS`` in
``config/celery_app.py``). ``POST /publisher/jobs`` (scope ``submit``) takes a plan: 201
with the record, 200 (``existing: true``) when the same plan (or key) was scheduled before,
200 with the normalised document and nothing recorded for a ``preview``. A plan the family
refuses is 422 naming the field; a post that cannot change now is 409 (``post-not-pending``,
``post-not-failed``, ``idempotency-key-taken``). A post belongs to the token's owner;
another owner's is 404 unless admin. ``POST /publisher/jobs/test`` is the seed's: would a
post run then? It inserts nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from conveyor.platform import Platform
from conveyor.web.auth import Caller, Reader, Submitter
from conveyor.web.links import link
from conveyor.web.problems import Problem, duplicate_of_another_owner, responses
from pipelines.publisher.posts import (
    Plan,
    PostConflict,
    PostNotFound,
    cancel_post,
    check_post,
    edit_post,
    list_posts,
    replay_post,
    schedule_post,
    show_post,
)
from tasks.publisher import record
from tasks.publisher.plans import MAX_MEDIA, PlanInvalid

router = APIRouter(tags=["publisher"])
AUTH = (401, 403)
_PLAIN_ID = re.compile(r"[A-Za-z0-9_.-]{1,36}")
PostId = Annotated[str, Path(min_length=1, max_length=36, description="the post's id")]
Status = Literal["pending", "running", "completed", "failed", "cancelled"]
Placeholder = StrictStr | StrictInt | StrictFloat
Url = Annotated[str, Field(min_length=1, max_length=2000)]
TEMPLATE_MAX = 10_000  # characters of a caption template; the rendered caption is checked (2200)


class NewPost(BaseModel):
    """A post to schedule (the seed's plan). ``scheduled_at`` is ISO 8601 with an offset."""

    model_config = ConfigDict(extra="forbid")

    brand: str = Field(max_length=100)
    channel: str = Field(max_length=20, description="facebook or instagram")
    account: str = Field(max_length=100, description="the page or Instagram account")
    caption: str = Field("", max_length=TEMPLATE_MAX, description="text; {name} filled from placeholders")
    media: list[Url] = Field([], max_length=MAX_MEDIA, description="image or link URLs (Instagram: one+)")
    scheduled_at: str = Field(max_length=64, description="ISO 8601 with an offset (a past time runs now)")
    placeholders: dict[str, Placeholder] = Field({}, max_length=100)
    first_comment: str | None = Field(None, max_length=TEMPLATE_MAX, description="Instagram only")
    idempotency_key: str | None = Field(None, max_length=128, description="default: the seed's derived key")
    preview: bool = Field(False, description="normalise only: nothing is recorded or posted")


class PostChanges(BaseModel):
    """What to change in a pending post (its key is computed again)."""

    model_config = ConfigDict(extra="forbid")

    caption: str | None = Field(None, max_length=TEMPLATE_MAX)
    media: list[Url] | None = Field(None, max_length=MAX_MEDIA)
    scheduled_at: str | None = Field(None, max_length=64, description="ISO 8601 with an offset")
    placeholders: dict[str, Placeholder] | None = Field(None, max_length=100)


class PostCheck(BaseModel):
    """Would a post run at ``at``? (Give a caption or media to get its key.)"""

    model_config = ConfigDict(extra="forbid")

    channel: str = Field(max_length=20)
    account: str = Field(max_length=100)
    at: str = Field(max_length=64, description="ISO 8601 with an offset")
    brand: str = Field("", max_length=100)
    caption: str = Field("", max_length=TEMPLATE_MAX)
    media: list[Url] = Field([], max_length=MAX_MEDIA)


class PostPreview(BaseModel):
    """A plan normalised, as a UI shows it before anything is recorded."""

    preview: bool
    brand: str
    channel: str
    account: str
    caption: str
    media: list[str]
    scheduled_at: str
    first_comment: str | None
    idempotency_key: str


class ScheduledPost(BaseModel):
    """What scheduling did: the record (new or ``existing``), or a ``preview``."""

    id: str
    status: str
    idempotency_key: str
    job_id: str | None
    existing: bool
    preview: PostPreview | None = None


class PostView(BaseModel):
    """One post's record and its job's status."""

    id: str
    type: str
    parent_id: str | None
    brand: str
    channel: str
    account: str
    caption: str
    media: list[str]
    first_comment: str | None
    scheduled_at: str
    idempotency_key: str
    status: Status
    attempts: int
    job_id: str | None
    container_id: str | None
    remote_id: str | None
    last_error: str | None
    created_at: str | None
    updated_at: str | None
    completed_at: str | None
    job_status: str | None = None


class PostPage(BaseModel):
    """The newest posts, newest first."""

    items: list[PostView]


class BlackoutHeld(BaseModel):
    """The blackout window holding a time, and when it ends."""

    window: str
    until: str


class PostCheckResult(BaseModel):
    """The seed's ``/jobs/test``: whether a post would run at ``at``."""

    at: str
    idempotency_key: str | None
    existing: str | None = Field(description="the post already holding that key (yours)")
    blackout: BlackoutHeld | None
    channel_busy: bool
    account_busy: bool
    token: bool = Field(description="the account has a Graph token")
    would_run: bool


def _platform() -> Platform:
    from config.celery_app import platform

    return platform


def _owner_of(platform: Platform, post_id: str) -> tuple[bool, str | None]:
    """Whether the record exists, and its owner."""
    with platform.engine.connect() as conn:
        row = record.get(conn, post_id)
    if row is None:
        return False, None
    return True, None if row["owner"] is None else str(row["owner"])


def _not_found() -> Problem:
    # Never the id: a problem does not echo what the request sent.
    return Problem(404, "not-found", "Not Found", "no such post")


def _visible(platform: Platform, caller: Caller, post_id: str) -> None:
    """404 unless the post exists and the caller may see it."""
    found, owner = _owner_of(platform, post_id) if _PLAIN_ID.fullmatch(post_id) else (False, None)
    if not found or not caller.sees(owner):
        raise _not_found()


def _invalid(exc: PlanInvalid) -> Problem:
    message = str(exc).removeprefix(f"{exc.field}: ")
    return Problem(
        422,
        "invalid-plan",
        "Invalid plan",
        str(exc),
        errors=[{"field": f"body.{exc.field}", "message": message}],
    )


def _out_of_range(field: str) -> Problem:
    # Python's datetimes end at years 1 and 9999: a time at an edge overflows when moved.
    message = "the time is out of range (years 1-9999, a minute inside)"
    return Problem(
        422,
        "invalid-plan",
        "Invalid plan",
        f"{field}: {message}",
        errors=[{"field": f"body.{field}", "message": message}],
    )


def _conflict(exc: PostConflict) -> Problem:
    # Another owner's post may hold the key: its id is never said.
    detail = (
        "another post already has that plan; nothing changed"
        if exc.code == "idempotency-key-taken"
        else str(exc)
    )
    return Problem(409, exc.code, "Conflict", detail, code=exc.code)


def _post_links(pointer: str) -> dict[str, dict[str, Any]]:
    value = f"$response.body#{pointer}"
    return {
        "GetPost": link("getPublisherJob", "the post's record", post_id=value),
        "EditPost": link("editPublisherJob", "change the pending post", post_id=value),
        "CancelPost": link("cancelPublisherJob", "cancel the pending post", post_id=value),
        "ReplayPost": link("replayPublisherJob", "replay the failed post", post_id=value),
    }


@router.post(
    "/publisher/jobs",
    status_code=201,
    response_model=ScheduledPost,
    operation_id="schedulePublisherJob",
    summary="Schedule a post",
    description="Scope `submit`. 201 with the record (its job waits until `scheduled_at`); 200 "
    "with `existing: true` when the same plan (or `idempotency_key`) on that channel was "
    "scheduled before, unchanged; 200 with `preview` and nothing recorded when `preview`; 422 "
    "naming the field of a plan refused.",
    responses={
        200: {"links": _post_links("/id")},
        201: {"links": _post_links("/id")},
        **responses(*AUTH, 409, 422, 503),
    },
)
def schedule(request: Request, response: Response, caller: Submitter, body: NewPost) -> ScheduledPost:
    """Record the post and its job for the caller's owner."""
    platform = _platform()
    plan = Plan(
        brand=body.brand,
        channel=body.channel,
        account=body.account,
        caption=body.caption,
        scheduled_at=body.scheduled_at,
        media=tuple(body.media),
        placeholders=body.placeholders,
        first_comment=body.first_comment,
        idempotency_key=body.idempotency_key,
        preview=body.preview,
    )
    try:
        done = schedule_post(platform, plan, owner=caller.owner)
    except PlanInvalid as exc:
        raise _invalid(exc) from None
    except OverflowError:
        raise _out_of_range("scheduled_at") from None
    if done.preview is not None:
        response.status_code = 200
        return ScheduledPost(**done.as_dict())
    if done.existing:
        if not caller.sees(_owner_of(platform, done.id)[1]):
            raise duplicate_of_another_owner("another owner's post has this plan; nothing was recorded")
        response.status_code = 200
    response.headers["Location"] = f"{request.scope.get('root_path', '')}/publisher/jobs/{done.id}"
    return ScheduledPost(**done.as_dict())


@router.get(
    "/publisher/jobs",
    response_model=PostPage,
    operation_id="listPublisherJobs",
    summary="List posts",
    description="Scope `read`. The caller's newest posts (every owner's for `admin`), of "
    "`status` when given.",
    responses=responses(*AUTH, 422, 503),
)
def list_(
    caller: Reader,
    status: Status | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> PostPage:
    """The newest posts the caller sees."""
    owner = None if caller.token.admin else caller.owner
    rows = list_posts(_platform(), status=status, owner=owner, limit=limit)
    return PostPage(items=[PostView(**r) for r in rows])


@router.post(
    "/publisher/jobs/test",
    response_model=PostCheckResult,
    operation_id="testPublisherJob",
    summary="Would a post run then?",
    description="Scope `submit`. The seed's test: the key (with a caption or media), the "
    "blackout window holding `at` and its end, whether the channel and account are busy then, "
    "and `would_run`. Inserts nothing; 422 naming the field of a bad value.",
    responses=responses(*AUTH, 422, 503),
)
def check(caller: Submitter, body: PostCheck) -> PostCheckResult:
    """Check a time for a channel and account."""
    platform = _platform()
    try:
        out = check_post(platform, **body.model_dump())
    except PlanInvalid as exc:
        raise _invalid(exc) from None
    except OverflowError:
        raise _out_of_range("at") from None
    if out["existing"] is not None and not caller.sees(_owner_of(platform, out["existing"])[1]):
        out["existing"] = None
    return PostCheckResult(**out)


@router.get(
    "/publisher/jobs/{post_id}",
    response_model=PostView,
    operation_id="getPublisherJob",
    summary="Show a post",
    description="Scope `read`. The record and its job's status. Another owner's post is 404 "
    "unless the token is `admin`.",
    responses=responses(*AUTH, 404, 503),
)
def show(caller: Reader, post_id: PostId) -> PostView:
    """One post."""
    platform = _platform()
    _visible(platform, caller, post_id)
    try:
        return PostView(**show_post(platform, post_id))
    except PostNotFound:
        raise _not_found() from None


@router.patch(
    "/publisher/jobs/{post_id}",
    response_model=PostView,
    operation_id="editPublisherJob",
    summary="Edit a pending post",
    description="Scope `submit`. Change a pending post's caption, media, time or placeholders: "
    "its key is computed again and its job moved. 409 `post-not-pending` once it started, "
    "`idempotency-key-taken` when another post has the new plan; 422 naming the field.",
    responses=responses(*AUTH, 404, 409, 422, 503),
)
def edit(caller: Submitter, post_id: PostId, body: PostChanges) -> PostView:
    """Edit one pending post."""
    platform = _platform()
    _visible(platform, caller, post_id)
    try:
        edit_post(
            platform,
            post_id,
            caption=body.caption,
            media=body.media,
            scheduled_at=body.scheduled_at,
            placeholders=body.placeholders,
        )
        return PostView(**show_post(platform, post_id))
    except PlanInvalid as exc:
        raise _invalid(exc) from None
    except OverflowError:
        raise _out_of_range("scheduled_at") from None
    except PostConflict as exc:
        raise _conflict(exc) from None
    except PostNotFound:
        raise _not_found() from None


@router.post(
    "/publisher/jobs/{post_id}/cancel",
    response_model=PostView,
    operation_id="cancelPublisherJob",
    summary="Cancel a pending post",
    description="Scope `submit`. A pending post becomes `cancelled` and its job is cancelled; "
    "409 `post-not-pending` otherwise.",
    responses=responses(*AUTH, 404, 409, 503),
)
def cancel(caller: Submitter, post_id: PostId) -> PostView:
    """Cancel one pending post."""
    platform = _platform()
    _visible(platform, caller, post_id)
    try:
        return PostView(**cancel_post(platform, post_id, by=caller.name))
    except PostConflict as exc:
        raise _conflict(exc) from None
    except PostNotFound:
        raise _not_found() from None


@router.post(
    "/publisher/jobs/{post_id}/replay",
    response_model=PostView,
    operation_id="replayPublisherJob",
    summary="Replay a failed post",
    description="Scope `submit`. The seed's replay: a failed post is published again now with "
    "the same key and a fresh attempt budget; one with a `remote_id` comes back as it is, "
    "nothing published. 409 `post-not-failed` otherwise.",
    responses=responses(*AUTH, 404, 409, 503),
)
def replay(caller: Submitter, post_id: PostId) -> PostView:
    """Replay one failed post."""
    platform = _platform()
    _visible(platform, caller, post_id)
    try:
        return PostView(**replay_post(platform, post_id, by=caller.name))
    except PostConflict as exc:
        raise _conflict(exc) from None
    except PostNotFound:
        raise _not_found() from None


# Two routes share a path here (and ``test`` is also a post id): Starlette's 405 would name
# only the first matching route's methods in ``Allow``, so every other method gets this
# answer, naming the path's own (RFC 9110).
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")


def _refuse(allowed: tuple[str, ...]) -> Callable[[], None]:
    def refuse() -> None:
        raise Problem(405, None, "Method Not Allowed", headers={"Allow": ", ".join(allowed)})

    return refuse


_SHARED = (
    ("/publisher/jobs", ("GET", "POST")),
    ("/publisher/jobs/test", ("POST",)),  # before {post_id}, which "test" would match
    ("/publisher/jobs/{post_id}", ("GET", "PATCH")),
)
for _path, _allowed in _SHARED:
    _others = [m for m in _METHODS if m not in _allowed]
    router.add_api_route(_path, _refuse(_allowed), methods=_others, include_in_schema=False)
