"""Tables of the email family: stored HTML, the outbox (one row per message), recipients
and the send log. The outbox is where a message's addresses live besides its job's payload;
nothing else keeps them (logs, events and dead letters mask them)."""

from __future__ import annotations

from sqlalchemy import JSON, Column, Index, Integer, MetaData, String, Table, Text, UniqueConstraint

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.namespace import SCHEMA, own

metadata = MetaData(schema=SCHEMA)

# Outbox states. SENDING: committed right before the point of no return (SMTP's DATA, the
# provider's request); an attempt that finds it cannot tell whether the message went out.
PENDING = "PENDING"
SENDING = "SENDING"
SENT = "SENT"
FAILED = "FAILED"
UNKNOWN = "UNKNOWN"
EXPIRED = "EXPIRED"
STATUSES = (PENDING, SENDING, SENT, FAILED, UNKNOWN, EXPIRED)

html = Table(
    own("email_html"),
    metadata,
    Column("id", String(64), primary_key=True),  # sha256 of the UTF-8 HTML, or a producer's id
    Column("html", Text, nullable=False),
    Column("created_at", Timestamp(), nullable=False),
)

outbox = Table(
    own("email_outbox"),
    metadata,
    Column("id", String(36), primary_key=True),  # the seed's outboxId, also its job's id
    Column("company_id", String(36), nullable=False),
    Column("status", String(10), nullable=False),
    Column("to_address", String(254), nullable=False),
    Column("request_hash", String(64), nullable=False),  # canonical payload, ignored fields out
    Column("message_id", String(200), nullable=False),  # <outboxId@domain>
    Column("provider", String(10), nullable=True),
    Column("provider_message_id", String(200), nullable=True),
    Column("attempts", Integer, nullable=False, default=0),  # counted attempts that sent or tried
    Column("refused", JSON(none_as_null=True), nullable=True),  # addresses refused among accepted ones
    Column("last_error", Text, nullable=True),
    Column("duration_ms", Integer, nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Column("updated_at", Timestamp(), nullable=False),
    Column("sent_at", Timestamp(), nullable=True),
    Index("ix_email_outbox_status", "status", "updated_at"),
    Index("ix_email_outbox_company", "company_id", "created_at"),
)

recipients = Table(
    own("email_recipients"),
    metadata,
    Column("id", String(36), primary_key=True),
    Column("company_id", String(36), nullable=False),
    Column("email", String(254), nullable=False),
    Column("external_id", String(64), nullable=True),
    Column("cpf_cnpj_hash", String(64), nullable=True),  # HMAC-SHA256, never the digits
    Column("nome", String(200), nullable=True),
    Column("razao_social", String(200), nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Column("updated_at", Timestamp(), nullable=False),
    UniqueConstraint("company_id", "email", name="uq_email_recipients_company_email"),
)

log = Table(
    own("email_log"),
    metadata,
    Column("id", String(36), primary_key=True),  # the outboxId: one entry per message sent
    Column("company_id", String(36), nullable=False),
    Column("recipient_id", String(36), nullable=True),
    Column("provider", String(10), nullable=False),
    Column("provider_message_id", String(200), nullable=False),
    Column("status", String(10), nullable=False),
    Column("attempt", Integer, nullable=False),  # the job's counted attempt that sent it
    Column("duration_ms", Integer, nullable=False),
    Column("created_at", Timestamp(), nullable=False),
)
