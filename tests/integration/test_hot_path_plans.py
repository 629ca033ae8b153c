"""The hot path stays index-driven once the tables are big (issue #16).

A scratch database gets 200k terminal jobs, a few thousand live ones, 200k events and the
dedup tables' rows, is analyzed, and then every statement of the per-job path (the claim's
UPDATE, the completion) and of the periodic scans (the relay's due and lost scans, the
reconciler's stale, expired, escalation, unpark, follower and purge scans, the event
sequencer, the event readers) is explained: none may read ``jobs`` or ``job_events`` with
a sequential scan. The statements are the ones the code runs, captured as it runs them
(on a rolled-back transaction) or read from the functions the migrations created.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, text

from conveyor.store.db.lane import _statements
from conveyor.store.liveness import Orphan
from conveyor.upkeep.reconciler import TickReport
from conveyor.web.feed import FeedFilter, head_cursor, read_page
from tests.helpers import bound_to, scratch_database

SCHEMA = "conveyor"
BIG_TABLES = {"jobs", "job_events"}
TERMINAL_JOBS = 200_000
EVENTS = 200_000
BACKLOG = 100_000  # queued and published, waiting for a worker

# 200k terminal jobs finished over the last 10 days (so some are past the 7-day retention),
# every 10th of a flow, every 7th of an owner; then the live ones: published (a thousand
# of them an hour ago: unclaimed too long), unpublished and due, delayed, running (fresh
# heartbeats), retrying, parked, following; and a backlog of 100k queued, published jobs.
FILL = """
INSERT INTO jobs (id, stage, queue, status, priority, payload, attempts, uncounted, requeues,
                  max_attempts, run_at, options, created_at, updated_at, started_at, finished_at,
                  published_at, broker_epoch, flow_id, owner, celery_task_id)
SELECT 'done-' || g, 'conveyor.demo.square', 'demo',
       (ARRAY['succeeded','succeeded','succeeded','dead','cancelled','expired','skipped'])[1 + g % 7],
       0, '{"n": 1}', 1, 0, 0, 3, t, '{}', t, t, t, t, t, 'epoch-a',
       CASE WHEN g % 10 = 0 THEN 'flow-' || (g / 10) END,
       CASE WHEN g % 7 = 0 THEN 'owner-' || (g % 50) END,
       'task-' || g
  FROM generate_series(1, :terminal) AS g,
       LATERAL (SELECT now() - (g % 14400) * interval '1 minute' AS t) AS c;

INSERT INTO jobs (id, stage, queue, status, priority, payload, attempts, uncounted, requeues,
                  max_attempts, run_at, expires_at, options, created_at, updated_at, started_at,
                  heartbeat_at, lease_owner, lease_key, published_at, broker_epoch, owner)
SELECT 'live-' || g, 'conveyor.demo.square', 'demo', k.status, g % 3, '{"n": 2}',
       CASE WHEN k.status = 'running' THEN 1 ELSE 0 END, 0, 0, 3,
       CASE WHEN k.kind = 'delayed' THEN now() + interval '1 hour' ELSE now() - interval '1 second' END,
       CASE WHEN g % 5 = 0 THEN now() + interval '1 day' END,
       '{}', now(), now(),
       CASE WHEN k.status = 'running' THEN now() END,
       CASE WHEN k.status = 'running' THEN now() + interval '1 hour' END,
       CASE WHEN k.status = 'running' THEN 'worker-1' END,
       CASE WHEN k.status = 'waiting_lease' THEN 'key-' || (g % 20) END,
       CASE WHEN k.kind IN ('published', 'running')
            THEN now() - CASE WHEN g <= 1000 THEN interval '1 hour' ELSE interval '1 second' END END,
       CASE WHEN k.kind IN ('published', 'running') THEN 'epoch-a' END,
       CASE WHEN g % 3 = 0 THEN 'owner-' || (g % 50) END
  FROM generate_series(1, 5000) AS g,
       LATERAL (SELECT v.status, v.kind FROM (VALUES
         (3000, 'queued', 'published'), (3300, 'queued', 'due'), (3600, 'queued', 'delayed'),
         (4600, 'running', 'running'), (4700, 'retrying', 'delayed'),
         (4800, 'waiting_lease', 'parked'), (5000, 'waiting_dedup', 'following')
       ) AS v(upto, status, kind) WHERE g <= v.upto ORDER BY v.upto LIMIT 1) AS k;

INSERT INTO jobs (id, stage, queue, status, priority, payload, attempts, uncounted, requeues,
                  max_attempts, run_at, expires_at, options, created_at, updated_at,
                  published_at, broker_epoch)
