"""The shop sends an email the seed's way, as a producer without the email family's code:
it stores the HTML and submits ``conveyor.email.send`` by name (its outboxId the job's id)
inside its own ``atomic()``; the deployment's worker makes the outbox row and sends it once
through a local SMTP server."""

import datetime as dt
import hashlib
import json
import os
import socket
import uuid

import pytest
from aiosmtpd.controller import Controller
from django.db import connection, transaction
from shop.models import Order

from conveyor.contrib import django as conveyor

pytestmark = pytest.mark.django_db(transaction=True)

HTML = "<p>Seu pedido foi enviado.</p>"


class Inbox:
    def __init__(self) -> None:
        self.message_ids: list[str] = []

    async def handle_DATA(self, server, session, envelope):  # type: ignore[no-untyped-def]
        for line in envelope.content.decode().splitlines():
            if line.lower().startswith("message-id:"):
                self.message_ids.append(line.split(":", 1)[1].strip())
        return "250 OK"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_shop_sends_an_email_by_name_inside_its_transaction(conveyor_workers, monkeypatch) -> None:
    inbox, port = Inbox(), free_port()
    smtp = Controller(inbox, hostname="127.0.0.1", port=port)
    smtp.start()
    try:
        settings = {"smtp": {"port": port}, "from_address": "loja@shop.test", "allow_test_domains": True}
        monkeypatch.setenv("CONVEYOR_EMAIL", json.dumps(settings))  # the worker's environment
        conveyor_workers.start(root=os.environ["SHOP_DEPLOYMENT"], queues=["email"], django=False)
        outbox_id, ref = str(uuid.uuid4()), hashlib.sha256(HTML.encode()).hexdigest()
        data = {
            "outboxId": outbox_id,
            "companyId": str(uuid.uuid4()),
            "requestId": "shop-1",
            "to": "cliente@empresa.test",
            "subject": "Pedido enviado",
            "htmlRef": ref,
            "recipient": {"externalId": "CUST-1", "email": "cliente@empresa.test"},
            "attempt": 1,
            "enqueuedAt": dt.datetime.now(dt.UTC).isoformat(),
        }
        with transaction.atomic():
            Order.objects.create(number=f"o-{outbox_id[:8]}")
            with connection.cursor() as cursor:
                cursor.execute(
                    "INSERT INTO conveyor.email_html (id, html, created_at) VALUES (%s, %s, now()) "
                    "ON CONFLICT (id) DO NOTHING",
                    [ref, HTML],
                )
            job = conveyor.submit("conveyor.email.send", data, job_id=outbox_id, expires_in=86400, priority=6)
        assert job.id == outbox_id and job.wait(60) == "succeeded"
        again = conveyor.submit("conveyor.email.send", {**data, "requestId": "shop-2"}, job_id=outbox_id)
        assert again.deduplicated
        with connection.cursor() as cursor:
            cursor.execute("SELECT status FROM conveyor.email_outbox WHERE id = %s", [outbox_id])
            assert cursor.fetchone() == ("SENT",)
        assert inbox.message_ids == [f"<{outbox_id}@shop.test>"]
    finally:
        smtp.stop()
