"""The publisher family's stages: ``conveyor.publisher.publish`` (one post, once) and
``conveyor.publisher.first_comment`` (an Instagram post's first comment, once).

The platform holds the seed's scheduler: the job waits in Postgres until ``scheduled_at``
(``run_at``), a blackout window parks it until the window ends, ``channel:{channel}`` caps
the posts running per channel and the lease ``publisher:{channel}:{account}`` one per
account. The claim is the seed's atomic ``claim()``.

Exactly one post per record, though the Graph API has no idempotency of its own:

- Facebook: ``sending_at`` commits (fenced) before the feed request; an attempt that finds
  it set looks for the post in the account's feed (same message, since then) first.
- Instagram: the container id commits in its own transaction once created; a retry asks
  the container's ``status_code``: ``FINISHED`` → publish it; ``PUBLISHED`` → the media is
  found in the account's media (same caption, since the container), else the record says
  "published, id unknown"; ``IN_PROGRESS`` → wait; ``EXPIRED``/``ERROR`` → a new container.

``remote_id`` and ``completed`` commit with the job's completion, and so does the first
comment's child job (``ctx.submit``), deduplicated on ``(media_id, comment_hash)``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, NoReturn

from sqlalchemy import Connection

from config.settings import get_settings
from conveyor import metrics
from conveyor.calendar import Window
from conveyor.context import JobContext
from conveyor.dedup import Dedup
from conveyor.errors import PermanentError, RetryRequested, SkipJob
from conveyor.retry import Backoff
from conveyor.shared import current_platform, stage
from conveyor.store.db.dialect import db_now, upsert
from conveyor.store.db.engine import reading
from tasks.publisher import record
from tasks.publisher import tables as t
from tasks.publisher.graph import GraphClient, GraphTransient
from tasks.publisher.models import (
    CONCURRENCY_KEY,
    FIRST_COMMENT_STAGE,
    LEASE_KEY,
    QUEUE,
    STAGE,
    FirstCommentPayload,
    PublishPayload,
)
from tasks.publisher.plans import comment_hash
from tasks.publisher.settings import PublisherSettings, publisher_settings_of

PUBLISHED_TOTAL = metrics.counter("conveyor_publisher_published_total", "posts published", ["channel"])
GRAPH_SECONDS = metrics.histogram("conveyor_publisher_graph_seconds", "one post's Graph calls")

_SETTINGS = get_settings().publisher
# How long an attempt waits for a container still IN_PROGRESS before it retries later.
CONTAINER_WAIT = 10.0
CONTAINER_RETRY = 5.0
_NAMESPACE = uuid.UUID("6b1f4c55-4d3c-4e1b-9a57-2f0c4f1b7e21")


class PostMissing(PermanentError):
    """The job names no record (it was made without one)."""


class NoToken(PermanentError):
    """The account has no Graph token (``CONVEYOR_PUBLISHER.tokens``)."""


def _publisher() -> PublisherSettings:
    """The platform's ``CONVEYOR_PUBLISHER`` (read when each post runs)."""
    return publisher_settings_of(current_platform().settings, _SETTINGS)


def _blackout(p: PublishPayload) -> tuple[Window, ...]:
    return _publisher().windows_for(p.brand, p.channel)


def _channel_limit(key: str) -> int | None:
    return _publisher().channel_concurrency.get(key.partition(":")[2])


def _client(settings: PublisherSettings, account: str) -> GraphClient:
    token = settings.token_for(account)
    if token is None:
        raise NoToken(f"account {account!r} has no Graph token (CONVEYOR_PUBLISHER.tokens)")
    return GraphClient(settings.graph_url, token, timeout=settings.timeout)


def _read(ctx: JobContext, post_id: str) -> Mapping[str, Any]:
    # Not on ctx.connection: on SQLite it holds the one writer until the completion.
    with reading(ctx.services.connections.engine) as conn:
        row = record.get(conn, post_id)
    if row is None:
        raise PostMissing(f"post {post_id} has no record in publisher_jobs")
    return row