SELECT 'backlog-' || g, 'conveyor.demo.square', 'demo', 'queued', 0, '{"n": 3}', 0, 0, 0, 3,
       now() - interval '1 second', CASE WHEN g % 10 = 0 THEN now() + interval '1 day' END,
       '{}', now(), now(), now() - interval '1 second', 'epoch-a'
  FROM generate_series(1, :backlog) AS g;

INSERT INTO dedup_followers (job_id, holder, created_at)
SELECT id, 'live-' || (1 + (row_number() OVER ()) % 3000), now() FROM jobs WHERE status = 'waiting_dedup';

INSERT INTO dedup_keys (scope, key, job_id, mode, expires_ms, first_ms, updated_ms)
SELECT 'conveyor.demo.square', 'k' || g, 'done-' || (g * 7), 'ttl', 0, 0, 0
  FROM generate_series(1, 20000) AS g;

INSERT INTO job_events (seq, job_id, topic, body, created_at)
SELECT g, 'done-' || (1 + g % :terminal), 'job.succeeded',
       CASE WHEN g % 100 = 0 THEN jsonb_build_object('batch_id', 'b' || (g % 7), 'owner', 'owner-1')
            ELSE '{"stage": "conveyor.demo.square"}' END,
       now() - (g % 14400) * interval '1 minute'
  FROM generate_series(1, :events) AS g;
INSERT INTO job_events (job_id, topic, body, created_at)
SELECT 'live-' || g, 'job.submitted', '{}', now() FROM generate_series(1, 50) AS g;
INSERT INTO conveyor_counters (name, value) VALUES ('event_seq', :events)
ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value;
"""


def fill(engine: Engine) -> None:
    """The big tables' rows, then fresh statistics."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f'SET LOCAL search_path TO "{SCHEMA}"')
        for statement in filter(str.strip, FILL.split(";\n")):
            conn.execute(text(statement), {"terminal": TERMINAL_JOBS, "events": EVENTS, "backlog": BACKLOG})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        tables = ", ".join(f'"{SCHEMA}".{t}' for t in ("jobs", "job_events", "dedup_keys", "dedup_followers"))
        conn.exec_driver_sql(f"ANALYZE {tables}")


