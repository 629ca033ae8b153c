"""The email family, caller's side: send a message, show and list the outbox, settle a
message whose delivery is unknown.

:func:`send_email` writes the HTML, the outbox row and the job in one transaction (the
caller's, with ``session=``): the job is published only once it commits, and a rollback
leaves neither. The outboxId is the job's id: the same outboxId and message return the
existing job; another message under it raises :class:`conveyor.IdempotencyConflict`,
checked against the outbox row before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from conveyor.client.enlist import Enlistment
from conveyor.errors import IdempotencyConflict, PayloadInvalid
from conveyor.platform import Platform
from conveyor.store.db.dialect import db_now, upsert
from conveyor.store.db.namespace import use_schema
from conveyor.store.db.schema import dead_letters
from tasks.email import outbox
from tasks.email import tables as t
from tasks.email.models import (
    DEFAULT_PRIORITY,
    DEFAULT_TTL_S,
    STAGE,
    EmailSendJobData,
    conveyor_priority,
    html_ref_for,
)
from tasks.email.privacy import mask_addresses_in, mask_email
from tasks.email.settings import EmailSettings, email_settings_of
from tasks.email.stages import message_id

MAX_HTML = 1_000_000  # characters of one message's HTML


@dataclass(frozen=True)
class Sent:
    """What :func:`send_email` did: the message's outbox id (its job's id), the outbox
    status, and whether it was already there (``deduplicated``)."""

    outbox_id: str
    job_id: str
    status: str
    deduplicated: bool

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` and HTTP document."""
        return asdict(self)


class NotResolvable(Exception):
    """``resolve`` asked of a message that is not ``UNKNOWN`` (or does not exist)."""


def send_email(
    platform: Platform,
    data: EmailSendJobData | Mapping[str, Any],
    *,
    html: str | None = None,
    session: Session | Enlistment | None = None,
    priority: int = DEFAULT_PRIORITY,
    delay: float = 0.0,
    owner: str | None = None,
) -> Sent:
    """Record a message and its ``conveyor.email.send`` job (see the module's docstring).

    ``html`` is stored (``email_html``, id = its sha256) and becomes the payload's
    ``htmlRef``, so the same message sent twice is the same payload. ``priority`` is the
    seed's (1 first … 10, default 5); ``owner`` is the job's (who may see it over HTTP).
    Raises :class:`conveyor.PayloadInvalid` (nothing written) and
    :class:`conveyor.IdempotencyConflict`.
    """
    payload = data.model_dump(mode="json") if isinstance(data, BaseModel) else dict(data)
    if html is not None and not html.strip():
        raise PayloadInvalid(f"invalid payload for {STAGE}: html: empty (a message needs a body)")
    if html is not None and len(html) > MAX_HTML:
        raise PayloadInvalid(f"invalid payload for {STAGE}: html: over {MAX_HTML} characters")
    if html is not None:
        ref = html_ref_for(html)
        if payload.get("htmlRef") not in (None, "", ref):
            raise PayloadInvalid(f"invalid payload for {STAGE}: htmlRef: given with html, and not its sha256")
        payload["htmlRef"] = ref
    model = platform.spec(STAGE).validate(payload)
    assert isinstance(model, EmailSendJobData)
    try:
        seed_priority = conveyor_priority(priority)
    except ValueError as exc:
        raise PayloadInvalid(f"invalid options for {STAGE}: priority: {exc}") from None
    if not 0 <= delay < DEFAULT_TTL_S:
        raise PayloadInvalid(
            f"invalid options for {STAGE}: delay: at most {DEFAULT_TTL_S - 1} s (a message expires "
            f"{DEFAULT_TTL_S // 3600} h after it is recorded: a longer delay would never send it)"
        )
    settings = email_settings(platform)
    row = outbox.new_row(model, message_id(model.outboxId, settings))
    schema = platform.settings.db_schema

    def write(conn: Connection, joined: Session | Enlistment) -> Sent:
        conn = use_schema(conn, schema)
        found = _existing(conn, model.outboxId)
        if found is not None and found["request_hash"] != row["request_hash"]:
            raise _conflict(model.outboxId)
        if html is not None:
            stored = {"id": model.htmlRef, "html": html, "created_at": db_now()}
            conn.execute(upsert(conn, t.html).values(**stored).on_conflict_do_nothing())
        elif conn.execute(select(t.html.c.id).where(t.html.c.id == model.htmlRef)).first() is None:
            raise PayloadInvalid(f"invalid payload for {STAGE}: htmlRef: names no stored HTML (email_html)")
        current = found
        if found is None:
            conn.execute(upsert(conn, t.outbox).values(**row).on_conflict_do_nothing())
            current = _existing(conn, model.outboxId)  # ours, or one a racing send wrote first
            if current["request_hash"] != row["request_hash"]:
                raise _conflict(model.outboxId)
        job = platform.submit(
            STAGE,
            model,
            job_id=model.outboxId,
            expires_in=DEFAULT_TTL_S,
            priority=seed_priority,
            delay=delay,
            session=joined,
            owner=owner,
        )
        return Sent(model.outboxId, job.id, str(current["status"]), job.deduplicated or found is not None)

    if session is not None:
        return write(session.connection(), session)
    with Session(platform.engine) as own:
        sent = write(own.connection(), own)
        own.commit()
    return sent


