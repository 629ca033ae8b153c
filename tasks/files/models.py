"""Tables of the files family: batches, files, chunks, and each file's vectors."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

from conveyor.store.db.dialect import Timestamp
from conveyor.store.db.namespace import SCHEMA, own
from conveyor.store.db.schema import BigId

# In Conveyor's schema (a prefix on SQLite), beside the platform's tables.
metadata = MetaData(schema=SCHEMA)

# File states. ready/failed/cancelled are terminal and counted once in their batch.
# ``uploading``: the row exists before its content is stored, so a failed or killed upload
# leaves a row the reconciler can find (and whose object it deletes), never an orphan object.
UPLOADING = "uploading"
UPLOADED = "uploaded"
QUEUED = "queued"
EXTRACTING = "extracting"
CHUNKING = "chunking"
EMBEDDING = "embedding"
READY = "ready"
FAILED = "failed"
CANCELLED = "cancelled"
TERMINAL = (READY, FAILED, CANCELLED)
ACTIVE = (QUEUED, EXTRACTING, CHUNKING, EMBEDDING)

batches = Table(
    own("file_batches"),
    metadata,
    Column("id", String(36), primary_key=True),
    Column("owner", String(200), nullable=False),
    # Sealed: no more files. A batch created with ``expected`` seals itself at its last upload.
    Column("sealed", Boolean, nullable=False, default=False),
    Column("expected", Integer, nullable=True),
    Column("total", Integer, nullable=False, default=0),  # files counted in the batch
    Column("terminal", Integer, nullable=False, default=0),
    Column("ready", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("cancelled", Integer, nullable=False, default=0),
    Column("status", String(20), nullable=False),  # open | processing | completed
    Column("created_at", Timestamp(), nullable=False),
    Column("completed_at", Timestamp(), nullable=True),
)

files = Table(
    own("files"),
    metadata,
    Column("id", String(36), primary_key=True),
    Column("owner", String(200), nullable=False),
    Column("batch_id", String(36), nullable=True),
    Column("name", String(500), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("content_ref", String(1000), nullable=False),
    Column("checksum", String(64), nullable=False),
    Column("mime", String(200), nullable=True),
    Column("encoding", String(50), nullable=True),  # text documents: the detected charset
    Column("status", String(20), nullable=False),
    Column("pages", Integer, nullable=True),
    Column("text", Text, nullable=True),
    Column("chunk_count", Integer, nullable=True),
    Column("error_type", String(200), nullable=True),
    Column("error", Text, nullable=True),
    Column("failed_stage", String(50), nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Column("updated_at", Timestamp(), nullable=False),
    Index("ix_files_batch", "batch_id", "status"),
    Index("ix_files_owner", "owner"),
    Index("ix_files_status_updated", "status", "updated_at"),
)

chunks = Table(
    own("file_chunks"),
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("file_id", String(36), nullable=False),
    Column("owner", String(200), nullable=False),
    Column("ordinal", Integer, nullable=False),
    Column("text", Text, nullable=False),
    Index("ix_file_chunks_file", "file_id", "ordinal"),
    Index("ix_file_chunks_owner", "owner"),
)

# Chunks written under a staging key (SQLite; see tasks.files.flow.stage_chunks) and who
# writes them: a chunk attempt (``job_id``, ``attempt``), whose key is dead once that
# attempt no longer owns its job (the job's attempts counter is its fencing token), or a
# re-embed in the caller's process (no job), whose key is dead once it is older than the
# stale-upload bound. The reconciler drains dead keys.
staging = Table(
    own("file_chunk_staging"),
    metadata,
    Column("key", String(36), primary_key=True),
    Column("file_id", String(36), nullable=False),
    Column("job_id", String(36), nullable=True),
    Column("attempt", Integer, nullable=True),
    Column("created_at", Timestamp(), nullable=False),
    Index("ix_file_chunk_staging_job", "job_id"),
)

# A file's chunk vectors in one row (search reads a user's vectors on every query: a row
# per file instead of per chunk is a twentieth of the rows, and rows are what costs).
# ``chunk_ids``: int64 little-endian; ``vectors``: float32 little-endian, one per chunk id,
# in that order (see :func:`tasks.files.embedding.pack`).
file_vectors = Table(
    own("file_vectors"),
    metadata,
    Column("file_id", String(36), primary_key=True),
    Column("owner", String(200), nullable=False),
    Column("model", String(50), nullable=False),
    Column("chunk_ids", LargeBinary, nullable=False),
    Column("vectors", LargeBinary, nullable=False),
    Index("ix_file_vectors_owner", "owner", "model"),
)
