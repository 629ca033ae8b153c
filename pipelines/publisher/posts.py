"""The publisher family, caller's side: schedule, show, list, edit, cancel, replay and test
posts. What apps, the CLI and the HTTP router call.

:func:`schedule_post` writes the record and its job in one transaction (the caller's, with
``session=``): the job waits in Postgres until ``scheduled_at`` and is published when due.
The same plan again (the seed's key, unique per channel) returns the existing record
unchanged, however many callers race; nothing else is written.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Connection, func, or_, select
from sqlalchemy.orm import Session

from conveyor.calendar import blocking
from conveyor.client.enlist import Enlistment
from conveyor.client.reschedule import reschedule_in
from conveyor.errors import ConveyorError
from conveyor.platform import Platform
from conveyor.store.db.dialect import db_now, upsert
from conveyor.store.db.namespace import use_schema
from conveyor.store.db.schema import dead_letters
from tasks.publisher import record
from tasks.publisher import tables as t
from tasks.publisher.models import STAGE
from tasks.publisher.plans import Normalized, PlanInvalid, idempotency_key, iso, normalize, parse_time
from tasks.publisher.settings import PublisherSettings, publisher_settings_of


class PostNotFound(ConveyorError, LookupError):
    """No record has that id (CLI exit 1, HTTP 404)."""


class PostConflict(ConveyorError):
    """The post cannot change now (HTTP 409): ``code`` is ``post-not-pending``,
    ``post-not-failed`` or ``idempotency-key-taken``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A post to schedule. ``caption`` may be a template (``{name}`` placeholders filled
    from ``placeholders``); ``scheduled_at`` is aware (or ISO 8601 with an offset); no key
    given: the seed's derived key. ``preview``: nothing is recorded or posted."""

    brand: str
    channel: str
    account: str
    caption: str
    scheduled_at: dt.datetime | str
    media: Sequence[str] = ()
    placeholders: Mapping[str, Any] | None = None
    first_comment: str | None = None
    idempotency_key: str | None = None
    preview: bool = False


