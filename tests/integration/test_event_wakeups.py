"""The outbox's commit wakes event streams: ``GET /events/stream`` re-reads as soon as a
transaction that wrote events has committed (one Redis ``PUBLISH`` per transaction, heard
by one subscriber per process), and still polls when Redis is away.

The API runs in process (uvicorn in a thread, so the stream's poll interval can be set
high): with a 5 s poll, only the wake-up can deliver an event within a fraction of it.
"""

from __future__ import annotations

import json
import queue
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import Connection, func, select

import conveyor
from conveyor.delivery.wakeups import events_channel, subscriber
from conveyor.store.db import schema as s
from conveyor.store.db.engine import make_engine
from conveyor.store.db.schema import job_events, new_event
from conveyor.store.events import announce_commits, sequence_events
from conveyor.store.jobs import JobStore
from conveyor.web import create_app, events
from conveyor.web.feed import body_field
from tests.integration.http_support import Token, auth, free_port, token_fixture

pytestmark = pytest.mark.timeout(120)

token = token_fixture("read")
STORE = JobStore(lease_timeout=8)
ROUNDS = 10


@contextmanager
def api(the_client: conveyor.Client) -> Iterator[str]:
    """The HTTP API around ``the_client``, served by uvicorn in a thread: its base URL."""
    app = create_app(the_client)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        events.streams_end(app).set()  # open streams end, as on `conveyor serve`'s SIGTERM
        server.should_exit = True
        thread.join(timeout=15)


class Reader:
    """An open ``/events/stream``, read in a thread until ``expect`` events came (then it
    hangs up): each event's topic, body and arrival time."""

    def __init__(self, base: str, headers: dict[str, str], params: dict[str, str], expect: int) -> None:
        self.expect = expect
        self.got: queue.Queue[tuple[str, dict[str, Any], float]] = queue.Queue()
        self.opened = threading.Event()
        self._http = httpx.Client(base_url=base, timeout=httpx.Timeout(10, read=60))
        self._thread = threading.Thread(target=self._read, args=(headers, params), daemon=True)
        self._thread.start()
        assert self.opened.wait(10), "the stream did not open"

    def _read(self, headers: dict[str, str], params: dict[str, str]) -> None:
        try:
            with self._http.stream("GET", "/events/stream", headers=headers, params=params) as resp:
                assert resp.status_code == 200
                self.opened.set()
                topic = data = ""
                for line in resp.iter_lines():
                    if line.startswith("event:"):
                        topic = line.partition(":")[2].strip()
                    elif line.startswith("data:"):
                        data = line.partition(":")[2].strip()
                    elif not line and data:
                        self.got.put((topic, json.loads(data)["body"], time.monotonic()))
                        topic = data = ""
                        self.expect -= 1
                        if not self.expect:
                            return
        except httpx.HTTPError:
            pass  # closed by the test

    def next(self, timeout: float) -> tuple[str, dict[str, Any], float]:
        """The next event, or a failure after ``timeout`` seconds."""
        try:
            return self.got.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no event on the stream within {timeout}s")

    def close(self) -> None:
        self._http.close()
        self._thread.join(timeout=10)


def emit(engine: Any, tag: str, i: int, n: int = 1) -> float:
    """Commit ``n`` events of batch ``tag`` in one transaction (as a stage's completion
    does); returns when the commit returned."""
    with engine.begin() as conn:
        STORE.emit(conn, [new_event(None, "wake.test", {"batch_id": tag, "i": i, "k": k}) for k in range(n)])
    return time.monotonic()


def wait_subscribed(platform: Any) -> None:
    settings = platform.settings
    sub = subscriber(settings.redis_url, events_channel(settings.key_prefix))
    assert sub.subscribed.wait(10), "the stream's process did not subscribe to the wake-ups"


def test_a_committed_event_reaches_an_open_stream_well_within_the_poll(
    client: conveyor.Client, platform: Any, token: Token, monkeypatch: pytest.MonkeyPatch, tag: str
) -> None:
    monkeypatch.setattr(events, "POLL_SECONDS", 5.0)  # only a wake-up delivers in time
    admin = auth(token(f"ops-{tag}", "admin"))
    with api(client) as base:
        reader = Reader(base, admin, {"batch": tag}, expect=3 * ROUNDS)
        try:
            wait_subscribed(platform)
            time.sleep(0.2)  # the stream is past its first read, waiting
            latencies = []
            for i in range(ROUNDS):
                committed = emit(platform.engine, tag, i, n=3)
                for k in range(3):
                    topic, body, arrived = reader.next(timeout=10)
                    assert (topic, body["i"], body["k"]) == ("wake.test", i, k)
                latencies.append(arrived - committed)
                time.sleep(0.05)
        finally:
            reader.close()
    median = statistics.median(latencies)
    print(f"commit → stream: median {median * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")
    assert median < 0.3, latencies


