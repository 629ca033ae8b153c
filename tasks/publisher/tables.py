"""The publisher family's table: ``publisher_jobs``, the seed's record of a post (or of an
Instagram first comment, ``type="ig_first_comment"``, its ``parent_id`` the post).

``status`` follows the post's job in the stage's own transactions and hooks: ``pending``
until an attempt starts, ``running`` while one runs, back to ``pending`` when it will be
retried, ``completed`` (with ``remote_id``, in the completion transaction) or ``failed`` (the
dead-letter transaction); ``cancelled`` by an operator. ``job_id`` is its current job.
"""

from __future__ import annotations

from sqlalchemy import JSON, Column, Index, Integer, MetaData, String, Table, Text, text

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.namespace import SCHEMA, own

metadata = MetaData(schema=SCHEMA)

PENDING = "pending"
RUNNING = "running"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
STATUSES = (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED)
POST = "post"
FIRST_COMMENT = "ig_first_comment"

posts = Table(
    own("publisher_jobs"),
    metadata,
    Column("id", String(36), primary_key=True),
    Column("type", String(20), nullable=False),
    Column("parent_id", String(36), nullable=True),
    Column("owner", String(100), nullable=True),
    Column("brand", String(100), nullable=False),
    Column("channel", String(20), nullable=False),
    Column("account", String(100), nullable=False),
    Column("caption", Text, nullable=False),  # rendered; a first comment's text
    Column("media", JSON, nullable=False),
    Column("first_comment", Text, nullable=True),
    Column("scheduled_at", Timestamp(), nullable=False),
    Column("idempotency_key", String(128), nullable=False),
    Column("status", String(10), nullable=False),
    Column("attempts", Integer, nullable=False, default=0),
    Column("job_id", String(36), nullable=True),
    Column("container_id", String(100), nullable=True),  # Instagram: the media container
    Column("container_at", Timestamp(), nullable=True),
    Column("sending_at", Timestamp(), nullable=True),  # Facebook: a post request went out
    Column("remote_id", String(100), nullable=True),
    Column("last_error", Text, nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Column("updated_at", Timestamp(), nullable=False),
    Column("completed_at", Timestamp(), nullable=True),
    # One live post per plan; a cancelled one leaves the plan free (a partial index).
    Index(
        "uq_publisher_jobs_channel_key",
        "channel",
        "idempotency_key",
        unique=True,
        postgresql_where=text("status <> 'cancelled'"),
        sqlite_where=text("status <> 'cancelled'"),
    ),
    Index("ix_publisher_jobs_status", "status", "scheduled_at"),
    Index("ix_publisher_jobs_parent", "parent_id"),
)
