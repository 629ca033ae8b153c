"""The RabbitMQ tier (CONVEYOR_TEST_BROKER=amqp): real prefork workers, as the fault tier,
and a private node per module with its own database and Redis DB (``cluster``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import func, select

from config.migrations import upgrade
from conveyor.client import registry
from conveyor.client.by_name import Client
from conveyor.store.db import schema as s
from conveyor.store.db.engine import make_engine
from tasks.demo.models import effects
from tests.fault.conftest import spawn
from tests.helpers import scratch_database, scratch_redis
from tests.rabbit_support import PrivateRabbit

__all__ = ["Cluster", "cluster", "spawn"]


@dataclass
class Cluster:
    """A private node, a scratch database and Redis DB, and a client of them."""

    node: PrivateRabbit
    settings: Any
    client: Client

    def effects(self, note: str) -> int:
        with self.client.connections.engine.connect() as conn:
            return int(conn.execute(select(func.count()).where(effects.c.note == note)).scalar_one())

    def submit(self, tag: str, n: int, **payload: Any) -> list[Any]:
        return [
            self.client.submit("conveyor.demo.effect", {"note": f"{tag}-{i}", **payload}) for i in range(n)
        ]

    def all_once(self, handles: list[Any], tag: str, timeout: float = 120.0) -> None:
        for handle in handles:
            assert handle.wait(timeout) == s.SUCCEEDED, handle.row()
        counts = [self.effects(f"{tag}-{i}") for i in range(len(handles))]
        assert counts == [1] * len(handles), counts


@pytest.fixture(scope="module")
def cluster(services: None, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A private node (``NODE_OPTIONS`` of the module, if any: see :class:`PrivateRabbit`),
    with a scratch database and Redis DB, and a client of them."""
    from config.celery_app import platform

    node = PrivateRabbit(**getattr(request.module, "NODE_OPTIONS", {}))
    node.start(first=True)
    try:
        with scratch_database("conveyor_rabbit") as db, scratch_redis() as redis_url:
            engine = make_engine(db)
            upgrade(engine)
            registry.refresh(engine, platform.stages.values())  # what a client submits by name
            engine.dispose()
            settings = platform.settings.model_copy(
                update={"broker_url": node.url, "redis_url": redis_url, "database_url": db}
            )
            client = Client(settings)
            try:
                yield Cluster(node, settings, client)
            finally:
                client.close()
    finally:
        node.close()
