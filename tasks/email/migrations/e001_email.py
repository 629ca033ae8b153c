"""email family tables: stored HTML, the outbox, recipients and the send log

Revision ID: e001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.migrate import own_table

revision = "e001"
down_revision = None
branch_labels = ("email",)
# Conveyor's own schema (0011), not its newest revision: a revision a family depends on
# leaves the version table, and another deployment on the same database (one without this
# family) must still find the platform's head there.
depends_on = "0011"


def upgrade() -> None:
    op.create_table(
        own_table("email_html"),
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("html", sa.Text(), nullable=False),
        sa.Column("created_at", Timestamp(), nullable=False),
    )
    outbox = own_table("email_outbox")
    op.create_table(
        outbox,
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("company_id", sa.String(36), nullable=False),
        sa.Column("status", sa.String(10), nullable=False),
        sa.Column("to_address", sa.String(254), nullable=False),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("message_id", sa.String(200), nullable=False),
        sa.Column("provider", sa.String(10), nullable=True),
        sa.Column("provider_message_id", sa.String(200), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("refused", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("duration_ms", sa.Integer(), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
        sa.Column("sent_at", Timestamp(), nullable=True),
    )
    op.create_index("ix_email_outbox_status", outbox, ["status", "updated_at"])
    op.create_index("ix_email_outbox_company", outbox, ["company_id", "created_at"])
    op.create_table(
        own_table("email_recipients"),
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("company_id", sa.String(36), nullable=False),
        sa.Column("email", sa.String(254), nullable=False),
        sa.Column("external_id", sa.String(64), nullable=True),
        sa.Column("cpf_cnpj_hash", sa.String(64), nullable=True),
        sa.Column("nome", sa.String(200), nullable=True),
        sa.Column("razao_social", sa.String(200), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
        sa.UniqueConstraint("company_id", "email", name="uq_email_recipients_company_email"),
    )
    op.create_table(
        own_table("email_log"),
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("company_id", sa.String(36), nullable=False),
        sa.Column("recipient_id", sa.String(36), nullable=True),
        sa.Column("provider", sa.String(10), nullable=False),
        sa.Column("provider_message_id", sa.String(200), nullable=False),
        sa.Column("status", sa.String(10), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.Column("created_at", Timestamp(), nullable=False),
    )


def downgrade() -> None:
    for name in ("email_log", "email_recipients", "email_outbox", "email_html"):
        op.drop_table(own_table(name))
