"""The event feed of the HTTP API: ``GET /events`` pages the outbox in commit order with a
cursor, ``GET /events/stream`` streams it as Server-Sent Events. In process (TestClient)
for tokens, owners, filters and paging; against a live ``conveyor serve`` with a real
worker for the stream: a client that disconnects midway and reconnects with
``Last-Event-ID`` receives every event of 1,000 jobs exactly once, in order."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from celery import chain
from fastapi.testclient import TestClient
from sqlalchemy import select

import conveyor
import tasks.demo as demo
from conveyor.client import registry
from conveyor.store.db import schema as s
from conveyor.store.db.schema import job_events, jobs, new_event
from conveyor.store.events import sequence_events
from conveyor.store.jobs import JobStore
from conveyor.web import create_app, events, tokens
from conveyor.web.feed import FeedFilter, read_page
from conveyor.web.limits import HeldLimit
from tests.helpers import job_row
from tests.integration.http_support import Token, auth, problem, serving, token_fixture

pytestmark = pytest.mark.timeout(120)

token = token_fixture("read")
ENDPOINTS = ["/events", "/events/stream"]
STREAM_JOBS = int(os.environ.get("CONVEYOR_STREAM_JOBS", "1000"))


def later(client: conveyor.Client, owner: str, n: int = 1) -> str:
    """A job of ``owner`` due in a minute (nothing runs it meanwhile): its id."""
    return client.submit("conveyor.demo.square", {"n": n}, owner=owner, delay=60).id


def outbox(platform: Any, *where: Any) -> list[int]:
    """The ids of the events matching ``where`` (on ``job_events`` joined to ``jobs``), in commit order.
    Committed events are numbered first, as the feed does before it reads: an event not yet
    numbered has no place in commit order (it would sort last)."""
    sequence_events(platform.engine)
    q = select(job_events.c.id).join(jobs, jobs.c.id == job_events.c.job_id).where(*where)
    with platform.engine.connect() as conn:
        return [int(i) for i in conn.execute(q.order_by(job_events.c.seq)).scalars()]


def read_all(http: TestClient, secret: str, since: str | None = None, **params: Any) -> tuple[list[Any], str]:
    """Every page from ``since`` on: the events and the last cursor."""
    found: list[Any] = []
    cursor = since
    while True:
        page = http.get(
            "/events", params={**params, **({"since": cursor} if cursor else {})}, headers=auth(secret)
        )
        assert page.status_code == 200, page.text
        found += page.json()["events"]
        if page.json()["cursor"] == cursor and not page.json()["events"]:
            return found, cursor or ""
        cursor = page.json()["cursor"]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_token_or_a_bad_one_is_401_and_no_read_scope_is_403(
    http: TestClient, platform: Any, token: Token, tag: str, path: str
) -> None:
    revoked = token(f"alice-{tag}")
    tokens.revoke(platform.engine, revoked.split("_")[1])
    for headers in ({}, auth("not-a-token"), auth(revoked)):
        problem(http.get(path, headers=headers), 401, "unauthorized")
    resp = http.get(path, headers=auth(token(f"alice-{tag}", "submit")))
    assert "read" in problem(resp, 403, "forbidden")["detail"]
    assert "insufficient_scope" in resp.headers["WWW-Authenticate"]
    # Another owner by name: only an admin may ask.
    problem(
        http.get(path, params={"owner": f"bob-{tag}"}, headers=auth(token(f"alice-{tag}"))), 403, "forbidden"
    )
    problem(
        http.get(path, params={"since": "x:y:z"}, headers=auth(token(f"alice-{tag}"))), 422, "invalid-cursor"
    )


def test_owners_see_only_their_own_events_and_admin_sees_all(
    http: TestClient, client: conveyor.Client, token: Token, tag: str
) -> None:
    alice, bob, admin = token(f"alice-{tag}"), token(f"bob-{tag}"), token(f"ops-{tag}", "admin")
    _, start = read_all(http, admin)
    alices = {later(client, f"alice-{tag}") for _ in range(3)}
    bobs = {later(client, f"bob-{tag}") for _ in range(2)}
    ownerless = client.submit("conveyor.demo.square", {"n": 1}, delay=60).id

    seen_by_alice = read_all(http, alice, start)[0]
    assert {e["job_id"] for e in seen_by_alice} == alices
    assert read_all(http, alice, start, owner=f"alice-{tag}")[0] == seen_by_alice
    assert {e["job_id"] for e in read_all(http, bob, start)[0]} == bobs
    everything = read_all(http, admin, start)[0]
    assert alices | bobs | {ownerless} <= {e["job_id"] for e in everything}
    assert {e["job_id"] for e in read_all(http, admin, start, owner=f"bob-{tag}")[0]} == bobs
    # Alice's job by id, asked by bob: nothing (not an error: the feed of bob's jobs has none of it).
    one = sorted(alices)[0]
    assert read_all(http, bob, start, job=one)[0] == []
    assert {e["job_id"] for e in read_all(http, alice, start, job=one)[0]} == {one}
    assert {e["job_id"] for e in read_all(http, admin, start, job=one)[0]} == {one}


def test_filters_by_job_and_flow(
    http: TestClient, client: conveyor.Client, platform: Any, token: Token, worker: Any, tag: str
) -> None:
    admin, alice = token(f"ops-{tag}", "admin"), token(f"alice-{tag}")
    _, start = read_all(http, admin)
    flow = chain(demo.square_stage.s(n=2), demo.square_stage.s(), demo.square_stage.s()).apply_async()
    assert platform.job(flow.id).wait(30) == s.SUCCEEDED
    root = job_row(platform, flow.id)["flow_id"]
    members = outbox(platform, jobs.c.flow_id == root)
    assert len(members) >= 6  # three jobs, each submitted and finished
    by_flow = read_all(http, admin, start, flow=root)[0]
    assert [e["id"] for e in by_flow] == members
    assert read_all(http, alice, start, flow=root)[0] == []  # a canvas's jobs have no owner: admin's
    # A job alone is its own flow.
    mine = later(client, f"alice-{tag}")
    assert [e["job_id"] for e in read_all(http, alice, start, flow=mine)[0]] == [mine]
    assert [e["topic"] for e in read_all(http, alice, start, job=mine)[0]] == ["job.submitted"]


def test_filter_by_batch_matches_the_batch_id_events_carry(
    http: TestClient, client: conveyor.Client, platform: Any, token: Token, tag: str
) -> None:
    alice, admin = token(f"alice-{tag}"), token(f"ops-{tag}", "admin")
    _, start = read_all(http, admin)
    hers, his = later(client, f"alice-{tag}"), later(client, f"bob-{tag}")
    store = JobStore(lease_timeout=8)
    with platform.engine.begin() as conn:  # as a deployment's stage emits them (ctx.emit)
        store.emit(
            conn,
            [
                new_event(hers, "batch.progress", {"batch_id": tag, "done": 1}),
                new_event(his, "batch.progress", {"batch_id": tag, "done": 1}),
                new_event(hers, "batch.progress", {"batch_id": f"{tag}-other", "done": 1}),
                new_event(None, "batch.sealed", {"batch_id": tag}),
                new_event(hers, "batch.progress", {"batch_id": tag, "done": 2}),
            ],
        )
    mine = read_all(http, alice, start, batch=tag)[0]
    assert [(e["job_id"], e["body"].get("done")) for e in mine] == [(hers, 1), (hers, 2)]
    every = read_all(http, admin, start, batch=tag)[0]
    assert [(e["job_id"], e["topic"]) for e in every] == [
        (hers, "batch.progress"),
        (his, "batch.progress"),
        (None, "batch.sealed"),  # no job, no owner: an admin's only
        (hers, "batch.progress"),
    ]


def test_pages_return_every_event_once_in_commit_order_while_jobs_are_submitted(
    http: TestClient, client: conveyor.Client, platform: Any, token: Token, tag: str
) -> None:
    owner = f"alice-{tag}"
    secret = token(owner)
    _, cursor = read_all(http, secret)
    made: list[str] = []

    def submit_some() -> None:
        for i in range(60):
            made.append(later(client, owner, i))

    writer = threading.Thread(target=submit_some)
    writer.start()
    got: list[dict[str, Any]] = []
    while writer.is_alive():
        page = http.get("/events", params={"since": cursor, "limit": 4}, headers=auth(secret)).json()
        assert len(page["events"]) <= 4
        got += page["events"]
        cursor = page["cursor"]
    writer.join()
    got += read_all(http, secret, cursor, limit=4)[0]
    ids = [e["id"] for e in got]
    assert ids == outbox(platform, jobs.c.owner == owner) and len(ids) == len(set(ids)) == 60
    positions = [int(e["position"]) for e in got]
    assert positions == sorted(positions)
    assert {e["job_id"] for e in got} == set(made)


def test_the_stream_sends_heartbeats_while_nothing_happens(
    platform: Any, monkeypatch: pytest.MonkeyPatch, tag: str
) -> None:
    monkeypatch.setattr(events, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setattr(events, "POLL_SECONDS", 0.05)
    where = FeedFilter(owner=f"nobody-{tag}")

    async def first_frames() -> list[str]:
        end = threading.Event()
        page = read_page(platform.engine, None, where, 10)
        stream = events._stream(platform.engine, where, page, end, slots.hold("a stream"))
        frames = [await anext(stream) for _ in range(3)]
        end.set()  # the server shuts down: the stream ends
        frames += [frame async for frame in stream]
        return frames

    slots = HeldLimit(1)
    assert anyio.run(first_frames) == ["retry: 2000\n\n", ": keep-alive\n\n", ": keep-alive\n\n"]
    slots.hold("another").release()  # the ended stream gave its slot back


def test_on_sqlite(on_sqlite: Any, tag: str) -> None:
    registry.write(on_sqlite.engine, on_sqlite.stages.values())
    client = conveyor.connect(
        database_url=on_sqlite.settings.database_url, redis_url=on_sqlite.settings.redis_url
    )
    alice = tokens.create(on_sqlite.engine, owner="alice", scopes=["read"]).secret
    try:
        with TestClient(create_app(client)) as http:
            hers = [later(client, "alice", i) for i in range(3)]
            later(client, "bob")
            with on_sqlite.engine.begin() as conn:
                JobStore(lease_timeout=8).emit(
                    conn, [new_event(hers[1], "batch.progress", {"batch_id": tag})]
                )
            every = read_all(http, alice, limit=2)[0]
            assert [e["job_id"] for e in every] == [*hers, hers[1]]
            assert [e["position"] for e in every] == [str(e["id"]) for e in every]  # id order is commit order
            assert [e["topic"] for e in read_all(http, alice, batch=tag)[0]] == ["batch.progress"]
            assert [e["job_id"] for e in read_all(http, alice, flow=hers[2])[0]] == [hers[2]]
    finally:
        client.close()


# -- the stream, live ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(platform: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``conveyor serve`` for this module's tests: its base URL."""
    with serving(platform, tmp_path_factory.mktemp("serve") / "serve.log") as (base, _):
        yield base


