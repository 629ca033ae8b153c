"""The email family's stage, ``conveyor.email.send``: one message, sent at most once where
the provider allows it.

The outbox row (``email_outbox``, id = outboxId = the job's id) says where the message is.
``SENDING`` is committed in the attempt's own fenced transaction only right before the point
of no return (SMTP's DATA, the HTTP or SES request); any failure before it, or one the
server answered, puts the row back to ``PENDING``; only a reply lost after it leaves
``SENDING``. An attempt that finds ``SENDING`` cannot know whether the message went out:
the HTTP provider sends again under the same ``Idempotency-Key`` (the peer answers with the
first send's id); SMTP and SES cannot tell, so ``on_unknown`` decides: ``hold`` dead-letters
:class:`DeliveryUnknown` (outbox ``UNKNOWN``, for ``conveyor email resolve``), ``resend``
sends again. Success writes the log entry and ``SENT`` in the completion transaction.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from typing import Any

from sqlalchemy import Connection, insert, select

from config.settings import get_settings
from conveyor import metrics
from conveyor.context import JobContext
from conveyor.errors import LeaseLost
from conveyor.retry import Schedule
from conveyor.shared import current_platform, stage
from conveyor.store.db.dialect import db_now, upsert
from conveyor.store.db.engine import reading
from conveyor.store.db.schema import jobs
from tasks.email import outbox
from tasks.email import tables as t
from tasks.email.errors import (
    DeliveryUncertain,
    DeliveryUnknown,
    EmailRejected,
    HtmlNotFound,
    ProviderRefused,
    ProviderUnavailable,
)
from tasks.email.models import (
    IDEMPOTENCY_IGNORE,
    QUEUE,
    STAGE,
    EmailSendJobData,
    EmailSendJobResult,
    allow_test_domains,
    wire_address,
)
from tasks.email.privacy import mask_email, masked, short_hash
from tasks.email.providers import Delivery, OutgoingEmail, Provider, provider_from
from tasks.email.settings import EmailSettings, email_settings_of

SENT_TOTAL = metrics.counter("conveyor_email_sent_total", "messages a provider accepted", ["provider"])
FAILED_TOTAL = metrics.counter(
    "conveyor_email_failed_total", "send attempts that failed", ["provider", "reason"]
)
SEND_SECONDS = metrics.histogram("conveyor_email_send_seconds", "one provider send, connect to reply")

_SETTINGS = get_settings().email
allow_test_domains(_SETTINGS.allow_test_domains)
_providers: dict[str, Provider] = {}


def _provider(settings: EmailSettings) -> Provider:
    """One provider per configuration (an SES client is worth keeping)."""
    key = settings.model_dump_json()
    found = _providers.get(key)
    if found is None:
        found = _providers[key] = provider_from(settings)
    return found


def _email() -> EmailSettings:
    """The platform's ``CONVEYOR_EMAIL`` (read when each message is sent)."""
    return email_settings_of(current_platform().settings, _SETTINGS)


def message_id(outbox_id: str, settings: EmailSettings) -> str:
    """The message's ``Message-ID``: ``<outboxId@domain>``, the same on every attempt."""
    return f"<{outbox_id}@{settings.id_domain}>"


def _label(p: EmailSendJobData) -> str:
    return f"email to {mask_email(p.to)}"


def _kwargsrepr(payload: Any) -> str:
    return repr(masked(payload))


# -- the stage --------------------------------------------------------------------------


class _AlreadySent(Exception):
    """The row turned ``SENT`` before this attempt's point of no return (an operator's
    ``resolve --delivered``): nothing is sent."""


