"""Event readers are not held back by long transactions, and still never skip an event.

A reader pages ``events_since`` with its cursor. One transaction that wrote an event early
and stays open (a stage writing through ``ctx.connection`` and then working for a minute)
must not delay other jobs' events; its own events appear once it commits, exactly once,
after the events that committed before it.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    delete,
    insert,
    select,
    text,
)

from conveyor.store.db.dialect import Timestamp, db_now
from conveyor.store.db.engine import make_engine, sqlite_url
from conveyor.store.db.migrate import alembic_config, upgrade
from conveyor.store.db.schema import counters, job_events
from conveyor.store.jobs import JobStore, new_event
from tests.helpers import scratch_database

pytestmark = pytest.mark.timeout(120)

LONG_TX = os.environ.get("CONVEYOR_LONG_TX_TESTS") == "1"
NOW = dt.datetime.now(dt.UTC)


# -- a reader that polls like a client would ---------------------------------------------


@dataclass
class Seen:
    """One event as a reader got it."""

    at: float  # time.monotonic()
    db_time: dt.datetime  # the database's clock just after the read
    event: dict[str, Any]


class PollingReader(threading.Thread):
    """Pages ``events_since`` every ``interval`` seconds from ``cursor``, noting when each
    event was returned (monotonic, and the database's clock). After :meth:`finish` it makes
    one more full pass."""

    def __init__(
        self,
        engine: Engine,
        store: JobStore,
        cursor: str | None,
        *,
        interval: float = 0.02,
        reuse_connection: bool = False,
    ) -> None:
        super().__init__(daemon=True)
        self.engine, self.store, self.cursor = engine, store, cursor
        self.interval = interval
        self.reuse_connection = reuse_connection
        self.seen: list[Seen] = []
        self.error: BaseException | None = None
        self._stop_after_pass = threading.Event()

    def run(self) -> None:
        try:
            if self.reuse_connection:
                # One connection across calls: it is inside a transaction after the first.
                with self.engine.connect() as conn:
                    self._poll(lambda: conn)
            else:
                self._poll(None)
        except BaseException as exc:
            self.error = exc

    def _poll(self, shared: Any) -> None:
        while True:
            last = self._stop_after_pass.is_set()
            if shared is not None:
                self._drain(shared())
            else:
                with self.engine.connect() as conn:
                    self._drain(conn)
            if last:
                return
            time.sleep(self.interval)

    def _drain(self, conn: Any) -> None:
        while True:
            rows, self.cursor = self.store.events_since(conn, self.cursor, limit=200)
            now = time.monotonic()
            if rows:
                db_time = conn.execute(select(db_now())).scalar_one()
                self.seen += [Seen(now, db_time, dict(r)) for r in rows]
            if len(rows) < 200:
                return

    def stop(self) -> None:
        """Stop after one more pass that starts now."""
        self._stop_after_pass.set()

    def finish(self, timeout: float = 60) -> list[Seen]:
        """Stop after one more pass that starts now; the events seen, in order."""
        self.stop()
        self.join(timeout)
        assert not self.is_alive(), "reader did not finish"
        if self.error is not None:
            raise self.error
        return self.seen


def _tail_cursor(engine: Engine, store: JobStore) -> str | None:
    cursor = None
    with engine.connect() as conn:
        while True:
            rows, cursor = store.events_since(conn, cursor, limit=5000)
            if not rows:
                return cursor


def _all_events(engine: Engine) -> dict[int, dict[str, Any]]:
    with engine.connect() as conn:
        return {r["id"]: dict(r) for r in conn.execute(select(job_events)).mappings()}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _assert_exactly_once(seen: list[dict[str, Any]], expected_ids: set[int]) -> None:
    counts = Counter(e["id"] for e in seen)
    duplicates = {i: n for i, n in counts.items() if n > 1}
    assert not duplicates, f"events returned more than once: {duplicates}"
    missing = expected_ids - set(counts)
    assert not missing, f"events never returned: {sorted(missing)[:20]} ({len(missing)} in all)"
    assert set(counts) <= expected_ids, "returned events that are not in the table"


# -- one long transaction, other jobs flowing ----------------------------------------------


@pytest.mark.parametrize(
    "hold",
    [
        8.0,
        pytest.param(
            60.0,
            marks=pytest.mark.skipif(not LONG_TX, reason="the 60 s scenario: set CONVEYOR_LONG_TX_TESTS=1"),
        ),
    ],
)
def test_long_transaction_does_not_hold_back_other_jobs_events(
    platform: Any, worker: Any, tag: str, hold: float
) -> None:
    store: JobStore = platform.store
    before = set(_all_events(platform.engine))
    start = _tail_cursor(platform.engine, store)
    long_engine = make_engine(platform.settings.database_url, pool_size=1)
    written, release = threading.Event(), threading.Event()
    commit_started: list[float] = []
    errors: list[BaseException] = []

    def long_transaction() -> None:
        # What a stage does when it writes through ctx.connection early, then keeps working:
        # its transaction has written (holds an xid) and stays open until the completion.
        try:
            with long_engine.connect() as conn, conn.begin():
                store.emit(conn, [new_event(None, "test.long", {"tag": tag, "part": 1})])
                written.set()
                release.wait(hold)
                store.emit(conn, [new_event(None, "test.long", {"tag": tag, "part": 2})])
                commit_started.append(time.monotonic())
        except BaseException as exc:
            errors.append(exc)
            written.set()

    holder = threading.Thread(target=long_transaction, daemon=True)
    holder.start()
    reader = PollingReader(platform.engine, store, start)
    try:
        assert written.wait(10)
        reader.start()
        opened = time.monotonic()
        submitted: dict[str, float] = {}
        handles = []
        n = 0
        while time.monotonic() - opened < hold - 4:
            n += 1
            t0 = time.monotonic()
            h = platform.submit("conveyor.demo.square", {"n": 10_000 + n}, dedup=False, label=tag)
            submitted[h.id] = t0
            handles.append(h)
            time.sleep(0.1)
        for h in handles:
            assert h.wait(30) == "succeeded"
        assert not commit_started, "the long transaction ended before the other jobs were done"
        other_jobs_done = time.monotonic()
    except BaseException:
        release.set()
        reader.stop()
        raise
    finally:
        holder.join(hold + 30)
        long_engine.dispose()
    assert not errors, errors
    seen = reader.finish()

    first_seen: dict[tuple[str | None, str], float] = {}
    for r in seen:
        first_seen.setdefault((r.event["job_id"], r.event["topic"]), r.at)
    # From before submit() to the reader: an upper bound on commit-to-reader latency.
    submit_lag = [first_seen[(job_id, "job.submitted")] - t0 for job_id, t0 in submitted.items()]
    # Every event of the other jobs, from its insert to the reader, on the database's clock.
    event_lag = [
        (r.db_time - r.event["created_at"]).total_seconds() for r in seen if r.event["job_id"] in submitted
    ]
    print(
        f"\n{len(submitted)} jobs, {len(event_lag)} events during a {hold:.0f} s transaction: "
        f"submit-to-reader p99 {_p99(submit_lag):.3f} s (max {max(submit_lag):.3f} s), "
        f"event-to-reader p99 {_p99(event_lag):.3f} s (max {max(event_lag):.3f} s)"
    )
    assert _p99(submit_lag) <= 1.0, "other jobs' events were held back by the open transaction"
    assert _p99(event_lag) <= 1.0, "other jobs' events were held back by the open transaction"
    for job_id in submitted:
        assert first_seen[(job_id, "job.succeeded")] <= other_jobs_done + 1.0

    # The long transaction's events: after its commit, once each, in order, and after
    # every event that committed before it.
    long_events = [r for r in seen if r.event["topic"] == "test.long" and r.event["body"].get("tag") == tag]
    assert [r.event["body"]["part"] for r in long_events] == [1, 2]
    assert all(r.at >= commit_started[0] for r in long_events)
    order = [r.event["id"] for r in seen]
    first_long = order.index(long_events[0].event["id"])
    assert {r.event["id"] for r in seen if r.event["job_id"] in submitted} <= set(order[:first_long])

    _assert_exactly_once([r.event for r in seen], set(_all_events(platform.engine)) - before)


# -- many writers, readers paging at the same time ------------------------------------------

WRITERS = 8
ROUNDS = 25


@pytest.fixture(params=["postgres", pytest.param("sqlite", marks=pytest.mark.sqlite)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "postgres":
        request.getfixturevalue("services")
        from config.celery_app import platform

        eng = make_engine(str(platform.settings.database_url), pool_size=WRITERS + 6)
    else:
        eng = make_engine(sqlite_url(tmp_path))
        upgrade(eng)
    yield eng
    eng.dispose()


def test_concurrent_writers_each_committed_event_is_read_exactly_once(engine: Engine, tag: str) -> None:
    store = JobStore(lease_timeout=8)
    postgres = engine.dialect.name == "postgresql"
    before = set(_all_events(engine))
    start = _tail_cursor(engine, store)
    rolled_back: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    go = threading.Barrier(WRITERS + (1 if postgres else 0))

    def write(w: int) -> None:
        rnd = random.Random(w)
        try:
            go.wait()
            for r in range(ROUNDS):
                with engine.connect() as conn:
                    tx = conn.begin()
                    for i in range(rnd.randint(1, 3)):
                        store.emit(
                            conn, [new_event(None, "test.burst", {"tag": tag, "w": w, "r": r, "i": i})]
                        )
                        if postgres:
                            time.sleep(rnd.random() * 0.004)
                    if rnd.random() < 0.1:
                        tx.rollback()
                        rolled_back.append((w, r))
                    else:
                        tx.commit()
        except BaseException as exc:
            errors.append(exc)

    def long_writer() -> None:
        # Postgres only: a transaction open across most of the burst, as a slow stage's.
        try:
            with engine.connect() as conn, conn.begin():
                store.emit(conn, [new_event(None, "test.burst", {"tag": tag, "w": -1, "r": 0, "i": 0})])
                go.wait()
                time.sleep(1.5)
                store.emit(conn, [new_event(None, "test.burst", {"tag": tag, "w": -1, "r": 0, "i": 1})])
        except BaseException as exc:
            errors.append(exc)

    readers = [PollingReader(engine, store, start, interval=0.005)]
    if postgres:
        readers.append(PollingReader(engine, store, start, interval=0.005, reuse_connection=True))
    threads = [threading.Thread(target=write, args=(w,), daemon=True) for w in range(WRITERS)]
    if postgres:
        threads.append(threading.Thread(target=long_writer, daemon=True))
    for t in [*readers, *threads]:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    expected = set(_all_events(engine)) - before
    for reader in readers:
        seen = [r.event for r in reader.finish()]
        _assert_exactly_once(seen, expected)
        mine = [e["body"] for e in seen if e["body"].get("tag") == tag]
        assert not [b for b in mine if (b["w"], b["r"]) in rolled_back]
        # Commit order per writer: its transactions one after another, each in insert order.
        for w in {b["w"] for b in mine}:
            steps = [(b["r"], b["i"]) for b in mine if b["w"] == w]
            assert steps == sorted(steps), f"writer {w} read out of commit order"
        committed = WRITERS * ROUNDS - len(rolled_back) + (1 if postgres else 0)
        assert len({(b["w"], b["r"]) for b in mine}) == committed


# -- cursors ------------------------------------------------------------------------------


def test_cursor_resumes_after_the_event_it_names(platform: Any, tag: str) -> None:
    store: JobStore = platform.store
    start = _tail_cursor(platform.engine, store)
    with platform.engine.begin() as conn:
        store.emit(conn, [new_event(None, "test.cursor", {"tag": tag, "i": i}) for i in range(3)])
    with platform.engine.connect() as conn:
        rows, cursor = store.events_since(conn, start)
        assert [r["body"]["i"] for r in rows if r["body"].get("tag") == tag] == [0, 1, 2]
        again, same = store.events_since(conn, cursor)
        assert again == [] and same == cursor
        first = next(r for r in rows if r["body"].get("tag") == tag)
        head, nxt = store.events_since(conn, start, limit=[r["id"] for r in rows].index(first["id"]) + 1)
        assert head[-1]["id"] == first["id"]
        rest, _ = store.events_since(conn, nxt)
        assert [r["body"]["i"] for r in rest if r["body"].get("tag") == tag] == [1, 2]


def test_a_lost_sequence_counter_never_hands_out_a_number_again(platform: Any, tag: str) -> None:
    """The counter row is only a cache of the highest number given: deleted (an operator
    clearing counters, a restore), numbering resumes above every event already numbered."""
    store: JobStore = platform.store
    start = _tail_cursor(platform.engine, store)
    with platform.engine.begin() as conn:
        store.emit(conn, [new_event(None, "test.seq", {"tag": tag, "i": 0})])
    with platform.engine.connect() as conn:
        _, cursor = store.events_since(conn, start)
    with platform.engine.begin() as conn:
        conn.execute(delete(counters).where(counters.c.name == "event_seq"))
        store.emit(conn, [new_event(None, "test.seq", {"tag": tag, "i": 1})])
    with platform.engine.connect() as conn:
        after, _ = store.events_since(conn, cursor)
    assert [r["body"]["i"] for r in after if r["body"].get("tag") == tag] == [1]


def test_old_txid_cursor_is_accepted(platform: Any, tag: str) -> None:
    """A ``"txid:id"`` cursor from before 0009 resumes right after the event it names."""
    store: JobStore = platform.store
    start = _tail_cursor(platform.engine, store)
    with platform.engine.begin() as conn:
        store.emit(conn, [new_event(None, "test.legacy", {"tag": tag, "i": i}) for i in range(3)])
    with platform.engine.connect() as conn:
        rows, _ = store.events_since(conn, start)
        mine = [r for r in rows if r["body"].get("tag") == tag]
        ids = [r["id"] for r in rows]
        after_first, cursor = store.events_since(conn, f"123456:{mine[0]['id']}")
        assert [r["id"] for r in after_first] == ids[ids.index(mine[0]["id"]) + 1 :]
        assert cursor is not None and ":" not in cursor
        from_start, _ = store.events_since(conn, "0:0", limit=5000)
        everything, _ = store.events_since(conn, None, limit=5000)
        assert [r["id"] for r in from_start] == [r["id"] for r in everything]


# -- the migration ------------------------------------------------------------------------


@pytest.fixture(params=["postgres", pytest.param("sqlite", marks=pytest.mark.sqlite)])
def fresh_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An empty database of its own (the migration test goes down to 0008)."""
    if request.param == "sqlite":
        eng = make_engine(sqlite_url(tmp_path))
        yield eng
        eng.dispose()
        return
    request.getfixturevalue("services")
    with scratch_database(f"conveyor_mig_{os.getpid()}") as url:
        eng = make_engine(url, pool_size=2)
        try:
            yield eng
        finally:
            eng.dispose()


def test_migration_keeps_the_old_order_and_old_cursors(fresh_engine: Engine) -> None:
    postgres = fresh_engine.dialect.name == "postgresql"
    cfg = alembic_config(fresh_engine)
    command.upgrade(cfg, "0008")
    # Before 0009 readers ordered by (txid, id): id 2 committed after id 3.
    txids = {1: 10, 2: 12, 3: 11, 4: 13} if postgres else {1: 0, 2: 0, 3: 0, 4: 0}
    old_events = Table(
        "job_events",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("txid", BigInteger),
        Column("job_id", String(36)),
        Column("topic", String(100)),
        Column("body", JSON),
        Column("created_at", Timestamp()),
    )
    with fresh_engine.begin() as conn:
        conn.execute(
            insert(old_events),
            [
                {"id": i, "txid": txid, "job_id": None, "topic": "old", "body": {"i": i}, "created_at": NOW}
                for i, txid in txids.items()
            ],
        )
        if postgres:
            conn.execute(text("SELECT setval(pg_get_serial_sequence('job_events', 'id'), 4)"))
    command.upgrade(cfg, "heads")
    store = JobStore(lease_timeout=8)
    old_order = [1, 3, 2, 4] if postgres else [1, 2, 3, 4]
    with fresh_engine.connect() as conn:
        rows, _ = store.events_since(conn, None)
        assert [r["id"] for r in rows] == old_order
        # An old cursor at id 3 (txid 11 on Postgres) resumes where the old reader was.
        legacy = f"{txids[3]}:3"
        rest, _ = store.events_since(conn, legacy)
        assert [r["id"] for r in rest] == old_order[old_order.index(3) + 1 :]
    # New events come after the old ones, and ids are never reused (SQLite: AUTOINCREMENT).
    with fresh_engine.begin() as conn:
        conn.execute(delete(job_events).where(job_events.c.id == 4))
        store.emit(conn, [new_event(None, "new", {"i": 5})])
    with fresh_engine.connect() as conn:
        rows, _ = store.events_since(conn, None)
        assert [r["topic"] for r in rows] == ["old", "old", "old", "new"]
        assert rows[-1]["id"] > 4
    command.downgrade(cfg, "0008")
    command.upgrade(cfg, "heads")
