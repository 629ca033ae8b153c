"""What the email family's tests share: a valid message, the family's settings pointed at a
local peer, and reading its rows."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import select

from tasks.email import tables as t
from tasks.email.models import allow_test_domains
from tasks.email.settings import EmailSettings, HttpSettings, SmtpSettings

COMPANY = "789e4567-e89b-12d3-a456-426614174999"
HTML = "<html><body><h1>Seu boleto</h1><p>Está disponível.</p></body></html>"


def message(tag: str, **changes: Any) -> dict[str, Any]:
    """A valid ``EmailSendJobData`` payload whose addresses carry ``tag``."""
    to = f"cliente.{tag}@empresa.test"
    data: dict[str, Any] = {
        "outboxId": str(uuid.uuid4()),
        "companyId": COMPANY,
        "requestId": f"req-{tag}",
        "to": to,
        "subject": "Seu boleto está disponível",
        "htmlRef": "",
        "recipient": {"externalId": f"CUST-{tag}", "nome": "João da Silva", "email": to},
        "attempt": 1,
        "enqueuedAt": dt.datetime.now(dt.UTC).isoformat(),
    }
    data.update(changes)
    return data


@contextmanager
def email_settings(platform: Any, **settings: Any) -> Iterator[EmailSettings]:
    """The platform's ``CONVEYOR_EMAIL`` replaced for the block (the stage reads it at each
    send); ``.test`` addresses allowed."""
    before = platform.settings.email
    chosen = EmailSettings(from_address="avisos@conveyor.test", allow_test_domains=True, **settings)
    platform.settings.email = chosen
    allow_test_domains(True)
    try:
        yield chosen
    finally:
        platform.settings.email = before


def smtp_at(port: int, **extra: Any) -> dict[str, Any]:
    """Settings of an SMTP peer on ``port``."""
    return {"provider": "smtp", "smtp": SmtpSettings(port=port, timeout=5), **extra}


def http_at(url: str, **extra: Any) -> dict[str, Any]:
    """Settings of an HTTP peer at ``url``."""
    return {"provider": "http", "http": HttpSettings(url=url, timeout=5), **extra}


def outbox_row(platform: Any, outbox_id: str) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(t.outbox).where(t.outbox.c.id == outbox_id)).mappings().first()


def log_row(platform: Any, outbox_id: str) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(t.log).where(t.log.c.id == outbox_id)).mappings().first()
