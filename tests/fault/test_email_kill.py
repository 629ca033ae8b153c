"""The email family under a worker SIGKILL between the peer's acceptance and the commit:
one message at the peer, the outbox ``SENT`` or ``UNKNOWN``, never two sends.

The kill point is deterministic: the peer takes the message, then holds its reply; the
test kills the worker (main process and pool) while the reply is pending, then starts
another. SMTP cannot tell whether the first send arrived: ``hold`` leaves it ``UNKNOWN``
for a person. HTTP sends again under the same ``Idempotency-Key`` and gets the first id.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.store.db import schema as s
from pipelines.email.messages import send_email
from pipelines.email.peers import HttpEmailPeer, SmtpPeer
from tasks.email import tables as t
from tests.fault.conftest import Spawn, kill_group
from tests.helpers import dead_letter_for, eventually
from tests.integration.email_support import HTML, email_settings, message, outbox_row

pytestmark = [pytest.mark.timeout(240), pytest.mark.fault]


def _env(**email: Any) -> dict[str, str]:
    settings = {"from_address": "avisos@conveyor.test", "allow_test_domains": True, **email}
    return {"CONVEYOR_EMAIL": json.dumps(settings)}


def test_smtp_killed_at_data_leaves_one_message_held_unknown(platform: Any, spawn: Spawn, tag: str) -> None:
    with SmtpPeer(reply_delay_s=60) as smtp, email_settings(platform):
        first = spawn(env=_env(smtp={"port": smtp.port, "timeout": 90}))
        outbox_id = send_email(platform, message(tag), html=HTML).outbox_id
        smtp.wait_for(1, timeout=60)
        assert outbox_row(platform, outbox_id)["status"] == t.SENDING
        kill_group(first)
        smtp.reply_delay_s = 0
        spawn(env=_env(smtp={"port": smtp.port, "timeout": 10}))
        assert platform.job(outbox_id).wait(120) == s.DEAD
        assert smtp.count == 1  # never sent twice
    assert outbox_row(platform, outbox_id)["status"] == t.UNKNOWN
    assert dead_letter_for(platform, outbox_id)["error_type"] == "DeliveryUnknown"


def test_http_killed_before_the_reply_sends_again_under_its_key_once(
    platform: Any, spawn: Spawn, tag: str
) -> None:
    with HttpEmailPeer() as peer, email_settings(platform):
        peer.reply_delay_s = 60
        first = spawn(env=_env(provider="http", http={"url": peer.url, "timeout": 90}))
        outbox_id = send_email(platform, message(tag), html=HTML).outbox_id
        eventually(lambda: len(peer.messages) == 1, timeout=60)
        kill_group(first)
        peer.reply_delay_s = 0
        spawn(env=_env(provider="http", http={"url": peer.url, "timeout": 10}))
        assert platform.job(outbox_id).wait(120) == s.SUCCEEDED
        assert len(peer.messages) == 1
        row = outbox_row(platform, outbox_id)
        assert row["status"] == t.SENT and row["provider_message_id"] == peer.messages[0]["id"]
