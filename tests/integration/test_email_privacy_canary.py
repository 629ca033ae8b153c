"""A canary: distinctive addresses and a CPF sent through the email family's success, retry,
dead-letter and unknown-delivery paths appear only where the message must be kept (the
job's payload, the outbox, the recipient's own row), never in logs, events, dead letters,
job labels, errors or what Flower shows of a message (its ``kwargsrepr``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery.signals import before_task_publish
from sqlalchemy import text

from conveyor.retry import Schedule
from conveyor.store.db import schema as s
from pipelines.email.messages import send_email
from pipelines.email.peers import SmtpPeer
from tasks.email.models import STAGE
from tasks.email.privacy import cpf_cnpj_hash
from tests.integration.email_support import HTML, email_settings, message, smtp_at

pytestmark = pytest.mark.timeout(180)

# Where the message itself must live (table, column): nowhere else.
ALLOWED = {
    ("jobs", "payload"),
    ("email_outbox", "to_address"),
    ("email_outbox", "refused"),
    ("email_recipients", "email"),
    ("email_recipients", "cpf_cnpj_hash"),
}
KEY = b"canary-key-0123456789abcdef0123"
CPF = "39053344705"


@pytest.fixture
def published() -> Iterator[list[str]]:
    seen: list[str] = []

    def record(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == STAGE and headers:
            seen.append(str(headers.get("kwargsrepr")))

    before_task_publish.connect(record, weak=False)
    yield seen
    before_task_publish.disconnect(record)


def _found_in_database(platform: Any, needle: str) -> set[tuple[str, str]]:
    """Every (table, column) of Conveyor's schema whose text holds ``needle``."""
    schema = platform.settings.db_schema
    found: set[tuple[str, str]] = set()
    with platform.engine.connect() as conn:
        columns = conn.execute(
            text(
                "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = :schema "
                "AND data_type IN ('text', 'character varying', 'json', 'jsonb')"
            ),
            {"schema": schema},
        ).all()
        for table, column in columns:
            hit = conn.execute(
                text(f'SELECT 1 FROM "{schema}"."{table}" WHERE CAST("{column}" AS text) LIKE :n LIMIT 1'),
                {"n": f"%{needle}%"},
            ).first()
            if hit is not None:
                found.add((table, column))
    return found


def test_addresses_and_cpfs_stay_in_the_payload_and_the_outbox(
    platform: Any,
    worker: Any,
    tag: str,
    caplog: pytest.LogCaptureFixture,
    published: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    task = platform.app.tasks[STAGE]
    monkeypatch.setattr(task, "spec", dataclasses.replace(task.spec, retry=Schedule((0.1,))))
    canary = f"zq{tag}"  # in every local part and domain below
    hashed = cpf_cnpj_hash(CPF, KEY)

    def addressed(n: int, **changes: Any) -> dict[str, Any]:
        to = f"{canary}.{n}@{canary}.test"
        recipient = {"cpfCnpjHash": hashed, "nome": f"Nome {canary}", "email": to}
        return message(tag, to=to, cc=[f"cc.{canary}.{n}@{canary}.test"], recipient=recipient, **changes)

    refused_cc = f"refused.{canary}@{canary}.test"
    flaky = {"left": 2}  # the to and cc of message 3, once each: the retry path

    def refuse(address: str) -> int | None:
        if address == refused_cc or f"{canary}.2@" in address:
            return 550
        if f"{canary}.3@" in address and flaky["left"]:
            flaky["left"] -= 1
            return 451
        return None

    with SmtpPeer(refuse=refuse) as smtp, email_settings(platform, **smtp_at(smtp.port)):
        ok = send_email(platform, addressed(1, bcc=[refused_cc]), html=HTML).outbox_id  # success, one refused
        dead = send_email(platform, addressed(2), html=HTML).outbox_id  # every recipient refused: DLQ
        retried = send_email(platform, addressed(3), html=HTML).outbox_id  # 451 once, then sent
        statuses = {platform.job(i).wait(60) for i in (ok, retried)} | {platform.job(dead).wait(60)}
        assert statuses == {s.SUCCEEDED, s.DEAD}
        assert platform.job(retried).row()["attempts"] == 2 and platform.job(dead).status() == s.DEAD
    with SmtpPeer(drop_at_data=True) as lost, email_settings(platform, **smtp_at(lost.port)):
        unknown = send_email(platform, addressed(4), html=HTML).outbox_id
        assert platform.job(unknown).wait(60) == s.DEAD

    assert _found_in_database(platform, canary) <= ALLOWED | {("email_recipients", "nome")}
    assert _found_in_database(platform, CPF) == set()
    assert _found_in_database(platform, hashed) <= ALLOWED
    logs = caplog.text
    assert canary not in logs and CPF not in logs and hashed not in logs
    assert published and not any(canary in shown for shown in published)
    for job_id in (ok, dead, retried, unknown):
        row = platform.job(job_id).row()
        assert canary not in (row["label"] or "") and canary not in str(row["result"] or "")