@dataclass(frozen=True)
class Scheduled:
    """What :func:`schedule_post` did."""

    id: str
    status: str
    idempotency_key: str
    job_id: str | None
    existing: bool
    preview: dict[str, Any] | None = field(default=None)

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` and HTTP document."""
        out = asdict(self)
        if self.preview is None:
            out.pop("preview")
        return out


def publisher_settings(platform: Platform) -> PublisherSettings:
    """The deployment's ``CONVEYOR_PUBLISHER`` (the defaults where the platform has none)."""
    return publisher_settings_of(platform.settings)


def checked(plan: Plan, settings: PublisherSettings) -> Normalized:
    """``plan`` normalised, or :class:`PlanInvalid` naming the field (an account without a
    token included)."""
    normalized = normalize(
        brand=plan.brand,
        channel=plan.channel,
        account=plan.account,
        caption=plan.caption,
        scheduled_at=plan.scheduled_at,
        media=tuple(plan.media),
        placeholders=plan.placeholders,
        first_comment=plan.first_comment,
        idempotency_key_given=plan.idempotency_key,
    )
    if settings.token_for(normalized.account) is None:
        raise PlanInvalid("account", f"{normalized.account!r} has no Graph token (CONVEYOR_PUBLISHER.tokens)")
    return normalized


def schedule_post(
    platform: Platform,
    plan: Plan,
    *,
    session: Session | Enlistment | None = None,
    owner: str | None = None,
) -> Scheduled:
    """Record ``plan`` and its ``conveyor.publisher.publish`` job (module docstring). A past
    time runs now. Raises :class:`PlanInvalid` (nothing written)."""
    normalized = checked(plan, publisher_settings(platform))
    if plan.preview:
        return Scheduled("", "preview", normalized.idempotency_key, None, False, normalized.preview())
    post_id = str(uuid.uuid4())
    schema = platform.settings.db_schema

    def write(conn: Connection, joined: Session | Enlistment) -> Scheduled:
        conn = use_schema(conn, schema)
        values = _new_record(post_id, normalized, owner)
        conn.execute(upsert(conn, t.posts).values(**values).on_conflict_do_nothing())
        row = _by_key(conn, normalized.channel, normalized.idempotency_key)
        if row is None:  # the key's record was deleted between the insert and this read
            raise PlanInvalid("idempotency_key", "the key's record changed under this request; try again")
        if row["id"] != post_id:
            return Scheduled(row["id"], row["status"], row["idempotency_key"], row["job_id"], True)
        payload = {
            "post_id": post_id,
            "brand": normalized.brand,
            "channel": normalized.channel,
            "account": normalized.account,
        }
        job = platform.submit(
            STAGE, payload, job_id=post_id, run_at=normalized.scheduled_at, session=joined, owner=owner
        )
        return Scheduled(post_id, t.PENDING, normalized.idempotency_key, job.id, False)

    if session is not None:
        return write(session.connection(), session)
    with Session(platform.engine) as own:
        done = write(own.connection(), own)
        own.commit()
    return done


def show_post(platform: Platform, post_id: str) -> dict[str, Any]:
    """The record (with its job's status), or :class:`PostNotFound`."""
    with platform.engine.connect() as conn:
        row = record.get(conn, post_id)
    if row is None:
        raise PostNotFound(f"no post {post_id}")
    job_status = None
    if row["job_id"]:
        try:
            job_status = platform.job(row["job_id"]).status()
        except LookupError:
            job_status = None
    return {**shown(row), "job_status": job_status}


def list_posts(
    platform: Platform, *, status: str | None = None, owner: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    """The newest records (of ``status``; of ``owner`` when given)."""
    if status is not None and status not in t.STATUSES:
        raise PlanInvalid("status", f"one of {', '.join(t.STATUSES)}")
    query = select(t.posts).order_by(t.posts.c.created_at.desc()).limit(max(1, min(limit, 1000)))
    if status is not None:
        query = query.where(t.posts.c.status == status)
    if owner is not None:
        query = query.where(t.posts.c.owner == owner)
    with platform.engine.connect() as conn:
        return [shown(r) for r in conn.execute(query).mappings()]


def edit_post(
    platform: Platform,
    post_id: str,
    *,
    caption: str | None = None,
    media: Sequence[str] | None = None,
    scheduled_at: dt.datetime | str | None = None,
    placeholders: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Change a ``pending`` post's caption, media or time: its key is computed again and its
    job moved, in one transaction. :class:`PostConflict` (nothing changed) when it is not
    pending, its job has started, or the new key is another post's."""
    with platform.engine.begin() as conn:
        row = _pending(conn, post_id)
        media_before = tuple(row["media"] or ())
        derived = idempotency_key(
            row["brand"],
            row["channel"],
            row["account"],
            row["scheduled_at"],
            media_before,
            row["caption"],
        )
        normalized = normalize(
            brand=row["brand"],
            channel=row["channel"],
            account=row["account"],
            # The stored caption is rendered text: its braces are literal, not placeholders.
            caption=_literal(row["caption"]) if caption is None else caption,
            scheduled_at=row["scheduled_at"] if scheduled_at is None else parse_time(scheduled_at),
            media=tuple(row["media"] if media is None else media),
            placeholders=placeholders,
            first_comment=row["first_comment"],
            # A caller's own key stays the post's key; a derived one is derived again.
            idempotency_key_given=None if row["idempotency_key"] == derived else row["idempotency_key"],
        )
        other = _by_key(conn, normalized.channel, normalized.idempotency_key)
        if other is not None and other["id"] != post_id:
            raise PostConflict(
                "idempotency-key-taken", f"post {other['id']} already has that plan; nothing changed"
            )
        moved = record.move(
            conn,
            post_id,
            t.PENDING,
            only_from=(t.PENDING,),
            caption=normalized.caption,
            media=list(normalized.media),
            scheduled_at=normalized.scheduled_at,
            idempotency_key=normalized.idempotency_key,
        )
        if not moved or not reschedule_in(conn, platform.store, row["job_id"], normalized.scheduled_at):
            raise _not_pending(post_id, "running")
        changed = record.get(conn, post_id)
    assert changed is not None
    return shown(changed)


def cancel_post(platform: Platform, post_id: str, *, by: str = "api") -> dict[str, Any]:
    """Cancel a ``pending`` post: ``cancelled``, and its job cancelled."""
    with platform.engine.begin() as conn:
        found = record.get(conn, post_id, lock=True)
        if found is not None and found["status"] == t.CANCELLED:
            return show_post(platform, post_id)  # cancelled already: the same answer again
        row = _pending(conn, post_id)
        if not record.move(
            conn, post_id, t.CANCELLED, only_from=(t.PENDING,), last_error=f"cancelled by {by}"
        ):
            raise _not_pending(post_id, "running")
    if row["job_id"]:
        platform.cancel(row["job_id"], by=by, reason="post cancelled")
    return show_post(platform, post_id)


def replay_post(platform: Platform, post_id: str, *, by: str = "api") -> dict[str, Any]:
    """Replay a ``failed`` post (the seed's replay): with a ``remote_id`` it comes back as
    is, nothing published; otherwise its dead letter is retried now, same key, a fresh
    attempt budget, the record's attempts from 0."""
    with platform.engine.begin() as conn:
        row = record.get(conn, post_id, lock=True)
        if row is None:
            raise PostNotFound(f"no post {post_id}")
        if row["remote_id"]:
            return shown(row)
        if row["status"] != t.FAILED:
            raise PostConflict(
                "post-not-failed", f"post {post_id} is {row['status']}: only a failed post is replayed"
            )
        entry = conn.execute(
            select(dead_letters.c.id)
            .where(dead_letters.c.job_id == row["job_id"], dead_letters.c.retried_at.is_(None))
            .order_by(dead_letters.c.id.desc())
        ).first()
    if entry is not None and platform.dlq.retry(int(entry[0]), by=by) is not None:
        return show_post(platform, post_id)
    # No dead letter to retry (its job expired, say): a new job for the same record.
    with Session(platform.engine) as own:
        conn = use_schema(own.connection(), platform.settings.db_schema)
        if not record.move(conn, post_id, t.PENDING, only_from=(t.FAILED,), attempts=0, last_error=None):
            raise _not_pending(post_id, "no longer failed")
        payload = {
            "post_id": post_id,
            "brand": row["brand"],
            "channel": row["channel"],
            "account": row["account"],
        }
        job = platform.submit(STAGE, payload, session=own, owner=row["owner"])
        conn.execute(t.posts.update().where(t.posts.c.id == post_id).values(job_id=job.id))
        own.commit()
    return show_post(platform, post_id)


def check_post(
    platform: Platform,
    *,
    channel: str,
    account: str,
    at: dt.datetime | str,
    brand: str = "",
    caption: str = "",
    media: Sequence[str] = (),
) -> dict[str, Any]:
    """Would a post run at ``at`` (the seed's ``/jobs/test``)? Its key (with a caption and
    media), the blackout window holding it and its end, whether its channel and account are
    busy then. Inserts nothing."""
    settings = publisher_settings(platform)
    when = parse_time(at, field="at")
    normalized = normalize(
        brand=brand or "test",
        channel=channel,
        account=account,
        caption=caption or ("test" if channel == "facebook" else ""),
        scheduled_at=when,
        media=tuple(media) or (("https://example.invalid/test.jpg",) if channel == "instagram" else ()),
    )
    held = blocking(settings.windows_for(normalized.brand, channel), when)
    limit = settings.channel_concurrency.get(channel, 2)
    lo, hi = when - dt.timedelta(seconds=60), when + dt.timedelta(seconds=60)
    live = t.posts.c.status.in_((t.PENDING, t.RUNNING))
    # Running posts hold their channel and account now: they count for a time about now.
    soon = abs((when - dt.datetime.now(dt.UTC)).total_seconds()) <= 60
    near = (
        or_(t.posts.c.status == t.RUNNING, t.posts.c.scheduled_at.between(lo, hi))
        if soon
        else (t.posts.c.scheduled_at.between(lo, hi))
    )
    with platform.engine.connect() as conn:
        on_channel = conn.execute(
            select(func.count()).select_from(t.posts).where(t.posts.c.channel == channel, live, near)
        ).scalar_one()
        on_account = conn.execute(
            select(func.count())
            .select_from(t.posts)
            .where(t.posts.c.channel == channel, t.posts.c.account == account, live, near)
        ).scalar_one()
        existing = _by_key(conn, channel, normalized.idempotency_key)
    out: dict[str, Any] = {
        "at": iso(when),
        "idempotency_key": normalized.idempotency_key if (caption or media) else None,
        "existing": existing["id"] if existing is not None and (caption or media) else None,
        "blackout": {"window": held[0].name, "until": iso(held[1])} if held else None,
        "channel_busy": int(on_channel) >= limit,
        "account_busy": int(on_account) >= 1,
        "token": settings.token_for(account) is not None,
    }
    out["would_run"] = not (out["blackout"] or out["channel_busy"] or out["account_busy"]) and out["token"]
    return out


def shown(row: Mapping[str, Any]) -> dict[str, Any]:
    """A record as the CLI and HTTP show it."""
    return {
        "id": row["id"],
        "type": row["type"],
        "parent_id": row["parent_id"],
        "brand": row["brand"],
        "channel": row["channel"],
        "account": row["account"],
        "caption": row["caption"],
        "media": list(row["media"] or []),
        "first_comment": row["first_comment"],
        "scheduled_at": iso(row["scheduled_at"]),
        "idempotency_key": row["idempotency_key"],
        "status": row["status"],
        "attempts": row["attempts"],
        "job_id": row["job_id"],
        "container_id": row["container_id"],
        "remote_id": row["remote_id"],
        "last_error": row["last_error"],
        "created_at": _text(row["created_at"]),
        "updated_at": _text(row["updated_at"]),
        "completed_at": _text(row["completed_at"]),
    }


def _new_record(post_id: str, n: Normalized, owner: str | None) -> dict[str, Any]:
    return {
        "id": post_id,
        "type": t.POST,
        "parent_id": None,
        "owner": owner,
        "brand": n.brand,
        "channel": n.channel,
        "account": n.account,
        "caption": n.caption,
        "media": list(n.media),
        "first_comment": n.first_comment,
        "scheduled_at": n.scheduled_at,
        "idempotency_key": n.idempotency_key,
        "status": t.PENDING,
        "attempts": 0,
        "job_id": post_id,
        "created_at": db_now(),
        "updated_at": db_now(),
    }


def _by_key(conn: Connection, channel: str, key: str) -> Mapping[str, Any] | None:
    """The live (not cancelled) record of a plan's key."""
    query = select(t.posts).where(
        t.posts.c.channel == channel, t.posts.c.idempotency_key == key, t.posts.c.status != t.CANCELLED
    )
    return conn.execute(query).mappings().first()


def _pending(conn: Connection, post_id: str) -> Mapping[str, Any]:
    row = record.get(conn, post_id, lock=True)
    if row is None:
        raise PostNotFound(f"no post {post_id}")
    if row["status"] != t.PENDING or row["type"] != t.POST:
        raise _not_pending(post_id, row["status"])
    return row


def _not_pending(post_id: str, status: str) -> PostConflict:
    return PostConflict("post-not-pending", f"post {post_id} is {status}: only a pending post changes")


def _literal(caption: str) -> str:
    return caption.replace("{", "{{").replace("}", "}}")


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return iso(value) if isinstance(value, dt.datetime) else str(value)


__all__ = [
    "Plan",
    "PostConflict",
    "PostNotFound",
    "Scheduled",
    "cancel_post",
    "check_post",
    "edit_post",
    "list_posts",
    "publisher_settings",
    "replay_post",
    "schedule_post",
    "show_post",
]
