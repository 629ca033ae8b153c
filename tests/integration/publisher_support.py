"""What the publisher family's tests share: its settings pointed at a local Graph peer, a
plan, and reading records and events."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import select

from conveyor.store.db.schema import job_events
from pipelines.publisher import Plan
from pipelines.publisher.peers import GraphPeer
from tasks.publisher import tables as t
from tasks.publisher.settings import PublisherSettings

TOKEN = "graph-test-token"


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@contextmanager
def publisher_settings(platform: Any, peer: GraphPeer, **settings: Any) -> Iterator[PublisherSettings]:
    """The platform's ``CONVEYOR_PUBLISHER`` pointed at ``peer`` for the block (the stages
    read it at each post)."""
    before = platform.settings.publisher
    data: dict[str, Any] = {"graph_url": peer.url, "tokens": {"*": peer.token}, "timeout": 5, **settings}
    chosen = PublisherSettings.model_validate(data)
    platform.settings.publisher = chosen
    try:
        yield chosen
    finally:
        platform.settings.publisher = before


def plan(tag: str, channel: str = "facebook", *, at: dt.datetime | None = None, **changes: Any) -> Plan:
    """A plan whose brand and account carry ``tag``, due now unless ``at``."""
    values: dict[str, Any] = {
        "brand": f"brand-{tag}",
        "channel": channel,
        "account": f"acct-{tag}",
        "caption": f"Hello from {tag}",
        "scheduled_at": at or now(),
        "media": ("https://cdn.example.test/a.jpg",) if channel == "instagram" else (),
    }
    values.update(changes)
    return Plan(**values)


def post_row(platform: Any, post_id: str) -> Any:
    with platform.engine.connect() as conn:
        return conn.execute(select(t.posts).where(t.posts.c.id == post_id)).mappings().first()


def children(platform: Any, post_id: str) -> list[Any]:
    with platform.engine.connect() as conn:
        return list(conn.execute(select(t.posts).where(t.posts.c.parent_id == post_id)).mappings())


def topics(platform: Any, job_id: str) -> list[str]:
    with platform.engine.connect() as conn:
        query = select(job_events.c.topic).where(job_events.c.job_id == job_id).order_by(job_events.c.id)
        return list(conn.execute(query).scalars())


def events(platform: Any, job_id: str, topic: str) -> list[dict[str, Any]]:
    with platform.engine.connect() as conn:
        query = select(job_events.c.body).where(job_events.c.job_id == job_id, job_events.c.topic == topic)
        return [dict(b) for b in conn.execute(query).scalars()]
