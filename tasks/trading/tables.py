"""The trading family's tables, in Conveyor's schema.

- ``trading_users``: whose user it is (the owner that first connected them).
- ``trading_connections``: a user's broker token, encrypted (Fernet), one per broker.
- ``trading_trades``: the stored trades, unique by ``(user_id, broker, ext_id)``; ``id`` is
  derived from those three (uuid5), so a trade imported again keeps its id (``tradeId``).
- ``trading_import_rejects``: a malformed broker row: job, page, ext id and reason, never
  the row itself.
- ``trading_imports``: one import job's committed cursor and counters (its resume point).
- ``trading_bias_tags``: ``BiasTag`` rows, unique by ``(trade_id, label)``.
- ``trading_scores``: one score job's committed cursor (the last trade tagged) and counts.
- ``trading_digests``: one digest per ``(user_id, period_start, period_end)``, its JSON
  snapshot's storage reference and body.
"""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Column, Float, Index, Integer, MetaData, Numeric, String, Table, Text

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.namespace import SCHEMA, own

metadata = MetaData(schema=SCHEMA)
AMOUNT = Numeric(38, 18)

users = Table(
    own("trading_users"),
    metadata,
    Column("user_id", String(64), primary_key=True),
    # The API token's owner who first connected the user (None: the deployment, the CLI):
    # only that owner (or an admin) may act for the user. Its primary key makes the first
    # connection's claim atomic.
    Column("owner", String(64), nullable=True),
    Column("created_at", Timestamp(), nullable=False),
)

connections = Table(
    own("trading_connections"),
    metadata,
    Column("user_id", String(64), primary_key=True),
    Column("broker", String(20), primary_key=True),
    Column("token_enc", Text, nullable=False),
    Column("created_at", Timestamp(), nullable=False),
    Column("updated_at", Timestamp(), nullable=False),
)

trades = Table(
    own("trading_trades"),
    metadata,
    Column("id", String(36), primary_key=True),
    Column("user_id", String(64), nullable=False),
    Column("broker", String(20), nullable=False),
    Column("ext_id", String(100), nullable=False),
    Column("symbol", String(40), nullable=False),
    Column("side", String(4), nullable=False),
    Column("qty", AMOUNT, nullable=False),
    Column("price", AMOUNT, nullable=False),
    Column("fee", AMOUNT, nullable=False),
    Column("ts", Timestamp(), nullable=False),
    Column("import_job", String(36), nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Index("uq_trading_trades_ext", "user_id", "broker", "ext_id", unique=True),
    Index("ix_trading_trades_user_ts", "user_id", "ts", "id"),
)

rejects = Table(
    own("trading_import_rejects"),
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("job_id", String(36), nullable=False),
    Column("user_id", String(64), nullable=False),
    Column("broker", String(20), nullable=False),
    Column("page", Integer, nullable=False),
    Column("ext_id", String(100), nullable=True),
    Column("reason", String(200), nullable=False),
    Column("created_at", Timestamp(), nullable=False),
    Index("ix_trading_import_rejects_user", "user_id", "job_id"),
)

imports = Table(
    own("trading_imports"),
    metadata,
    Column("job_id", String(36), primary_key=True),
    Column("user_id", String(64), nullable=False),
    Column("broker", String(20), nullable=False),
    Column("since", String(10), nullable=False),
    Column("cursor", String(500), nullable=True),
    Column("pages", Integer, nullable=False),
    Column("fetched", Integer, nullable=False),
    Column("stored", Integer, nullable=False),
    Column("rejected", Integer, nullable=False),
    Column("done", Integer, nullable=False),  # 0/1: the last page committed
    Column("updated_at", Timestamp(), nullable=False),
)

tags = Table(
    own("trading_bias_tags"),
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("trade_id", String(36), nullable=False),
    Column("user_id", String(64), nullable=False),
    Column("label", String(40), nullable=False),
    Column("confidence", Float, nullable=False),
    Column("features", JSON, nullable=False),
    Column("insight", Text, nullable=True),  # the coach's reflection on the trade
    Column("score_job", String(36), nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Index("uq_trading_bias_tags_trade_label", "trade_id", "label", unique=True),
    Index("ix_trading_bias_tags_user", "user_id"),
)

digests = Table(
    own("trading_digests"),
    metadata,
    Column("id", String(36), primary_key=True),  # uuid5 of user and period: stable
    Column("user_id", String(64), nullable=False),
    Column("period_start", String(10), nullable=False),
    Column("period_end", String(10), nullable=False),
    Column("snapshot", String(300), nullable=False),  # the storage reference of its JSON
    Column("body", JSON, nullable=False),
    Column("job_id", String(36), nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Column("updated_at", Timestamp(), nullable=False),
    Index("uq_trading_digests_period", "user_id", "period_start", "period_end", unique=True),
)

scores = Table(
    own("trading_scores"),
    metadata,
    Column("job_id", String(36), primary_key=True),
    Column("user_id", String(64), nullable=False),
    Column("since", String(10), nullable=False),
    # The keyset cursor: the last trade tagged (its time, then its id).
    Column("last_ts", Timestamp(), nullable=True),
    Column("last_id", String(36), nullable=True),
    Column("batches", Integer, nullable=False),
    Column("tagged", Integer, nullable=False),
    Column("reflected", Integer, nullable=False),
    Column("updated_at", Timestamp(), nullable=False),
)