def send_message(ctx: JobContext, p: EmailSendJobData, settings: EmailSettings) -> dict[str, Any]:
    """The body, on the settings given (the stage passes the deployment's).

    One read (the outbox row, the counted attempt, the HTML) and one fenced write before the
    send (the row made if a by-name producer left it to us, ``SENDING``): a failure before
    the point of no return writes its own fenced transaction.
    """
    provider = _provider(settings)
    mid = message_id(p.outboxId, settings)
    # Not on ctx.connection: on SQLite its transaction holds the one writer until the
    # completion, and the fenced writes below would wait for it.
    with reading(ctx.services.connections.engine) as conn:
        row = conn.execute(select(t.outbox).where(t.outbox.c.id == p.outboxId)).mappings().first()
        counted = _counted_attempt(conn, ctx.job_id)
        html = _html(conn, p.htmlRef) if row is None or row["status"] != t.SENT else ""
    ctx.log.info(
        "sending email",
        outbox_id=p.outboxId,
        to=mask_email(p.to),
        cpf_cnpj_hash=short_hash(p.recipient.cpfCnpjHash) if p.recipient.cpfCnpjHash else None,
        provider=provider.name,
    )
    if row is not None and row["status"] == t.SENT:
        return _result("ALREADY_SENT", row["provider_message_id"], mid, 0, counted, row["refused"] or [])
    if row is not None and row["status"] in (t.SENDING, t.UNKNOWN) and not _may_resend(provider, settings):
        raise DeliveryUnknown(mid)
    committed = False

    def point_of_no_return() -> None:
        nonlocal committed
        with ctx.fenced() as conn:
            if outbox.locked(conn, p, mid)["status"] == t.SENT:
                raise _AlreadySent()
            outbox.move(conn, p.outboxId, t.SENDING, provider=provider.name, attempts=counted)
        committed = True

    started = time.monotonic()
    try:
        if html is None:
            raise HtmlNotFound("htmlRef names no stored HTML (email_html) for this message")
        delivery = provider.send(_outgoing(p, mid, html, settings), before_commit_point=point_of_no_return)
    except LeaseLost:
        raise
    except _AlreadySent:
        return _result("ALREADY_SENT", None, mid, 0, counted, [])
    except Exception as exc:
        # A reply code says what happened; anything else past the point of no return (a lost
        # reply, a soft time limit, a crash of ours mid-DATA) may have sent it.
        answered = isinstance(exc, (ProviderUnavailable, ProviderRefused, EmailRejected))
        uncertain = isinstance(exc, DeliveryUncertain) or (committed and not answered)
        reason = "uncertain" if uncertain else type(exc).__name__
        FAILED_TOTAL.labels(provider=provider.name, reason=reason).inc()
        error = outbox.error_text(exc)
        ctx.log.warning(
            "email not sent",
            outbox_id=p.outboxId,
            reason=type(exc).__name__,
            uncertain=uncertain,
            error=error,
        )
        with ctx.fenced() as conn:
            # Nothing went out, or the server said so: this attempt's own transaction puts the
            # row back (made first if a by-name producer left it to us), whatever the
            # platform decides next (a retry, the DLQ).
            outbox.locked(conn, p, mid)
            status = t.SENDING if uncertain else t.PENDING
            outbox.move(conn, p.outboxId, status, attempts=counted, last_error=error)
        if uncertain and not _may_resend(provider, settings):
            raise DeliveryUnknown(mid) from exc
        raise
    seconds = time.monotonic() - started
    SEND_SECONDS.observe(seconds)
    SENT_TOTAL.labels(provider=provider.name).inc()
    duration_ms = int(seconds * 1000)
    _record_sent(ctx, p, delivery, duration_ms, counted)
    ctx.log.info("email sent", outbox_id=p.outboxId, provider=provider.name, refused=len(delivery.refused))
    return _result("SENT", delivery.provider_message_id, mid, duration_ms, counted, list(delivery.refused))


def _outgoing(p: EmailSendJobData, mid: str, html: str, settings: EmailSettings) -> OutgoingEmail:
    return OutgoingEmail(
        outbox_id=p.outboxId,
        message_id=mid,
        from_address=settings.from_address,
        to=wire_address(p.to),
        cc=tuple(wire_address(a) for a in p.cc),
        bcc=tuple(wire_address(a) for a in p.bcc),
        reply_to=wire_address(p.replyTo) if p.replyTo else None,
        subject=p.subject,
        html=html,
        headers=dict(p.headers),
        tags=tuple(p.tags),
    )


