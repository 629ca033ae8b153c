"""platform tables

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import EVENT_TXID_DEFAULT_PG, Timestamp

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    txid_default = sa.text(EVENT_TXID_DEFAULT_PG) if pg else sa.text("0")
    op.create_table(
        "dead_letters",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("job_id", sa.String(length=36), nullable=True),
        sa.Column("stage", sa.String(length=200), nullable=True),
        sa.Column("queue", sa.String(length=100), nullable=True),
        sa.Column("label", sa.String(length=200), nullable=True),
        sa.Column("error_type", sa.String(length=200), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("headers", sa.JSON(), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("retried_at", Timestamp(), nullable=True),
        sa.Column("retried_by", sa.String(length=200), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letters")),
    )
    op.create_index("ix_dead_letters_created", "dead_letters", ["created_at"], unique=False)
    op.create_index("ix_dead_letters_job", "dead_letters", ["job_id"], unique=False)
    op.create_index("ix_dead_letters_open", "dead_letters", ["retried_at", "id"], unique=False)
    op.create_table(
        "job_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("txid", sa.BigInteger(), server_default=txid_default, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=True),
        sa.Column("topic", sa.String(length=100), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_events")),
    )
    op.create_index("ix_job_events_job", "job_events", ["job_id", "id"], unique=False)
    op.create_index("ix_job_events_position", "job_events", ["txid", "id"], unique=False)
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("stage", sa.String(length=200), nullable=False),
        sa.Column("queue", sa.String(length=100), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("label", sa.String(length=200), nullable=True),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("run_at", Timestamp(), nullable=False),
        sa.Column("expires_at", Timestamp(), nullable=True),
        sa.Column("lease_owner", sa.String(length=200), nullable=True),
        sa.Column("heartbeat_at", Timestamp(), nullable=True),
        sa.Column("error_type", sa.String(length=200), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("progress", sa.JSON(), nullable=True),
        sa.Column("flow_id", sa.String(length=36), nullable=True),
        sa.Column("parent_id", sa.String(length=36), nullable=True),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("origin_task_id", sa.String(length=64), nullable=True),
        sa.Column("celery_task_id", sa.String(length=64), nullable=True),
        sa.Column("published_at", Timestamp(), nullable=True),
        sa.Column("broker_epoch", sa.String(length=40), nullable=True),
        sa.Column("cancel_requested_at", Timestamp(), nullable=True),
        sa.Column("cancelled_by", sa.String(length=200), nullable=True),
        sa.Column("cancel_reason", sa.Text(), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
        sa.Column("started_at", Timestamp(), nullable=True),
        sa.Column("finished_at", Timestamp(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_jobs_idempotency_key")),
    )
    op.create_index(
        "ix_jobs_due",
        "jobs",
        ["run_at"],
        unique=False,
        postgresql_where=sa.text("published_at IS NULL AND status IN ('queued', 'retrying')"),
        sqlite_where=sa.text("published_at IS NULL AND status IN ('queued', 'retrying')"),
    )
    op.create_index("ix_jobs_finished", "jobs", ["finished_at"], unique=False)
    op.create_index("ix_jobs_flow", "jobs", ["flow_id"], unique=False)
    op.create_index("ix_jobs_stage_status", "jobs", ["stage", "status"], unique=False)
    op.create_index("ix_jobs_status_heartbeat", "jobs", ["status", "heartbeat_at"], unique=False)
    op.create_index("ix_jobs_status_published", "jobs", ["status", "published_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_status_published", table_name="jobs")
    op.drop_index("ix_jobs_status_heartbeat", table_name="jobs")
    op.drop_index("ix_jobs_stage_status", table_name="jobs")
    op.drop_index("ix_jobs_flow", table_name="jobs")
    op.drop_index("ix_jobs_finished", table_name="jobs")
    op.drop_index(
        "ix_jobs_due",
        table_name="jobs",
        postgresql_where=sa.text("published_at IS NULL AND status IN ('queued', 'retrying')"),
        sqlite_where=sa.text("published_at IS NULL AND status IN ('queued', 'retrying')"),
    )
    op.drop_table("jobs")
    op.drop_index("ix_job_events_position", table_name="job_events")
    op.drop_index("ix_job_events_job", table_name="job_events")
    op.drop_table("job_events")
    op.drop_index("ix_dead_letters_open", table_name="dead_letters")
    op.drop_index("ix_dead_letters_job", table_name="dead_letters")
    op.drop_index("ix_dead_letters_created", table_name="dead_letters")
    op.drop_table("dead_letters")