def _start(ctx: JobContext, row: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    """``running`` (attempts + 1, this job) and the seed's ``fp_publisher_process_job``
    hook (``publisher.processing``), committed now: visible while the post runs."""
    with ctx.fenced() as conn:
        moved = record.move(
            conn,
            row["id"],
            t.RUNNING,
            only_from=(t.PENDING, t.RUNNING),
            attempts=t.posts.c.attempts + 1,
            job_id=ctx.job_id,
        )
        if moved:
            record.event(conn, ctx.job_id, "publisher.processing", {**body, "attempt": ctx.attempt})
    if not moved:
        raise SkipJob(f"the record is {record_status(ctx, row['id'])}, not pending")


def record_status(ctx: JobContext, post_id: str) -> str:
    """The record's status now."""
    with reading(ctx.services.connections.engine) as conn:
        row = record.get(conn, post_id)
    return "gone" if row is None else str(row["status"])


def _failed_attempt(ctx: JobContext, post_id: str, exc: BaseException) -> None:
    """A failure the platform retries: the record waits (``pending``) with the error."""
    with ctx.fenced() as conn:
        record.move(conn, post_id, t.PENDING, only_from=(t.RUNNING,), last_error=record.error_text(exc))


def _retry_later(ctx: JobContext, post_id: str, exc: GraphTransient) -> NoReturn:
    """Graph failed for now: the record waits with the error, and the platform retries
    (after Graph's ``Retry-After`` when it gave one, else on the stage's backoff)."""
    _failed_attempt(ctx, post_id, exc)
    if exc.retry_after is not None:
        raise RetryRequested(str(exc), delay=exc.retry_after, cause=exc) from exc
    raise exc


# -- publish ------------------------------------------------------------------------------


def publish_post(ctx: JobContext, p: PublishPayload, settings: PublisherSettings) -> dict[str, Any]:
    """The body, on the settings given (the stage passes the deployment's)."""
    row = _read(ctx, p.post_id)
    if row["status"] == t.COMPLETED:
        return _result(row, row["remote_id"])
    if row["status"] == t.CANCELLED:
        raise SkipJob("the post was cancelled")
    client = _client(settings, p.account)
    _start(ctx, row, {"post_id": p.post_id, "channel": p.channel, "account": p.account})
    ctx.log.info("publishing post", post_id=p.post_id, channel=p.channel, account=p.account)
    started = time.monotonic()
    try:
        if p.channel == "facebook":
            remote_id, note = _facebook(ctx, client, row)
        else:
            remote_id, note = _instagram(ctx, client, row)
    except GraphTransient as exc:
        _retry_later(ctx, p.post_id, exc)
    except RetryRequested as exc:
        _failed_attempt(ctx, p.post_id, exc)
        raise
    GRAPH_SECONDS.observe(time.monotonic() - started)
    PUBLISHED_TOTAL.labels(channel=p.channel).inc()
    conn = ctx.connection
    record.move(
        conn,
        p.post_id,
        t.COMPLETED,
        only_from=(t.RUNNING,),
        remote_id=remote_id,
        completed_at=db_now(),
        last_error=note,
    )
    ctx.emit("publisher.published", {"post_id": p.post_id, "channel": p.channel, "remote_id": remote_id})
    if p.channel == "instagram" and row["first_comment"] and remote_id:
        _first_comment(ctx, conn, row, remote_id)
    ctx.log.info("post published", post_id=p.post_id, channel=p.channel, remote_id=remote_id)
    return _result(row, remote_id)


def _facebook(ctx: JobContext, client: GraphClient, row: Mapping[str, Any]) -> tuple[str, None]:
    account, caption = row["account"], row["caption"]
    if row["sending_at"] is not None:
        found = client.find_feed_post(account, caption, row["sending_at"])
        if found is not None:
            return found, None
    with ctx.fenced() as conn:
        conn.execute(
            t.posts.update()
            .where(t.posts.c.id == row["id"], t.posts.c.sending_at.is_(None))
            .values(sending_at=db_now())
        )
    link = row["media"][0] if row["media"] else None
    return client.post_feed(account, caption, link), None


def _instagram(ctx: JobContext, client: GraphClient, row: Mapping[str, Any]) -> tuple[str | None, str | None]:
    account, caption = row["account"], row["caption"]
    container = row["container_id"]
    if container is not None:
        status = client.container_status(container)
        if status == "PUBLISHED":
            found = client.find_media(account, caption, row["container_at"])
            return (found, None) if found is not None else (None, "published, id unknown")
        if status in ("FINISHED", "IN_PROGRESS"):
            _wait_finished(ctx, client, container, status)
            return client.media_publish(account, container), None
        # EXPIRED or ERROR: Graph will not publish it; a new container replaces it.
    container = client.create_container(account, caption, row["media"][0])
    with ctx.fenced() as conn:
        record.move(
            conn,
            row["id"],
            t.RUNNING,
            only_from=(t.RUNNING,),
            container_id=container,
            container_at=db_now(),
        )
    _wait_finished(ctx, client, container, client.container_status(container))
    return client.media_publish(account, container), None


def _wait_finished(ctx: JobContext, client: GraphClient, container: str, status: str) -> None:
    """Poll a container until ``FINISHED`` (at most :data:`CONTAINER_WAIT`), then retry later."""
    deadline = time.monotonic() + CONTAINER_WAIT
    while status == "IN_PROGRESS" and time.monotonic() < deadline:
        ctx.checkpoint()
        time.sleep(0.5)
        status = client.container_status(container)
    if status == "IN_PROGRESS":
        raise RetryRequested("the Instagram container is still processing", delay=CONTAINER_RETRY)
    if status != "FINISHED":
        raise GraphTransient(f"the Instagram container became {status} before it was published")


def _first_comment(ctx: JobContext, conn: Connection, row: Mapping[str, Any], media_id: str) -> None:
    """In the completion transaction: the comment's record and its child job; a failure to
    make them never fails the post (``publisher.first_comment_failed``)."""
    text = str(row["first_comment"])
    digest = comment_hash(media_id, text)
    child_id = str(uuid.uuid5(_NAMESPACE, f"{row['id']}:first_comment"))
    try:
        with conn.begin_nested():
            stmt = upsert(conn, t.posts).values(
                id=child_id,
                type=t.FIRST_COMMENT,
                parent_id=row["id"],
                owner=row["owner"],
                brand=row["brand"],
                channel=row["channel"],
                account=row["account"],
                caption=text,
                media=[],
                scheduled_at=db_now(),
                idempotency_key=digest,
                status=t.PENDING,
                attempts=0,
                created_at=db_now(),
                updated_at=db_now(),
            )
            conn.execute(stmt.on_conflict_do_nothing())
            payload = {"post_id": child_id, "media_id": media_id, "comment_hash": digest}
            job_id = ctx.submit(FIRST_COMMENT_STAGE, payload)
            conn.execute(
                t.posts.update()
                .where(t.posts.c.id == child_id, t.posts.c.job_id.is_(None))
                .values(job_id=job_id)
            )
    except Exception as exc:
        ctx.children.clear()
        ctx.log.warning("first comment not scheduled", post_id=row["id"], error=type(exc).__name__)
        ctx.emit("publisher.first_comment_failed", {"post_id": row["id"], "error": type(exc).__name__})


def _result(row: Mapping[str, Any], remote_id: str | None) -> dict[str, Any]:
    return {"post_id": row["id"], "channel": row["channel"], "status": t.COMPLETED, "remote_id": remote_id}


def _label(p: PublishPayload) -> str:
    return f"{p.channel} post {p.post_id[:8]}"


_BACKOFF = Backoff(
    base=_SETTINGS.retry_backoff.base, cap=_SETTINGS.retry_backoff.max, factor=_SETTINGS.retry_backoff.factor
)


@stage(
    STAGE,
    payload=PublishPayload,
    queue=QUEUE,
    max_attempts=_SETTINGS.max_attempts,
    retry=_BACKOFF,
    label=_label,
    lease_key=LEASE_KEY,
    concurrency_key=CONCURRENCY_KEY,
    concurrency_limit=_channel_limit,
    blackout=_blackout,
    on_dead=record.on_dead,
    on_retry=record.on_retry,
    on_stalled=record.on_stalled,
    on_expired=record.on_expired,
)
def publish(ctx: JobContext, p: PublishPayload) -> dict[str, Any]:
    """Publish one post (the seed's job); see the module's docstring."""
    return publish_post(ctx, p, _publisher())


# -- first comment ------------------------------------------------------------------------


def post_first_comment(
    ctx: JobContext, p: FirstCommentPayload, settings: PublisherSettings
) -> dict[str, Any]:
    """The body: skip a comment already under the media (same normalised text), else post it."""
    row = _read(ctx, p.post_id)
    if row["status"] == t.COMPLETED:
        return _result(row, row["remote_id"])
    client = _client(settings, row["account"])
    _start(ctx, row, {"post_id": row["parent_id"], "comment_id": p.post_id, "media_id": p.media_id})
    try:
        existing = next(
            (
                c["id"]
                for c in client.list_comments(p.media_id)
                if comment_hash(p.media_id, c["text"]) == p.comment_hash
            ),
            None,
        )
        remote_id = existing or client.post_comment(p.media_id, str(row["caption"]))
    except GraphTransient as exc:
        _retry_later(ctx, p.post_id, exc)
    record.move(
        ctx.connection,
        p.post_id,
        t.COMPLETED,
        only_from=(t.RUNNING,),
        remote_id=remote_id,
        completed_at=db_now(),
        last_error=None,
    )
    ctx.emit(
        "publisher.first_comment",
        {"post_id": row["parent_id"], "comment_id": remote_id, "existing": bool(existing)},
    )
    return _result(row, remote_id)


@stage(
    FIRST_COMMENT_STAGE,
    payload=FirstCommentPayload,
    queue=QUEUE,
    max_attempts=_SETTINGS.max_attempts,
    retry=_BACKOFF,
    dedup=Dedup(mode="id", fields=("media_id", "comment_hash")),
    on_dead=record.on_dead,
    on_retry=record.on_retry,
    on_stalled=record.on_stalled,
)
def first_comment(ctx: JobContext, p: FirstCommentPayload) -> dict[str, Any]:
    """Post an Instagram post's first comment once."""
    return post_first_comment(ctx, p, _publisher())
