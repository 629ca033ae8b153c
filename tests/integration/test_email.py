"""The email family's promises with an in-process worker, real Postgres and Redis, and real
local peers (aiosmtpd, an HTTP email API): sent once, refusals and outages answered, the
unknown held and settled, duplicates returned, conflicts refused, expiry recorded."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import conveyor
from conveyor.client import registry
from conveyor.errors import IdempotencyConflict, PayloadInvalid
from conveyor.retry import Schedule
from conveyor.store.db import schema as s
from conveyor.store.db.dialect import db_now
from conveyor.upkeep.reconciler import TickReport
from pipelines.email.messages import NotResolvable, resolve, send_email, show_message
from pipelines.email.peers import HttpEmailPeer, SmtpPeer
from tasks.email import tables as t
from tasks.email.models import STAGE
from tests.helpers import dead_letter_for, eventually, job_row
from tests.integration.email_support import (
    HTML,
    email_settings,
    http_at,
    log_row,
    message,
    outbox_row,
    smtp_at,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def smtp() -> Iterator[SmtpPeer]:
    with SmtpPeer() as peer:
        yield peer


def _sent(platform: Any, tag: str, **changes: Any) -> str:
    return send_email(platform, message(tag, **changes), html=HTML).outbox_id


def test_a_message_is_sent_once_and_recorded(platform: Any, worker: Any, smtp: SmtpPeer, tag: str) -> None:
    with email_settings(platform, **smtp_at(smtp.port)):
        sent = send_email(platform, message(tag, cc=[f"copia.{tag}@empresa.test"]), html=HTML, priority=1)
        assert sent.status == t.PENDING and not sent.deduplicated
        job = platform.job(sent.outbox_id)
        assert job.wait(30) == s.SUCCEEDED
    assert job.row()["priority"] == 10  # the seed's 1 (first) is Conveyor's 10
    [received] = smtp.wait_for(1)
    assert received.message_id == f"<{sent.outbox_id}@conveyor.test>"
    assert set(received.rcpt_tos) == {f"cliente.{tag}@empresa.test", f"copia.{tag}@empresa.test"}
    row = outbox_row(platform, sent.outbox_id)
    assert row["status"] == t.SENT and row["provider"] == "smtp" and row["attempts"] == 1
    assert row["provider_message_id"] == received.message_id
    assert log_row(platform, sent.outbox_id)["attempt"] == 1
    result = job.result
    assert (
        result["status"] == "SENT" and result["messageId"] == received.message_id and result["refused"] == []
    )


def test_the_same_message_again_is_the_same_job_and_another_is_a_conflict(
    platform: Any, worker: Any, smtp: SmtpPeer, tag: str
) -> None:
    with email_settings(platform, **smtp_at(smtp.port)):
        data = message(tag)
        first = send_email(platform, data, html=HTML)
        again = send_email(platform, {**data, "requestId": "another", "attempt": 2}, html=HTML)
        assert again.outbox_id == first.outbox_id and again.deduplicated
        with pytest.raises(IdempotencyConflict, match="conflict"):
            send_email(platform, {**data, "subject": "Outro assunto"}, html=HTML)
        with pytest.raises(IdempotencyConflict):
            send_email(platform, data, html=HTML + "<p>changed</p>")
        assert platform.job(first.outbox_id).wait(30) == s.SUCCEEDED
    assert len(smtp.wait_for(1)) == 1
    with platform.engine.connect() as conn:
        assert conn.execute(select(func.count()).where(t.outbox.c.id == first.outbox_id)).scalar_one() == 1


def test_an_invalid_message_is_refused_naming_the_field_and_nothing_is_recorded(
    platform: Any, smtp: SmtpPeer, tag: str
) -> None:
    with email_settings(platform, **smtp_at(smtp.port)):
        bad = message(tag, to=f"not-an-address-{tag}")
        with pytest.raises(PayloadInvalid) as caught:
            send_email(platform, bad, html=HTML)
    assert "to:" in str(caught.value) and tag not in str(caught.value)
    assert outbox_row(platform, bad["outboxId"]) is None and job_row(platform, bad["outboxId"]) is None


def test_some_recipients_refused_go_to_the_rest_and_are_recorded(
    platform: Any, worker: Any, tag: str
) -> None:
    refused = f"ninguem.{tag}@empresa.test"
    with SmtpPeer(refuse=lambda addr: 550 if addr == refused else None) as smtp:
        with email_settings(platform, **smtp_at(smtp.port)):
            outbox_id = _sent(platform, tag, cc=[refused])
            assert platform.job(outbox_id).wait(30) == s.SUCCEEDED
        assert smtp.wait_for(1)[0].rcpt_tos == (f"cliente.{tag}@empresa.test",)
    row = outbox_row(platform, outbox_id)
    assert row["status"] == t.SENT and row["refused"] == [refused]
    assert platform.job(outbox_id).result["refused"] != [refused]  # masked where people see it


def test_every_recipient_refused_is_dead_lettered_after_one_attempt(
    platform: Any, worker: Any, tag: str
) -> None:
    with SmtpPeer(refuse=lambda addr: 550) as smtp, email_settings(platform, **smtp_at(smtp.port)):
        outbox_id = _sent(platform, tag)
        assert platform.job(outbox_id).wait(30) == s.DEAD
    entry = dead_letter_for(platform, outbox_id)
    assert entry["error_type"] == "EmailRejected" and entry["attempts"] == 1
    row = outbox_row(platform, outbox_id)
    assert row["status"] == t.FAILED and tag not in (row["last_error"] or "")


def test_a_provider_down_is_retried_then_dead_lettered_and_never_left_sending(
    platform: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stage as CONVEYOR_EMAIL='{"retry_delays": [0.2]}' declares it at import.
    task = platform.app.tasks[STAGE]
    monkeypatch.setattr(task, "spec", dataclasses.replace(task.spec, retry=Schedule((0.2,))))
    closed = SmtpPeer()  # never started: its port refuses connections
    with email_settings(platform, **smtp_at(closed.port)):
        outbox_id = _sent(platform, tag)
        job = platform.job(outbox_id)
        assert job.wait(60) == s.DEAD
    assert job.row()["attempts"] == 5  # max_attempts as declared (the seed's 5)
    row = outbox_row(platform, outbox_id)
    assert row["status"] == t.FAILED and "connect" in (row["last_error"] or "").lower()
    assert dead_letter_for(platform, outbox_id)["error_type"] == "ProviderUnavailable"


def test_missing_html_is_permanent(platform: Any, worker: Any, smtp: SmtpPeer, tag: str) -> None:
    from tasks.email.models import html_ref_for

    with email_settings(platform, **smtp_at(smtp.port)):
        outbox_id = send_email(platform, message(tag), html=HTML + tag, delay=1).outbox_id
        with platform.engine.begin() as conn:  # gone before the job runs (a producer's cleanup)
            conn.execute(t.html.delete().where(t.html.c.id == html_ref_for(HTML + tag)))
        assert platform.job(outbox_id).wait(30) == s.DEAD
    assert dead_letter_for(platform, outbox_id)["error_type"] == "HtmlNotFound"
    assert outbox_row(platform, outbox_id)["status"] == t.FAILED and smtp.count == 0


def test_a_lost_reply_at_data_is_held_unknown_and_resolved_both_ways(
    platform: Any, worker: Any, tag: str
) -> None:
    with SmtpPeer(drop_at_data=True) as smtp, email_settings(platform, **smtp_at(smtp.port)):
        first, second = _sent(platform, f"{tag}a"), _sent(platform, f"{tag}b")
        for outbox_id in (first, second):
            assert platform.job(outbox_id).wait(30) == s.DEAD
            assert outbox_row(platform, outbox_id)["status"] == t.UNKNOWN
            entry = dead_letter_for(platform, outbox_id)
            assert entry["error_type"] == "DeliveryUnknown" and "delivery state unknown" in entry["message"]
        assert smtp.count == 2  # each went out once, and nobody knows
        assert resolve(platform, first, delivered=True, by="test") == t.SENT
        assert outbox_row(platform, first)["status"] == t.SENT
        assert dead_letter_for(platform, first)["retried_at"] is not None
        with pytest.raises(NotResolvable):
            resolve(platform, first, delivered=True, by="test")
        smtp.drop_at_data = False
        assert resolve(platform, second, delivered=False, by="test") == t.PENDING
        assert platform.job(second).wait(30) == s.SUCCEEDED
    assert outbox_row(platform, second)["status"] == t.SENT
    assert [m.message_id for m in smtp.messages].count(f"<{second}@conveyor.test>") == 2  # resend: documented
    assert job_row(platform, second)["expires_at"] > job_row(platform, second)["created_at"]


def test_http_sends_an_unknown_again_under_its_idempotency_key(platform: Any, worker: Any, tag: str) -> None:
    with HttpEmailPeer() as peer:
        peer.drop_after_accept = True
        with email_settings(platform, **http_at(peer.url), retry_delays=[0.1]):
            outbox_id = _sent(platform, tag)
            eventually(lambda: outbox_row(platform, outbox_id)["status"] == t.SENDING)
            peer.drop_after_accept = False
            assert platform.job(outbox_id).wait(30) == s.SUCCEEDED
        assert len(peer.messages) == 1
    row = outbox_row(platform, outbox_id)
    assert row["status"] == t.SENT and row["provider_message_id"] == peer.messages[0]["id"]


def test_a_client_without_the_code_submits_by_name_and_the_row_comes_at_the_first_attempt(
    platform: Any, worker: Any, smtp: SmtpPeer, tag: str
) -> None:
    registry.write(platform.engine, platform.stages.values())
    client = conveyor.connect(
        database_url=platform.settings.database_url, redis_url=platform.settings.redis_url
    )
    with email_settings(platform, **smtp_at(smtp.port)):
        with Session(platform.engine) as session:  # the HTML, stored by the producer
            from tasks.email.models import html_ref_for

            ref = html_ref_for(HTML + tag)
            session.execute(t.html.insert().values(id=ref, html=HTML + tag, created_at=db_now()))
            session.commit()
        data = message(tag, htmlRef=ref)
        try:
            job = client.submit(STAGE, data, job_id=data["outboxId"], expires_in=86400)
            assert job.wait(30) == s.SUCCEEDED
            again = client.submit(STAGE, {**data, "requestId": "x"}, job_id=data["outboxId"])
            assert again.deduplicated
            with pytest.raises(IdempotencyConflict):
                client.submit(STAGE, {**data, "subject": "Outro"}, job_id=data["outboxId"])
        finally:
            client.close()
    assert outbox_row(platform, data["outboxId"])["status"] == t.SENT and smtp.count == 1


def test_expiry_is_recorded_by_the_sweep_and_by_the_claim(platform: Any, smtp: SmtpPeer, tag: str) -> None:
    """No worker here: the jobs wait, expire, and are found so."""
    with email_settings(platform, **smtp_at(smtp.port)):
        swept = send_email(platform, message(f"{tag}s"), html=HTML, delay=3600).outbox_id
        claimed = send_email(platform, message(f"{tag}c"), html=HTML, delay=3600).outbox_id
    with platform.engine.begin() as conn:
        from sqlalchemy import update

        conn.execute(update(s.jobs).where(s.jobs.c.id.in_([swept, claimed])).values(expires_at=db_now()))
    time.sleep(0.05)
    with platform.engine.begin() as conn:
        platform.store.claim(conn, claimed, owner="test/1", task_id=str(uuid.uuid4()))
    with platform.engine.begin() as conn:
        platform.relay().reconciler.reconcile(conn, TickReport())
    for outbox_id in (swept, claimed):
        assert job_row(platform, outbox_id)["status"] == s.EXPIRED
        assert outbox_row(platform, outbox_id)["status"] == t.EXPIRED
    assert smtp.count == 0


def test_show_masks_addresses(platform: Any, worker: Any, smtp: SmtpPeer, tag: str) -> None:
    with email_settings(platform, **smtp_at(smtp.port)):
        outbox_id = _sent(platform, tag)
        platform.job(outbox_id).wait(30)
    shown = show_message(platform, outbox_id)
    assert shown is not None and shown["to"] == "c***@e***.test" and shown["status"] == t.SENT
    assert tag not in repr(shown)


@pytest.mark.parametrize(
    ("changes", "options", "field"),
    [
        ({"outboxId": "ABCDEF00-0000-4000-8000-00000000000A"}, {}, "outboxId"),  # two spellings, two jobs
        ({"htmlRef": "f" * 64}, {"html": None}, "htmlRef"),  # names nothing stored
        ({}, {"html": "   "}, "html"),
        ({}, {"delay": 86400}, "delay"),  # it would expire before it is due
    ],
)
def test_send_email_refuses_what_could_never_be_sent_right(
    platform: Any, smtp: SmtpPeer, tag: str, changes: dict[str, Any], options: dict[str, Any], field: str
) -> None:
    data = message(tag, **changes)
    with email_settings(platform, **smtp_at(smtp.port)), pytest.raises(PayloadInvalid, match=field):
        send_email(platform, data, **{"html": HTML, **options})
    assert outbox_row(platform, data["outboxId"]) is None and job_row(platform, data["outboxId"]) is None


def test_an_international_domain_goes_out_in_ascii(
    platform: Any, worker: Any, smtp: SmtpPeer, tag: str
) -> None:
    to = f"jose.{tag}@exämple.test"
    with email_settings(platform, **smtp_at(smtp.port)):
        outbox_id = _sent(platform, tag, to=to, recipient={"externalId": tag, "email": to})
        assert platform.job(outbox_id).wait(30) == s.SUCCEEDED
    assert smtp.wait_for(1)[0].rcpt_tos == (f"jose.{tag}@xn--exmple-cua.test",)