class Captured:
    """The statements an engine executes while capturing."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.statements: list[tuple[str, str, Any]] = []
        self.label = ""

    def _hook(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
    ) -> None:
        self.statements.append((self.label, statement, parameters))

    def __enter__(self) -> Captured:
        event.listen(self.engine, "before_cursor_execute", self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._hook)


def seq_scans(plan: Any) -> list[str]:
    """The big tables a plan (EXPLAIN's JSON) reads with a sequential scan."""
    found: list[str] = []
    if isinstance(plan, dict):
        if plan.get("Node Type") == "Seq Scan" and plan.get("Relation Name") in BIG_TABLES:
            found.append(str(plan["Relation Name"]))
        for value in plan.values():
            found += seq_scans(value)
    elif isinstance(plan, list):
        for item in plan:
            found += seq_scans(item)
    return found


def explain(conn: Connection, statement: str, parameters: Any = None) -> Any:
    """EXPLAIN (FORMAT JSON) of one driver-level statement."""
    return conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar_one()


def function_statements(conn: Connection, name: str, arguments: dict[str, str]) -> list[str]:
    """The SQL statements in the body of plpgsql function ``name`` (as the migrations
    created it), its parameters replaced by ``arguments`` (SQL literals)."""
    source = conn.execute(
        text(
            "SELECT prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE proname = :n AND nspname = :s"
        ),
        {"n": name, "s": SCHEMA},
    ).scalar_one()
    body = re.sub(r"--[^\n]*", "", str(source))
    out: list[str] = []
    for piece in body.split(";"):
        sql = piece.strip()
        sql = re.sub(r"^BEGIN\s+", "", sql)
        if re.match(r"(?i)RETURN\s+QUERY\b", sql):
            sql = re.sub(r"(?i)^RETURN\s+QUERY\s+", "", sql)
        elif re.match(r"(?i)PERFORM\b", sql):
            if "advisory" in sql or "set_config" in sql:
                continue
            sql = "SELECT" + sql[len("PERFORM") :]
        elif not re.match(r"(?i)(SELECT|INSERT|UPDATE|DELETE|WITH)\b", sql):
            continue
        for param, literal in arguments.items():
            sql = re.sub(rf"\b{param}\b", literal, sql)
        out.append(sql)
    return out


@pytest.fixture(scope="module")
def big(platform: Any) -> Iterator[Any]:
    """The test platform on a scratch database with big tables."""
    from config.migrations import upgrade
    from conveyor.store.db.engine import make_engine

    with scratch_database("conveyor_plans") as url:
        engine = make_engine(url)
        upgrade(engine)
        fill(engine)
        engine.dispose()
        with bound_to(platform, url):
            yield platform


def capture_periodic(platform: Any) -> list[tuple[str, str, Any]]:
    """Run one reconciler pass and the relay's scans on a transaction that is rolled back,
    and the event readers, capturing every statement they execute."""
    relay = platform.relay()
    with Captured(platform.engine) as cap:
        with platform.engine.connect() as conn:
            tx = conn.begin()
            cap.label = "reconcile"
            relay.reconciler.reconcile(conn, TickReport(), redis_up=True)
            cap.label = "relay"
            orphan = Orphan(last_beat=time.time() - 3, delivered=["live-1", "live-2"])
            relay._last_unclaimed = time.monotonic()  # that check runs on its own below
            relay._mark_publishable(conn, "epoch-a", {"worker-x": orphan}, reconcile=True)
            cap.label = "unclaimed"
            relay._unclaimed_too_long(conn, "epoch-a")
            tx.rollback()
        cap.label = "events"
        job = platform.job("done-7")
        job.events()
        job.events(since="150000")
        read_page(platform.engine, None, FeedFilter(), 500)
        read_page(platform.engine, "100000", FeedFilter(owner="owner-1"), 500)
        read_page(platform.engine, None, FeedFilter(job="done-14"), 500)
        read_page(platform.engine, None, FeedFilter(flow="flow-70"), 500)
        read_page(platform.engine, "1000", FeedFilter(batch="b3"), 500)
        head_cursor(platform.engine)
    return cap.statements


def test_no_sequential_scan_of_jobs_or_events_on_the_hot_path(big: Any) -> None:
    platform = big
    captured = capture_periodic(platform)
    labels = {label for label, _, _ in captured}
    assert {"reconcile", "relay", "unclaimed", "events"} <= labels
    failures: list[str] = []
    explained = 0
    with platform.engine.connect() as conn:
        conn.exec_driver_sql(f'SET search_path TO "{SCHEMA}"')
        per_job = [
            ("claim", s, None)
            for s in function_statements(
                conn, "conveyor_claim", {"p_id": "'live-1'", "p_owner": "'w'", "p_task": "'t'"}
            )
        ]
        sequencer = [
            ("sequencer", s, None)
            for s in function_statements(conn, "conveyor_sequence_events", {"p_limit": "5000"})
        ]
        assert per_job and sequencer
        _, _, succeed = _statements(SCHEMA)
        params = ("{}", "live-4000", 1, "{}")  # result, id, attempt, event (lane.py's order)
        per_job.append(("completion", succeed, params))
        for label, statement, parameters in [*per_job, *sequencer, *captured]:
            if not re.match(r"(?is)\s*(SELECT|INSERT|UPDATE|DELETE|WITH)\b", statement):
                continue
            plan = explain(conn, statement, parameters)
            explained += 1
            scanned = seq_scans(plan)
            if scanned:
                failures.append(f"[{label}] Seq Scan on {', '.join(scanned)}:\n{statement}")
    assert explained > 20
    assert not failures, "\n\n".join(failures)


def test_the_retention_purge_is_index_driven(big: Any) -> None:
    """The reconciler purges terminal jobs and events past ``retention_days`` through the
    finished_at and created_at indexes."""
    platform = big
    captured = [c for c in capture_periodic(platform) if c[0] == "reconcile"]
    purges = [(s, p) for _, s, p in captured if s.lstrip().upper().startswith("DELETE")]
    targets = {m.group(1) for s, _ in purges if (m := re.search(r"DELETE FROM (\S+)", s))}
    assert f"{SCHEMA}.jobs" in targets and f"{SCHEMA}.job_events" in targets
    with platform.engine.connect() as conn:
        for statement, parameters in purges:
            text_plan = str(explain(conn, statement, parameters))
            if "FROM conveyor.jobs" in statement.split("WHERE")[0]:
                assert "ix_jobs_finished" in text_plan, text_plan
            if "FROM conveyor.job_events" in statement.split("WHERE")[0]:
                assert "ix_job_events_created" in text_plan, text_plan


def test_keys_of_vanished_holders_are_swept_a_window_per_pass(platform: Any, tag: str) -> None:
    """The dedup-key sweep looks at ``BATCH`` keys per pass and resumes after them: keys
    whose holder is gone are all deleted within a round of passes."""
    from sqlalchemy import func, insert, select

    from conveyor.store.db.schema import dedup_keys
    from conveyor.upkeep.reconciler import BATCH

    orphans = 2 * BATCH + 10
    rows = [
        {
            "scope": tag,
            "key": f"k{i:05d}",
            "job_id": f"{tag}-gone-{i}",
            "mode": "id",
            "first_ms": 0,
            "updated_ms": 0,
        }
        for i in range(orphans)
    ]
    with platform.engine.begin() as conn:
        conn.execute(insert(dedup_keys), rows)
    reconciler = platform.relay().reconciler
    left = select(func.count()).select_from(dedup_keys).where(dedup_keys.c.scope == tag)
    for _ in range(50):
        with platform.engine.begin() as conn:
            reconciler._purge(conn)
            if conn.execute(left).scalar_one() == 0:
                break
    with platform.engine.connect() as conn:
        assert conn.execute(left).scalar_one() == 0


def test_the_retention_purge_takes_a_bounded_batch_a_pass(
    db: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a long outage, what is past retention goes a batch per pass (``PURGE_ROWS``
    rows of each table), not in one transaction that holds the pass for minutes."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import func, insert, select, update

    from conveyor.store.db.schema import job_events, jobs
    from conveyor.store.jobs import NewJob
    from conveyor.upkeep import reconciler

    monkeypatch.setattr(reconciler, "PURGE_ROWS", 4)
    platform = db
    old = datetime.now(UTC) - timedelta(days=30)
    with platform.engine.begin() as conn:
        ids = [
            platform.store.insert(conn, NewJob(stage=f"{tag}.old", queue="demo", payload={}, max_attempts=1))[
                0
            ]
            for _ in range(10)
        ]
        conn.execute(update(jobs).where(jobs.c.id.in_(ids)).values(status="succeeded", finished_at=old))
        conn.execute(
            insert(job_events),
            [{"job_id": i, "topic": f"{tag}.old", "body": {}, "created_at": old} for i in ids],
        )
    mine = select(func.count()).select_from(jobs).where(jobs.c.id.in_(ids))
    my_events = select(func.count()).select_from(job_events).where(job_events.c.topic == f"{tag}.old")
    purger = platform.relay().reconciler
    left = [(10, 10)]
    for _ in range(100):
        with platform.engine.begin() as conn:
            purger._purge(conn)
            left.append((conn.execute(mine).scalar_one(), conn.execute(my_events).scalar_one()))
        if left[-1] == (0, 0):
            break
    assert left[-1] == (0, 0)
    assert all(a[0] - b[0] <= 4 and a[1] - b[1] <= 4 for a, b in pairwise(left)), left


def test_the_relays_epoch_scan_reads_only_other_epochs(big: Any) -> None:
    """The relay's scan for jobs published under another epoch runs every pass: it reads
    ranges of the published-epoch index (migration 0017), not every waiting job's row."""
    platform = big
    scans = [
        (s, p)
        for label, s, p in capture_periodic(platform)
        if label == "relay" and "broker_epoch <" in s and "broker_epoch >" in s
    ]
    assert scans
    with platform.engine.connect() as conn:
        for statement, parameters in scans:
            assert "ix_jobs_published_epoch" in str(explain(conn, statement, parameters)), statement


def rows_read(plan: Any) -> int:
    """Rows of ``jobs`` a plan run with ANALYZE read: returned or filtered out, per loop."""
    total = 0
    if isinstance(plan, dict):
        if plan.get("Relation Name") == "jobs" and "Actual Rows" in plan:
            seen = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
            total += (seen + plan.get("Rows Removed by Index Recheck", 0)) * plan.get("Actual Loops", 1)
        for value in plan.values():
            total += rows_read(value)
    elif isinstance(plan, list):
        for item in plan:
            total += rows_read(item)
    return int(total)


def test_a_periodic_pass_does_not_read_the_backlog(big: Any) -> None:
    """With 100k jobs queued, each scan of a relay or reconciler pass reads a bounded number
    of rows of ``jobs`` (the running, parked, following and overdue ones), never the
    backlog. The exception is the relay's unclaimed-too-long check (labelled apart): by
    design it counts a queue's old waiting jobs against its messages, and only four times
    per ``republish_after``."""
    from conveyor.upkeep.reconciler import BATCH

    platform = big
    selects = [
        (label, s, p)
        for label, s, p in capture_periodic(platform)
        if label in ("relay", "reconcile") and s.lstrip().upper().startswith("SELECT")
    ]
    failures = []
    with platform.engine.connect() as conn:
        for label, statement, parameters in selects:
            plan = conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", parameters
            ).scalar_one()
            read = rows_read(plan)
            if read > 3 * BATCH:
                failures.append(f"[{label}] {read} rows of jobs read:\n{statement}")
    assert not failures, "\n\n".join(failures)
