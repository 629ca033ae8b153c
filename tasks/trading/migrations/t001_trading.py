"""trading family tables: users, connections, trades, import rejects and cursors, bias tags, scores, digests

Revision ID: t001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.migrate import own_table

revision = "t001"
down_revision = None
branch_labels = ("trading",)
# Conveyor's own schema (0011), not its newest revision (see the files family's f001).
depends_on = "0011"

AMOUNT = sa.Numeric(38, 18)
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        own_table("trading_users"),
        sa.Column("user_id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
    )
    op.create_table(
        own_table("trading_connections"),
        sa.Column("user_id", sa.String(64), primary_key=True),
        sa.Column("broker", sa.String(20), primary_key=True),
        sa.Column("token_enc", sa.Text(), nullable=False),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
    )
    trades = own_table("trading_trades")
    op.create_table(
        trades,
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("user_id", sa.String(64), nullable=False),
        sa.Column("broker", sa.String(20), nullable=False),
        sa.Column("ext_id", sa.String(100), nullable=False),
        sa.Column("symbol", sa.String(40), nullable=False),
        sa.Column("side", sa.String(4), nullable=False),
        sa.Column("qty", AMOUNT, nullable=False),
        sa.Column("price", AMOUNT, nullable=False),
        sa.Column("fee", AMOUNT, nullable=False),
        sa.Column("ts", Timestamp(), nullable=False),
        sa.Column("import_job", sa.String(36), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
    )
    op.create_index("uq_trading_trades_ext", trades, ["user_id", "broker", "ext_id"], unique=True)
    op.create_index("ix_trading_trades_user_ts", trades, ["user_id", "ts", "id"])
    rejects = own_table("trading_import_rejects")
    op.create_table(
        rejects,
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("user_id", sa.String(64), nullable=False),
        sa.Column("broker", sa.String(20), nullable=False),
        sa.Column("page", sa.Integer(), nullable=False),
        sa.Column("ext_id", sa.String(100), nullable=True),
        sa.Column("reason", sa.String(200), nullable=False),
        sa.Column("created_at", Timestamp(), nullable=False),
    )
    op.create_index("ix_trading_import_rejects_user", rejects, ["user_id", "job_id"])
    op.create_table(
        own_table("trading_imports"),
        sa.Column("job_id", sa.String(36), primary_key=True),
        sa.Column("user_id", sa.String(64), nullable=False),
        sa.Column("broker", sa.String(20), nullable=False),
        sa.Column("since", sa.String(10), nullable=False),
        sa.Column("cursor", sa.String(500), nullable=True),
        sa.Column("pages", sa.Integer(), nullable=False),
        sa.Column("fetched", sa.Integer(), nullable=False),
        sa.Column("stored", sa.Integer(), nullable=False),
        sa.Column("rejected", sa.Integer(), nullable=False),
        sa.Column("done", sa.Integer(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
    )
    tags = own_table("trading_bias_tags")
    op.create_table(
        tags,
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("trade_id", sa.String(36), nullable=False),
        sa.Column("user_id", sa.String(64), nullable=False),
        sa.Column("label", sa.String(40), nullable=False),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("features", sa.JSON(), nullable=False),
        sa.Column("insight", sa.Text(), nullable=True),
        sa.Column("score_job", sa.String(36), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
    )
    op.create_index("uq_trading_bias_tags_trade_label", tags, ["trade_id", "label"], unique=True)
    op.create_index("ix_trading_bias_tags_user", tags, ["user_id"])
    digests = own_table("trading_digests")
    op.create_table(
        digests,
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("user_id", sa.String(64), nullable=False),
        sa.Column("period_start", sa.String(10), nullable=False),
        sa.Column("period_end", sa.String(10), nullable=False),
        sa.Column("snapshot", sa.String(300), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("job_id", sa.String(36), nullable=True),
        sa.Column("created_at", Timestamp(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
    )
    op.create_index(
        "uq_trading_digests_period", digests, ["user_id", "period_start", "period_end"], unique=True
    )
    op.create_table(
        own_table("trading_scores"),
        sa.Column("job_id", sa.String(36), primary_key=True),
        sa.Column("user_id", sa.String(64), nullable=False),
        sa.Column("since", sa.String(10), nullable=False),
        sa.Column("last_ts", Timestamp(), nullable=True),
        sa.Column("last_id", sa.String(36), nullable=True),
        sa.Column("batches", sa.Integer(), nullable=False),
        sa.Column("tagged", sa.Integer(), nullable=False),
        sa.Column("reflected", sa.Integer(), nullable=False),
        sa.Column("updated_at", Timestamp(), nullable=False),
    )


def downgrade() -> None:
    for name in (
        "trading_digests",
        "trading_scores",
        "trading_bias_tags",
        "trading_imports",
        "trading_import_rejects",
        "trading_trades",
        "trading_connections",
        "trading_users",
    ):
        op.drop_table(own_table(name))