def show_message(platform: Platform, outbox_id: str) -> dict[str, Any] | None:
    """The outbox row with its job's id and status, addresses masked; None if unknown."""
    with platform.engine.connect() as conn:
        row = conn.execute(select(t.outbox).where(t.outbox.c.id == outbox_id)).mappings().first()
    if row is None:
        return None
    job = platform.job(outbox_id)
    try:
        job_status: str | None = job.status()
    except LookupError:
        job_status = None
    return {**_shown(row), "job_id": outbox_id, "job_status": job_status}


def list_messages(platform: Platform, *, status: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """The newest outbox rows (of ``status``), addresses masked."""
    if status is not None and status not in t.STATUSES:
        raise ValueError(f"status must be one of {', '.join(t.STATUSES)}")
    query = select(t.outbox).order_by(t.outbox.c.created_at.desc()).limit(max(1, min(limit, 1000)))
    if status is not None:
        query = query.where(t.outbox.c.status == status)
    with platform.engine.connect() as conn:
        return [_shown(r) for r in conn.execute(query).mappings()]


def resolve(platform: Platform, outbox_id: str, *, delivered: bool, by: str) -> str:
    """Settle an ``UNKNOWN`` message: ``delivered`` records it ``SENT`` (nothing is sent)
    and closes its dead letter; otherwise its dead letter is retried (it is sent again,
    with a fresh 24 h to expire in). Returns the outbox status after. Raises
    :class:`NotResolvable` for a message that is not ``UNKNOWN``."""
    with platform.engine.begin() as conn:
        query = select(t.outbox.c.status).where(t.outbox.c.id == outbox_id)
        current = conn.execute(query).scalar_one_or_none()
        if current != t.UNKNOWN:
            what = "no such message" if current is None else f"it is {current}"
            raise NotResolvable(f"only an UNKNOWN message can be resolved: {what}")
        if delivered:
            outbox.mark_delivered(conn, outbox_id, by=by)
            platform.dlq.settle(conn, outbox_id, by=by, outcome="delivered")
            return t.SENT
        entry = conn.execute(
            select(dead_letters.c.id)
            .where(dead_letters.c.job_id == outbox_id, dead_letters.c.retried_at.is_(None))
            .order_by(dead_letters.c.id.desc())
        ).scalar_one_or_none()
    if entry is None:
        raise NotResolvable("its job has no open dead letter to retry")
    platform.dlq.retry(int(entry), by=by)
    return t.PENDING


def _existing(conn: Connection, outbox_id: str) -> Any:
    return conn.execute(select(t.outbox).where(t.outbox.c.id == outbox_id)).mappings().first()


def _conflict(outbox_id: str) -> IdempotencyConflict:
    return IdempotencyConflict(
        f"idempotency conflict: outbox {outbox_id} holds another message; nothing was recorded",
        job_id=outbox_id,
    )


def email_settings(platform: Platform) -> EmailSettings:
    """The deployment's ``CONVEYOR_EMAIL`` (the defaults where the platform has none)."""
    return email_settings_of(platform.settings)


def _shown(row: Any) -> dict[str, Any]:
    refused = row["refused"] or []
    return {
        "outbox_id": row["id"],
        "company_id": row["company_id"],
        "status": row["status"],
        "to": mask_email(row["to_address"]),
        "message_id": row["message_id"],
        "provider": row["provider"],
        "provider_message_id": row["provider_message_id"],
        "attempts": row["attempts"],
        "refused": [mask_email(a) for a in refused],
        "last_error": mask_addresses_in(row["last_error"]) if row["last_error"] else None,
        "duration_ms": row["duration_ms"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "sent_at": row["sent_at"],
    }


__all__ = [
    "NotResolvable",
    "Sent",
    "email_settings",
    "list_messages",
    "resolve",
    "send_email",
    "show_message",
]
