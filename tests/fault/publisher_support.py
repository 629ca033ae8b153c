"""What the publisher family's fault tests share: one ``CONVEYOR_PUBLISHER`` for the test
process and its worker subprocesses, and reading the Graph peer's request log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipelines.publisher.peers import GraphPeer, RequestRecord
from tests.integration.publisher_support import publisher_settings


def worker_env(peer: GraphPeer, **settings: Any) -> dict[str, str]:
    """The environment that points a worker subprocess at ``peer`` (the same settings
    :func:`publisher_settings` gives the test process)."""
    data: dict[str, Any] = {"graph_url": peer.url, "tokens": {"*": peer.token}, "timeout": 5, **settings}
    return {"CONVEYOR_PUBLISHER": json.dumps(data)}


@contextmanager
def publishing(platform: Any, peer: GraphPeer, **settings: Any) -> Iterator[dict[str, str]]:
    """For the block, the test process schedules against ``peer``; yields the workers' env."""
    with publisher_settings(platform, peer, **settings):
        yield worker_env(peer, **settings)


def creating(record: RequestRecord) -> bool:
    """Whether a request is one that makes a post or a media (Graph's non-idempotent calls)."""
    return record.method == "POST" and record.path.rstrip("/").endswith(("/feed", "/media_publish"))


def of_account(peer: GraphPeer, account: str) -> list[RequestRecord]:
    """The peer's requests on ``account``'s paths (the container reads are not among them)."""
    return [r for r in peer.requests if r.target == account]
