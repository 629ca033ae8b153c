"""The email family in ``conveyor demo``: an SMTP peer the demo starts before its worker
(the worker's ``CONVEYOR_EMAIL`` names it), and one message sent through it, shown ``SENT``."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from conveyor.platform import Platform
from pipelines.email.peers import SmtpPeer

# The demo's peer and the settings its worker was given, while the demo runs.
_running: dict[str, Any] = {}
SETTINGS = {"from_address": "demo@conveyor.test", "allow_test_domains": True}


@contextmanager
def peers() -> Iterator[dict[str, str]]:
    """Start the SMTP peer; yield the worker's extra environment naming it."""
    with SmtpPeer() as smtp:
        email = {**SETTINGS, "smtp": {"port": smtp.port, "timeout": 10}}
        _running.update(smtp=smtp, email=email)
        try:
            yield {"CONVEYOR_EMAIL": json.dumps(email)}
        finally:
            _running.clear()


def check(platform: Platform) -> list[tuple[str, bool, str]]:
    """One message through the peer: the outbox row ends ``SENT`` and the peer has it once."""
    from pipelines.email.messages import send_email, show_message
    from tasks.email.models import allow_test_domains
    from tasks.email.settings import EmailSettings

    smtp: SmtpPeer | None = _running.get("smtp")
    if smtp is None:
        return [("email: skipped", True, "the running worker's CONVEYOR_EMAIL decides where mail goes")]
    before = getattr(platform.settings, "email", None)
    platform.settings.email = EmailSettings.model_validate(_running["email"])  # type: ignore[attr-defined]
    allow_test_domains(True)
    outbox_id = str(uuid.uuid4())
    to = "cliente@empresa.test"
    data = {
        "outboxId": outbox_id,
        "companyId": str(uuid.uuid4()),
        "requestId": "demo",
        "to": to,
        "subject": "Conveyor demo",
        "htmlRef": "",
        "recipient": {"externalId": "demo", "email": to},
        "enqueuedAt": dt.datetime.now(dt.UTC).isoformat(),
    }
    try:
        send_email(platform, data, html="<p>Hello from <b>conveyor demo</b>.</p>")
        deadline = time.monotonic() + 60
        shown = show_message(platform, outbox_id)
        while shown is not None and shown["status"] != "SENT" and time.monotonic() < deadline:
            time.sleep(0.2)
            shown = show_message(platform, outbox_id)
    finally:
        if before is not None:
            platform.settings.email = before  # type: ignore[attr-defined]
    status = shown["status"] if shown else "missing"
    received = [m for m in smtp.messages if m.message_id == f"<{outbox_id}@conveyor.test>"]
    return [
        (
            "1 email sent once through the local SMTP peer",
            status == "SENT" and len(received) == 1,
            f"outbox {status}, {len(received)} received",
        )
    ]
