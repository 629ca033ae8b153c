"""The platform's tables. Migrations in ``conveyor/migrations`` create them; this module
is what the code queries. Domain tables of a deployment live in their own metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.namespace import SCHEMA, own

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "pk": "pk_%(table_name)s",
}

# Every table is in Conveyor's own schema (a prefix on SQLite): see conveyor.store.db.namespace.
metadata = MetaData(schema=SCHEMA, naming_convention=NAMING)

# An autoincrementing 64-bit key on Postgres that SQLite still treats as its rowid alias.
BigId = BigInteger().with_variant(Integer(), "sqlite")

# Statuses. Terminal ones never change again (except a DLQ retry of a dead job).
QUEUED = "queued"
RUNNING = "running"
RETRYING = "retrying"
SUCCEEDED = "succeeded"
DEAD = "dead"
CANCELLED = "cancelled"
EXPIRED = "expired"
SKIPPED = "skipped"
WAITING_LEASE = "waiting_lease"  # parked until its lease key is released; holds no pool slot
# A flow's job deduplicated into a live holder: takes the holder's outcome when it ends.
WAITING_DEDUP = "waiting_dedup"

TERMINAL = frozenset({SUCCEEDED, DEAD, CANCELLED, EXPIRED, SKIPPED})
THROTTLED = "throttled"  # over a rate limit or concurrency cap: parked until run_at
CLAIMABLE = (QUEUED, RETRYING, THROTTLED)
STATUSES = (QUEUED, THROTTLED, WAITING_LEASE, WAITING_DEDUP, RUNNING, RETRYING, *sorted(TERMINAL))
# A job id: a UUID. A plain Celery message adopted by a worker keeps its task id as job id.
JOB_ID_LENGTH = 36
# A key of ``jobs.options``: the job was submitted through ``submit()`` (its outcome is its
# row) and is published with Celery's ``ignore_result``: no result-backend write.
IGNORE_RESULT = "ignore_result"


def wants_celery_result(row: Mapping[str, Any]) -> bool:
    """Whether a Celery caller may hold an ``AsyncResult`` of this job."""
    return not (row["options"] or {}).get(IGNORE_RESULT)


_LIVE = "status IN ('queued', 'running', 'retrying', 'throttled', 'waiting_lease', 'waiting_dedup')"
_WAITING = "status IN ('queued', 'retrying', 'throttled')"


def _partial(name: str, columns: list[str], where: str) -> list[Index]:
    return [Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))]


jobs = Table(
    own("jobs"),
    metadata,
    Column("id", String(JOB_ID_LENGTH), primary_key=True),
    Column("stage", String(200), nullable=False),
    Column("queue", String(100), nullable=False),
    Column("status", String(20), nullable=False),
    Column("priority", Integer, nullable=False, default=0),
    Column("payload", JSON, nullable=False),
    Column("label", String(200), nullable=True),
    Column("idempotency_key", String(200), nullable=True, unique=True),
    # Claims so far: the fencing token, grows on every claim. ``uncounted`` of them ended
    # without counting (outage, shutdown, preemption, parking); ``requeues`` of those were
    # caused by an outage or a shutdown. Counted attempts = attempts - uncounted.
    Column("attempts", Integer, nullable=False, default=0),
    Column("uncounted", Integer, nullable=False, default=0),
    Column("requeues", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False),
    Column("run_at", Timestamp(), nullable=False),
    Column("expires_at", Timestamp(), nullable=True),
    Column("lease_owner", String(200), nullable=True),
    Column("heartbeat_at", Timestamp(), nullable=True),
    Column("error_type", String(200), nullable=True),
    Column("last_error", Text, nullable=True),
    Column("result", JSON, nullable=True),
    Column("progress", JSON, nullable=True),
    Column("flow_id", String(36), nullable=True),
    Column("parent_id", String(36), nullable=True),
    # Everything needed to publish the message again: chain, chord, links, group ids.
    Column("options", JSON, nullable=False),
    Column("origin_task_id", String(64), nullable=True),
    Column("celery_task_id", String(64), nullable=True),
    Column("published_at", Timestamp(), nullable=True),
    Column("broker_epoch", String(40), nullable=True),
    Column("cancel_requested_at", Timestamp(), nullable=True),
    Column("cancelled_by", String(200), nullable=True),
    Column("cancel_reason", Text, nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Column("updated_at", Timestamp(), nullable=False),
    Column("started_at", Timestamp(), nullable=True),
    Column("finished_at", Timestamp(), nullable=True),
    Column("dedup_key", String(420), nullable=True),
    Column("dedup_seq", BigInteger, nullable=True),
    Column("lease_key", String(200), nullable=True),
    Column("preempt_requested_at", Timestamp(), nullable=True),
    Column("interrupt_sent_at", Timestamp(), nullable=True),
    # Who the job belongs to (an HTTP token's owner, or ``owner=`` at submit); NULL for the
    # deployment's own jobs. A token sees only its owner's jobs unless it is ``admin``.
    Column("owner", String(64), nullable=True),
    # The W3C trace context (``traceparent``/``tracestate``) of the span that created the
    # job: every publish carries it and a worker's spans join it (conveyor.tracing).
    Column("trace_context", JSON(none_as_null=True), nullable=True),
    Index(
        "ix_jobs_due",
        "run_at",
        postgresql_where=text("published_at IS NULL AND status IN ('queued', 'retrying', 'throttled')"),
        sqlite_where=text("published_at IS NULL AND status IN ('queued', 'retrying', 'throttled')"),
    ),
    # The relay's epoch scans over waiting, published jobs (migration 0017).
    Index(
        "ix_jobs_published_epoch",
        "broker_epoch",
        "published_at",
        postgresql_where=text("published_at IS NOT NULL AND status IN ('queued', 'retrying', 'throttled')"),
        sqlite_where=text("published_at IS NOT NULL AND status IN ('queued', 'retrying', 'throttled')"),
    ),
    # The reconciler's expiry scan over waiting jobs that can expire (migration 0017).
    Index(
        "ix_jobs_expiring",
        "expires_at",
        postgresql_where=text("expires_at IS NOT NULL AND status IN ('queued', 'retrying', 'throttled')"),
        sqlite_where=text("expires_at IS NOT NULL AND status IN ('queued', 'retrying', 'throttled')"),
    ),
    # Partial where the lookups allow, so a claim and a completion write few index
    # entries (migration 0018).
    *_partial("ix_jobs_status_heartbeat", ["status", "heartbeat_at"], _LIVE),
    *_partial("ix_jobs_status_published", ["status", "published_at"], _WAITING),
    Index("ix_jobs_stage_status", "stage", "status"),
    Index("ix_jobs_flow", "flow_id"),
    *_partial("ix_jobs_finished", ["finished_at"], "finished_at IS NOT NULL"),
    *_partial("ix_jobs_celery_task", ["celery_task_id"], "status = 'running'"),
    *_partial("ix_jobs_parked", ["lease_key", "status", "priority"], "lease_key IS NOT NULL"),
    *_partial("ix_jobs_owner_created", ["owner", "created_at"], "owner IS NOT NULL"),
)

job_events = Table(
    own("job_events"),
    metadata,
    # SQLite: AUTOINCREMENT, so ids (its readers' positions) are never reused after a purge.
    Column("id", BigId, primary_key=True, autoincrement=True),
    # Postgres: the readers' position, numbered in commit order after commit (NULL until
    # then; see conveyor.store.events). SQLite leaves it NULL: one writer, so ``id`` is the position.
    Column("seq", BigInteger, nullable=True),
    Column("job_id", String(36), nullable=True),
    Column("topic", String(100), nullable=False),
    Column("body", JSON, nullable=False),
    Column("created_at", Timestamp(), nullable=False),
    Index(
        "ix_job_events_seq",
        "seq",
        unique=True,
        postgresql_where=text("seq IS NOT NULL"),
        sqlite_where=text("seq IS NOT NULL"),
    ),
    # What the sequencer has yet to number (Postgres only: SQLite never numbers).
    Index("ix_job_events_pending", "id", postgresql_where=text("seq IS NULL")).ddl_if(dialect="postgresql"),
    Index("ix_job_events_job", "job_id", "seq"),
    Index("ix_job_events_created", "created_at"),
    sqlite_autoincrement=True,
)

dead_letters = Table(
    own("dead_letters"),
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", String(36), nullable=True),
    Column("stage", String(200), nullable=True),
    Column("queue", String(100), nullable=True),
    Column("label", String(200), nullable=True),
    Column("error_type", String(200), nullable=False),
    Column("message", Text, nullable=False),
    Column("traceback", Text, nullable=True),
    Column("attempts", Integer, nullable=False, default=0),
    Column("headers", JSON, nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Column("retried_at", Timestamp(), nullable=True),
    Column("retried_by", String(200), nullable=True),
    # A retry asked of a worker (the entry's stage has an on_retry hook a client cannot run):
    # the relay performs it and clears the request, or records why it refused.
    Column("retry_requested_at", Timestamp(), nullable=True),
    Column("retry_requested_by", String(200), nullable=True),
    Column("retry_refused", Text, nullable=True),
    Index("ix_dead_letters_open", "retried_at", "id"),
    Index("ix_dead_letters_requested", "retry_requested_at"),
    Index("ix_dead_letters_job", "job_id"),
    Index("ix_dead_letters_created", "created_at"),
)

# Deduplication authority: who holds (scope, key), in which mode, until when. Times are
# milliseconds of the dedup clock (Redis TIME in production, a virtual clock in tests).
dedup_keys = Table(
    own("dedup_keys"),
    metadata,
    Column("scope", String(200), primary_key=True),
    Column("key", String(200), primary_key=True),
    Column("job_id", String(36), nullable=False),
    Column("mode", String(16), nullable=False),
    Column("expires_ms", BigInteger, nullable=True),
    Column("first_ms", BigInteger, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
    Index("ix_dedup_keys_job", "job_id"),
    Index("ix_dedup_keys_expires", "expires_ms"),
)

# Who a ``waiting_dedup`` job waits for (the holder of its dedup id when it was created).
dedup_followers = Table(
    own("dedup_followers"),
    metadata,
    Column("job_id", String(36), primary_key=True),
    Column("holder", String(36), nullable=False),
    Column("created_at", Timestamp(), nullable=False),
    Index("ix_dedup_followers_holder", "holder"),
)

# Named before the namespace existed: already prefixed, so SQLite does not prefix it again.
counters = Table(
    "conveyor_counters",
    metadata,
    Column("name", String(50), primary_key=True),
    Column("value", BigInteger, nullable=False),
)

# One row per lease key: who holds it (job, attempt, fencing token, renewed heartbeat), and
# which higher-priority job it is reserved for while a preemption is under way.
leases = Table(
    own("leases"),
    metadata,
    Column("key", String(200), primary_key=True),
    Column("holder_job", String(36), nullable=True),
    Column("holder_attempt", Integer, nullable=True),
    Column("token", BigInteger, nullable=True),
    Column("priority", Integer, nullable=False, default=0),
    Column("preemptable", Boolean, nullable=False, default=False),
    Column("heartbeat_at", Timestamp(), nullable=True),
    Column("reserved_job", String(36), nullable=True),
    Column("reserved_priority", Integer, nullable=True),
    Column("reserved_until", Timestamp(), nullable=True),
)


# The stage registry: what a client without the stage code needs to submit by name (see
# conveyor.client.registry). Written by ``conveyor db upgrade`` and by workers at start.
stages = Table(
    own("stages"),
    metadata,
    Column("name", String(200), primary_key=True),
    Column("queue", String(100), nullable=False),
    Column("priority", Integer, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    # The dedup policy as data (mode, key template, fields, ttl, window, max_wait, scope);
    # NULL without a policy, or when only the deployment's code can compute the key, then
    # ``dedup_by_code`` says why.
    Column("dedup", JSON(none_as_null=True), nullable=True),
    Column("dedup_by_code", Text, nullable=True),
    Column("lease_key", String(200), nullable=True),  # a format template over the payload
    Column("preemptable", Boolean, nullable=False, default=False),
    Column("payload_schema", JSON, nullable=False),  # the payload model's JSON Schema
    # Whether the stage has an ``on_retry`` hook; NULL: written before the registry said.
    Column("on_retry", Boolean, nullable=True),
    Column("updated_at", Timestamp(), nullable=False),  # when the row last changed
    # What a client applies at submit beyond the schema (conveyor.client.registry.submit_rules):
    # a strict idempotency rule, a masked kwargsrepr. NULL: nothing more.
    Column("submit_rules", JSON(none_as_null=True), nullable=True),
)

# Bearer tokens of the HTTP API (see conveyor.web.tokens): only a SHA-256 of each secret is
# kept; ``scopes`` is space-separated (``read submit``), ``revoked_at`` set ends it.
tokens = Table(
    own("tokens"),
    metadata,
    Column("id", String(32), primary_key=True),
    Column("owner", String(64), nullable=False),
    Column("name", String(200), nullable=True),
    Column("scopes", String(200), nullable=False),
    Column("secret_hash", String(64), nullable=False),
    Column("created_at", Timestamp(), nullable=False),
    Column("revoked_at", Timestamp(), nullable=True),
    Column("last_used_at", Timestamp(), nullable=True),
    Index("ix_tokens_owner", "owner"),
)


Row = Mapping[Any, Any]


def new_event(job_id: str | None, topic: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """Values for one outbox row (insert in the same transaction as the change)."""
    return {"job_id": job_id, "topic": topic, "body": dict(body)}
