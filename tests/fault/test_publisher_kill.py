"""The publisher family under a worker SIGKILL after the Graph peer accepted the post and
before its reply: one post at the peer, the record ``completed`` with that post's id.

The kill point is deterministic: the peer records the post (Facebook: the feed post;
Instagram: the ``media_publish``, so the container is ``PUBLISHED``), then holds its reply;
the test kills the worker (main process and pool) meanwhile and starts another. Graph has no
idempotency: the retry must find what the killed attempt made. Facebook: ``sending_at``
committed before the request, so the retry looks in the feed first. Instagram: the stored
container reads ``PUBLISHED``, so the retry finds the media by its caption.
"""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.store.db import schema as s
from pipelines.publisher import schedule_post
from pipelines.publisher.peers import GraphPeer
from tasks.publisher import tables as t
from tests.fault.conftest import Spawn, kill_group
from tests.fault.publisher_support import creating, of_account, publishing
from tests.integration.publisher_support import plan, post_row

pytestmark = [pytest.mark.timeout(120), pytest.mark.fault]


@pytest.mark.parametrize("channel", ["facebook", "instagram"])
def test_sigkill_after_the_peer_accepted_leaves_one_post(
    platform: Any, spawn: Spawn, tag: str, channel: str
) -> None:
    account = f"acct-{tag}"
    with GraphPeer() as peer, publishing(platform, peer) as env:
        peer.hold_after_accept_s = 3.0
        first = spawn(env=env)
        done = schedule_post(platform, plan(tag, channel))
        assert peer.wait_accepted(1, timeout=60)
        assert post_row(platform, done.id)["status"] == t.RUNNING
        kill_group(first)  # the reply is still held: the attempt never learns the id
        peer.hold_after_accept_s = 0.0
        spawn(env=env)
        assert platform.job(done.job_id).wait(60) == s.SUCCEEDED
        made = peer.posts(account) if channel == "facebook" else peer.media(account)
        assert len(made) == 1, made
        assert len([r for r in of_account(peer, account) if creating(r)]) == 1  # never posted again
        assert any(r.method == "GET" for r in of_account(peer, account))  # it looked instead
        if channel == "instagram":
            [container] = [c for c in peer.containers.values() if c["account"] == account]
            assert container["status_code"] == "PUBLISHED"
    row = post_row(platform, done.id)
    assert (row["status"], row["remote_id"]) == (t.COMPLETED, made[0]["id"])
    assert row["attempts"] == 2