def sse_events(resp: httpx.Response) -> Iterator[dict[str, str]]:
    """The events of a ``text/event-stream`` (comments and ``retry`` skipped), as sent."""
    fields: dict[str, str] = {}
    for line in resp.iter_lines():
        if not line:
            if "data" in fields:
                yield fields
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = fields.get(name, "") + value.removeprefix(" ")


def test_a_reconnecting_stream_gets_every_event_of_many_jobs_once_in_order(
    server: str, client: conveyor.Client, platform: Any, token: Token, worker: Any, tag: str
) -> None:
    owner = f"stream-{tag}"
    headers = auth(token(owner))
    total = 2 * STREAM_JOBS  # a noop job's events: job.submitted, job.succeeded
    got: list[dict[str, str]] = []

    def submit_all() -> None:
        for i in range(STREAM_JOBS):
            client.submit("conveyor.demo.noop", {"n": i}, owner=owner)

    def running() -> bool:
        with platform.engine.connect() as conn:
            q = select(jobs.c.id).where(jobs.c.owner == owner, jobs.c.status != s.SUCCEEDED).limit(1)
            return conn.execute(q).first() is not None

    def read(until: int) -> None:
        """Read the stream (resuming after the last event got) until ``until`` events, then hang up."""
        resume = {"Last-Event-ID": got[-1]["id"]} if got else {}
        with (
            httpx.Client(base_url=server, timeout=httpx.Timeout(10, read=30)) as sse,
            sse.stream("GET", "/events/stream", headers={**headers, **resume}) as resp,
        ):
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            for event in sse_events(resp):
                got.append(event)
                if len(got) >= until:
                    return

    started = time.monotonic()
    writer = threading.Thread(target=submit_all)
    writer.start()
    # Hang up three times while jobs are submitted and run (the first cut on no page's boundary).
    cuts = [total // 4 + 7, total // 2, 3 * total // 4]
    busy = []
    for cut in cuts:
        read(cut)
        busy.append(running())
        time.sleep(0.3)
    read(total)
    writer.join()
    elapsed = time.monotonic() - started
    assert not running()

    expected = outbox(platform, jobs.c.owner == owner)
    assert len(expected) == total
    assert [int(json.loads(e["data"])["id"]) for e in got] == expected
    assert [int(e["id"]) for e in got] == sorted({int(e["id"]) for e in got})  # increasing: each once
    assert {e["event"] for e in got} == {"job.submitted", "job.succeeded"}
    assert busy[0], "the first reconnect came after every job had run"
    print(f"{STREAM_JOBS} jobs, {total} events, cuts at {cuts} (running: {busy}), {elapsed:.1f}s")


def test_a_shutdown_ends_open_streams_at_once(
    platform: Any, client: conveyor.Client, token: Token, tmp_path: Path, tag: str
) -> None:
    log = tmp_path / "serve.log"
    with serving(platform, log) as (base, proc), httpx.Client(base_url=base, timeout=10) as sse:
        mine = later(client, f"alice-{tag}")
        headers = auth(token(f"alice-{tag}"))
        with sse.stream("GET", "/events/stream", params={"job": mine}, headers=headers) as resp:
            stream = sse_events(resp)
            first = next(stream)
            assert first["event"] == "job.submitted" and json.loads(first["data"])["job_id"] == mine
            asked = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert list(stream) == []  # the server ended the stream
            proc.wait(timeout=10)
        assert time.monotonic() - asked < 5, "the shutdown waited for the open stream"
    assert "graceful shutdown exceeded" not in log.read_text()
    assert "Finished server process" in log.read_text()


def test_streams_held_open_are_bounded_and_a_closed_one_frees_its_slot(
    platform: Any, client: conveyor.Client, token: Token, tmp_path: Path, tag: str
) -> None:
    log = tmp_path / "serve.log"
    mine = later(client, f"alice-{tag}")
    headers = auth(token(f"alice-{tag}"))
    params = {"job": mine}
    with (
        serving(platform, log, {"CONVEYOR_HTTP_MAX_HELD": "2"}) as (base, _),
        httpx.Client(base_url=base, timeout=10) as sse,
    ):

        def opened() -> Any:
            resp = sse.send(
                sse.build_request("GET", "/events/stream", params=params, headers=headers), stream=True
            )
            return resp

        first, second = opened(), opened()
        assert first.status_code == second.status_code == 200
        held = sse_events(second)  # kept: a collected reader would close the response
        assert next(held)["event"] == "job.submitted"
        third = opened()
        third.read()
        problem(third, 503, "busy")
        assert third.headers["Retry-After"] == "5"
        # A wait for a job is held open too; a plain read is not.
        assert sse.get(f"/jobs/{mine}", params={"wait": 1}, headers=headers).status_code == 503
        assert sse.get(f"/jobs/{mine}", headers=headers).status_code == 200
        first.close()  # the client hangs up: its slot is free again once the server notices

        def reopened() -> bool:
            resp = opened()
            if resp.status_code == 200:
                resp.close()
                return True
            resp.read()
            return False

        deadline = time.monotonic() + 10
        while not reopened():
            assert time.monotonic() < deadline, "a closed stream kept its slot"
            time.sleep(0.5)
        second.close()


def _plan(engine: Any, dialect: str) -> str:
    from sqlalchemy import text

    from conveyor.web.feed import body_field

    order = job_events.c.seq if dialect == "postgresql" else job_events.c.id
    q = select(job_events.c.id).where(body_field(dialect, "batch_id") == "b-1").order_by(order).limit(10)
    with engine.connect() as conn:
        sql = str(q.compile(conn, compile_kwargs={"literal_binds": True}))
        if dialect == "postgresql":
            conn.execute(text("SET enable_seqscan = off"))
            return "\n".join(conn.execute(text(f"EXPLAIN {sql}")).scalars())
        return "\n".join(str(r[-1]) for r in conn.execute(text(f"EXPLAIN QUERY PLAN {sql}")))


def test_the_batch_filter_reads_its_index(platform: Any) -> None:
    assert "ix_job_events_batch" in _plan(platform.engine, "postgresql")


def test_the_batch_filter_reads_its_index_on_sqlite(on_sqlite: Any) -> None:
    assert "ix_job_events_batch" in _plan(on_sqlite.engine, "sqlite")


def test_a_cursor_past_the_newest_event_is_refused_not_silently_followed(
    http: TestClient, client: conveyor.Client, token: Token, tag: str
) -> None:
    """A cursor this feed never gave out (kept from before the database was replaced):
    reading on from it would skip every event until the new feed caught up."""
    later(client, f"alice-{tag}")
    secret = token(f"alice-{tag}")
    _, cursor = read_all(http, secret)
    body = problem(
        http.get("/events", params={"since": str(int(cursor) + 10**6)}, headers=auth(secret)),
        422,
        "invalid-cursor",
    )
    assert "past the newest event" in body["detail"]
    ahead = {**auth(secret), "Last-Event-ID": str(int(cursor) + 10**6)}
    problem(http.get("/events/stream", headers=ahead), 422, "invalid-cursor")
    assert http.get("/events", params={"since": cursor}, headers=auth(secret)).status_code == 200