def _may_resend(provider: Provider, settings: EmailSettings) -> bool:
    """Whether a message whose last send is unknown may be sent again: always over HTTP (the
    idempotency key makes the peer answer with the first send), else only with ``resend``."""
    return provider.name == "http" or settings.on_unknown == "resend"


def _counted_attempt(conn: Connection, job_id: str) -> int:
    """The job's counted attempt (attempts an outage or a shutdown cut short left out)."""
    row = conn.execute(select(jobs.c.attempts, jobs.c.uncounted).where(jobs.c.id == job_id)).one()
    return max(1, int(row.attempts) - int(row.uncounted or 0))


def _html(conn: Connection, ref: str) -> str | None:
    found = conn.execute(select(t.html.c.html).where(t.html.c.id == ref)).scalar_one_or_none()
    return None if found is None else str(found)


def _record_sent(
    ctx: JobContext, p: EmailSendJobData, delivery: Delivery, duration_ms: int, attempt: int
) -> None:
    """The log entry, the recipient and ``SENT``: in the completion transaction, so they
    commit with the job's success or not at all."""
    conn = ctx.connection
    recipient_id = _upsert_recipient(conn, p)
    conn.execute(
        insert(t.log).values(
            id=p.outboxId,
            company_id=p.companyId,
            recipient_id=recipient_id,
            provider=delivery.provider,
            provider_message_id=delivery.provider_message_id,
            status=t.SENT,
            attempt=attempt,
            duration_ms=duration_ms,
            created_at=db_now(),
        )
    )
    outbox.move(
        conn,
        p.outboxId,
        t.SENT,
        provider=delivery.provider,
        provider_message_id=delivery.provider_message_id,
        attempts=attempt,
        refused=list(delivery.refused) or None,
        duration_ms=duration_ms,
        last_error=None,
        sent_at=db_now(),
    )
    ctx.emit(
        "email.sent",
        {"outbox_id": p.outboxId, "provider": delivery.provider, "refused": len(delivery.refused)},
    )


def _upsert_recipient(conn: Connection, p: EmailSendJobData) -> str:
    r = p.recipient
    given = {
        k: v
        for k, v in {
            "external_id": r.externalId,
            "cpf_cnpj_hash": r.cpfCnpjHash,
            "nome": r.nome,
            "razao_social": r.razaoSocial,
        }.items()
        if v is not None
    }
    stmt = upsert(conn, t.recipients).values(
        id=r.recipientId or str(uuid.uuid4()),
        company_id=p.companyId,
        email=p.to,
        created_at=db_now(),
        updated_at=db_now(),
        **given,
    )
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[t.recipients.c.company_id, t.recipients.c.email],
            set_={**{k: stmt.excluded[k] for k in given}, "updated_at": db_now()},
        )
    )
    query = select(t.recipients.c.id).where(
        t.recipients.c.company_id == p.companyId, t.recipients.c.email == p.to
    )
    return str(conn.execute(query).scalar_one())


def _result(
    status: str, provider_id: Any, mid: str, duration_ms: int, attempt: int, refused: list[str]
) -> dict[str, Any]:
    return EmailSendJobResult(
        status=status,
        providerMessageId=provider_id,
        messageId=mid,
        processedAt=dt.datetime.now(dt.UTC).isoformat(),
        durationMs=duration_ms,
        attempt=attempt,
        refused=refused,
    ).model_dump()


@stage(
    STAGE,
    payload=EmailSendJobData,
    queue=QUEUE,
    max_attempts=_SETTINGS.max_attempts,
    retry=Schedule(tuple(_SETTINGS.retry_delays)),
    label=_label,
    kwargsrepr=_kwargsrepr,
    idempotency="strict",
    idempotency_ignore=IDEMPOTENCY_IGNORE,
    on_dead=outbox.on_dead,
    on_expired=outbox.on_expired,
    on_retry=outbox.on_retry,
)
def send(ctx: JobContext, p: EmailSendJobData) -> dict[str, Any]:
    """Send one message (the seed's ``email:send``); see the module's docstring."""
    return send_message(ctx, p, _email())
