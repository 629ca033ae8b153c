"""The outbox row's life: made with its job (or at the first attempt), moved by the stage,
settled by the platform's hooks (dead letter, expiry, DLQ retry) and by an operator's
``resolve``. Every function takes the caller's connection: it commits with their work."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, select, update
from sqlalchemy.dialects import postgresql

from conveyor.errors import describe
from conveyor.store.db.dialect import db_now
from tasks.email import tables as t
from tasks.email.errors import DeliveryUnknown
from tasks.email.models import IDEMPOTENCY_IGNORE, EmailSendJobData
from tasks.email.privacy import mask_addresses_in

# What a dead letter leaves: the message may have gone out (its row was SENDING) or not.
_MAYBE_SENT = (t.SENDING, t.UNKNOWN)


def request_hash(payload: Mapping[str, Any]) -> str:
    """The message a payload asks for, as a hash: canonical JSON without the fields a
    resubmission may change (``attempt``, ``enqueuedAt``, ``requestId``)."""
    kept = {k: v for k, v in payload.items() if k not in IDEMPOTENCY_IGNORE}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def new_row(p: EmailSendJobData, message_id: str) -> dict[str, Any]:
    """A ``PENDING`` outbox row for ``p``."""
    return {
        "id": p.outboxId,
        "company_id": p.companyId,
        "status": t.PENDING,
        "to_address": p.to,
        "request_hash": request_hash(p.model_dump(mode="json")),
        "message_id": message_id,
        "attempts": 0,
        "created_at": db_now(),
        "updated_at": db_now(),
    }


def locked(conn: Connection, p: EmailSendJobData, message_id: str) -> Any:
    """The outbox row of ``p``, locked for the transaction; made ``PENDING`` first when a
    producer only submitted the job (a client without the family's code)."""
    query = select(t.outbox).where(t.outbox.c.id == p.outboxId)
    if conn.dialect.name == "postgresql":
        stmt = postgresql.insert(t.outbox).values(**new_row(p, message_id)).on_conflict_do_nothing()
        conn.execute(stmt)
        return conn.execute(query.with_for_update()).mappings().one()
    row = conn.execute(query).mappings().first()
    if row is None:
        conn.execute(t.outbox.insert().values(**new_row(p, message_id)))
        row = conn.execute(query).mappings().one()
    return row


def move(
    conn: Connection, outbox_id: str, status: str, *, only_from: tuple[str, ...] = (), **values: Any
) -> bool:
    """Set the row's status (and ``values``), if it is in one of ``only_from`` (any when empty)."""
    cond = [t.outbox.c.id == outbox_id]
    if only_from:
        cond.append(t.outbox.c.status.in_(only_from))
    res = conn.execute(update(t.outbox).where(*cond).values(status=status, updated_at=db_now(), **values))
    return bool(res.rowcount)


# Our Message-IDs (<outboxId@domain>) are no address: kept whole, to be searched for.
_MESSAGE_ID = re.compile(r"<[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}@[^<>\s]+>")


def error_text(exc: BaseException) -> str:
    """An error as the outbox keeps it: no address in it (our Message-IDs stay whole)."""
    text = describe(exc)
    kept = _MESSAGE_ID.findall(text)
    masked = mask_addresses_in(_MESSAGE_ID.sub("\x00", text))
    for mid in kept:
        masked = masked.replace("\x00", mid, 1)
    return masked[:2000]


# -- the platform's hooks ---------------------------------------------------------------


def on_dead(conn: Connection, payload: Any, error: BaseException) -> None:
    """In the dead-letter transaction: ``UNKNOWN`` when the message may have gone out (a
    held unknown delivery, or a row left ``SENDING`` by a lost worker), else ``FAILED``."""
    outbox_id = _outbox_id(payload)
    if outbox_id is None:  # a payload too broken to name its message: nothing to record
        return
    row = conn.execute(select(t.outbox.c.status).where(t.outbox.c.id == outbox_id)).scalar_one_or_none()
    if row is None or row == t.SENT:
        return
    status = t.UNKNOWN if isinstance(error, DeliveryUnknown) or row in _MAYBE_SENT else t.FAILED
    move(conn, outbox_id, status, last_error=error_text(error))


def on_expired(conn: Connection, payload: Any) -> None:
    """In the expiring transaction: ``EXPIRED`` when nothing went out; a row left ``SENDING``
    becomes ``UNKNOWN`` (an expired job does not make a possible send unsent)."""
    outbox_id = _outbox_id(payload)
    if outbox_id is None:
        return
    move(
        conn,
        outbox_id,
        t.EXPIRED,
        only_from=(t.PENDING, t.FAILED),
        last_error="expired (24 h) before it was sent",
    )
    move(
        conn,
        outbox_id,
        t.UNKNOWN,
        only_from=(t.SENDING,),
        last_error="expired while its delivery was unknown",
    )


def on_retry(conn: Connection, payload: Any) -> None:
    """In a DLQ retry's transaction: the message is to be sent again (``PENDING``)."""
    outbox_id = _outbox_id(payload)
    if outbox_id is not None:
        move(conn, outbox_id, t.PENDING, only_from=(t.FAILED, t.UNKNOWN, t.EXPIRED))


def mark_delivered(conn: Connection, outbox_id: str, *, by: str) -> bool:
    """An operator found an ``UNKNOWN`` message delivered: ``SENT``, nothing sent."""
    row = conn.execute(select(t.outbox).where(t.outbox.c.id == outbox_id)).mappings().first()
    if row is None or row["status"] != t.UNKNOWN:
        return False
    return move(
        conn,
        outbox_id,
        t.SENT,
        only_from=(t.UNKNOWN,),
        provider_message_id=row["provider_message_id"] or row["message_id"],
        last_error=f"resolved as delivered by {by}",
        sent_at=db_now(),
    )


def _outbox_id(payload: Any) -> str | None:
    value = payload.get("outboxId") if isinstance(payload, Mapping) else None
    return value if isinstance(value, str) and 0 < len(value) <= 36 else None