def test_a_jobs_events_reach_an_open_stream_without_waiting_for_the_poll(
    client: conveyor.Client,
    platform: Any,
    token: Token,
    worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    tag: str,
) -> None:
    """A job's ``job.submitted`` (the submit's one statement) and ``job.succeeded`` (the
    worker's completion, with and without the stage's own transaction)."""
    monkeypatch.setattr(events, "POLL_SECONDS", 5.0)
    owner = f"alice-{tag}"
    with api(client) as base:
        reader = Reader(base, auth(token(owner)), {}, expect=4)
        try:
            wait_subscribed(platform)
            time.sleep(0.2)
            for stage, payload in (
                ("conveyor.demo.noop", {"n": 1}),
                ("conveyor.demo.effect", {"note": tag}),
            ):
                started = time.monotonic()
                handle = client.submit(stage, payload, owner=owner)
                topics = [reader.next(timeout=10)[0], reader.next(timeout=10)[0]]
                took = time.monotonic() - started
                assert topics == ["job.submitted", "job.succeeded"], stage
                assert handle.wait(10) == s.SUCCEEDED
                assert took < 2.5, f"{stage}: {took:.2f}s, as slow as the poll"
        finally:
            reader.close()


@contextmanager
def silent_redis() -> Iterator[str]:
    """A Redis URL whose server accepts connections and never answers (a frozen Redis)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


def test_with_redis_away_commits_do_not_wait_and_streams_still_poll(
    platform: Any, token: Token, monkeypatch: pytest.MonkeyPatch, tag: str
) -> None:
    monkeypatch.setattr(events, "POLL_SECONDS", 0.2)
    admin = auth(token(f"ops-{tag}", "admin"))
    with silent_redis() as frozen:
        away = conveyor.connect(database_url=platform.settings.database_url, redis_url=frozen)
        try:
            with api(away) as base:
                reader = Reader(base, admin, {"batch": tag}, expect=10)
                try:
                    started = time.monotonic()
                    for i in range(10):
                        emit(away.connections.engine, tag, i)  # its announcer's Redis is the frozen one
                    # One short timeout, then the breaker: ten commits never wait ten times.
                    assert time.monotonic() - started < 2.0
                    got = [reader.next(timeout=5)[1]["i"] for _ in range(10)]
                    assert got == list(range(10))
                finally:
                    reader.close()
        finally:
            away.close()


def test_one_announcement_per_committed_transaction_after_its_commit(platform: Any, tag: str) -> None:
    """Seen from the hook: called once per transaction that wrote events, however many,
    after the commit (the events are visible to another connection by then); never for a
    rollback or a transaction without events."""
    engine = make_engine(platform.settings.database_url, schema=platform.settings.db_schema)
    seen: list[int] = []

    def visible(conn: Connection) -> int:
        q = select(func.count()).select_from(job_events).where(body_field("postgresql", "batch_id") == tag)
        return int(conn.execute(q).scalar_one())

    def announce() -> None:
        with platform.engine.connect() as other:
            seen.append(visible(other))

    announce_commits(engine, announce)
    try:
        emit(engine, tag, 0, n=5)
        assert seen == [5]
        with engine.begin() as conn:  # three writes, one transaction: one announcement
            for i in range(3):
                STORE.emit(conn, [new_event(None, "wake.test", {"batch_id": tag, "i": i})])
        assert seen == [5, 8]
        with engine.connect() as conn:
            STORE.emit(conn, [new_event(None, "wake.test", {"batch_id": tag})])
            conn.rollback()
            conn.execute(select(1))
            conn.commit()
        with engine.begin() as conn:
            conn.execute(select(job_events.c.id).limit(1))
        sequence_events(engine)  # a reader's own write (numbering) is no event
        assert seen == [5, 8]
        with engine.connect() as conn:  # committed, connection kept: announced at the next begin
            STORE.emit(conn, [new_event(None, "wake.test", {"batch_id": tag})])
            conn.commit()
            conn.execute(select(1))
            assert seen == [5, 8, 9]
    finally:
        engine.dispose()
