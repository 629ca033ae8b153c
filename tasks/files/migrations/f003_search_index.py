"""search: a lexical index on chunks (Postgres: tsvector + GIN; SQLite: FTS5) and a
file's vectors in one row (file_vectors), moved from file_chunks.embedding

Revision ID: f003
Revises: f002
"""

from __future__ import annotations

import struct
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "f003"
down_revision = "f002"
branch_labels = None
depends_on = None

# Postgres: the chunk's words and its length in word occurrences (BM25's document length),
# both generated from ``text`` so every writer (stages, reembed, benches) keeps them. Words
# are plain: runs of word characters, lowercased and accent-folded (unaccent, as SQLite's
# remove_diacritics), no stemming or stopwords (the default parser keeps ``os.path.join``
# or a URL as one token, so "join" would not find it). ``file_chunk_words`` is the one
# definition, for chunks and queries alike. A GIN index on (owner, tsv) needs btree_gin
# (trusted since Postgres 13) so the owner scopes the index scan itself.
_PG_UP = [
    "CREATE EXTENSION IF NOT EXISTS btree_gin",
    "CREATE EXTENSION IF NOT EXISTS unaccent",
    # unaccent() is STABLE (it reads a dictionary); named explicitly it never changes.
    """CREATE FUNCTION file_chunk_words(text) RETURNS tsvector
       LANGUAGE sql IMMUTABLE PARALLEL SAFE
       AS $$ SELECT to_tsvector('simple'::regconfig, {schema}.unaccent(
                '{schema}.unaccent'::regdictionary, regexp_replace($1, '\\W+', ' ', 'g'))) $$""",
    """CREATE FUNCTION file_chunk_terms(tsvector) RETURNS integer
       LANGUAGE sql IMMUTABLE PARALLEL SAFE
       AS $$ SELECT coalesce(sum(coalesce(array_length(positions, 1), 1)), 0)::integer FROM unnest($1) $$""",
    """ALTER TABLE file_chunks
       ADD COLUMN tsv tsvector GENERATED ALWAYS AS (file_chunk_words(text)) STORED,
       ADD COLUMN terms integer GENERATED ALWAYS AS (file_chunk_terms(file_chunk_words(text))) STORED""",
    "CREATE INDEX ix_file_chunks_owner_tsv ON file_chunks USING gin (owner, tsv)",
]
_PG_DOWN = [
    "DROP INDEX ix_file_chunks_owner_tsv",
    "ALTER TABLE file_chunks DROP COLUMN terms, DROP COLUMN tsv",
    "DROP FUNCTION file_chunk_terms(tsvector)",
    "DROP FUNCTION file_chunk_words(text)",
]

# SQLite: an external-content FTS5 table over a view that adds the owner as one token
# ('o' + hex of the owner: any owner string becomes a single exact token), kept by triggers.
_OKEY = "'o' || hex({row}.owner)"
_SQLITE_UP = [
    "CREATE VIEW file_chunks_fts_src AS SELECT id, text, 'o' || hex(owner) AS okey FROM file_chunks",
    """CREATE VIRTUAL TABLE file_chunks_fts USING fts5(
       text, okey, content='file_chunks_fts_src', content_rowid='id',
       tokenize='unicode61 remove_diacritics 2')""",
    f"""CREATE TRIGGER file_chunks_fts_ai AFTER INSERT ON file_chunks BEGIN
       INSERT INTO file_chunks_fts(rowid, text, okey) VALUES (new.id, new.text, {_OKEY.format(row="new")});
       END""",
    f"""CREATE TRIGGER file_chunks_fts_ad AFTER DELETE ON file_chunks BEGIN
       INSERT INTO file_chunks_fts(file_chunks_fts, rowid, text, okey)
       VALUES ('delete', old.id, old.text, {_OKEY.format(row="old")});
       END""",
    f"""CREATE TRIGGER file_chunks_fts_au AFTER UPDATE OF text, owner ON file_chunks BEGIN
       INSERT INTO file_chunks_fts(file_chunks_fts, rowid, text, okey)
       VALUES ('delete', old.id, old.text, {_OKEY.format(row="old")});
       INSERT INTO file_chunks_fts(rowid, text, okey) VALUES (new.id, new.text, {_OKEY.format(row="new")});
       END""",
    "INSERT INTO file_chunks_fts(file_chunks_fts) VALUES ('rebuild')",
]
_SQLITE_DOWN = [
    "DROP TRIGGER file_chunks_fts_au",
    "DROP TRIGGER file_chunks_fts_ad",
    "DROP TRIGGER file_chunks_fts_ai",
    "DROP TABLE file_chunks_fts",
    "DROP VIEW file_chunks_fts_src",
]


def upgrade() -> None:
    vectors = op.create_table(
        "file_vectors",
        sa.Column("file_id", sa.String(36), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("model", sa.String(50), nullable=False),
        sa.Column("chunk_ids", sa.LargeBinary(), nullable=False),
        sa.Column("vectors", sa.LargeBinary(), nullable=False),
    )
    op.create_index("ix_file_vectors_owner", "file_vectors", ["owner", "model"])
    _move_vectors(vectors)
    # Before the FTS triggers exist: SQLite's batch mode rebuilds the table.
    with op.batch_alter_table("file_chunks") as batch:
        batch.drop_column("embedding")
        batch.drop_column("model")
    if op.get_bind().dialect.name == "postgresql":
        for statement in _PG_UP[:2]:
            op.execute(statement)
        schema = op.get_bind().execute(
            sa.text("SELECT extnamespace::regnamespace::text FROM pg_extension WHERE extname = 'unaccent'")
        ).scalar_one()
        for statement in _PG_UP[2:]:
            op.execute(statement.replace("{schema}", schema))
    else:
        for statement in _SQLITE_UP:
            op.execute(statement)


def _move_vectors(vectors: sa.Table) -> None:
    """Each file's chunk vectors (one model per file: the embed stage writes them together)."""
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT file_id, owner, model, id, embedding FROM file_chunks"
            " WHERE embedding IS NOT NULL ORDER BY file_id, ordinal"
        )
    ).all()
    grouped: dict[str, dict[str, Any]] = {}
    for r in rows:
        entry = grouped.setdefault(
            r.file_id, {"owner": r.owner, "model": r.model or "unknown", "ids": [], "v": []}
        )
        entry["ids"].append(r.id)
        entry["v"].append(bytes(r.embedding))
    for file_id, e in grouped.items():
        conn.execute(
            vectors.insert().values(
                file_id=file_id, owner=e["owner"], model=e["model"],
                chunk_ids=struct.pack(f"<{len(e['ids'])}q", *e["ids"]), vectors=b"".join(e["v"]),
            )
        )  # fmt: skip


def downgrade() -> None:
    for statement in _PG_DOWN if op.get_bind().dialect.name == "postgresql" else _SQLITE_DOWN:
        op.execute(statement)
    with op.batch_alter_table("file_chunks") as batch:
        batch.add_column(sa.Column("embedding", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("model", sa.String(50), nullable=True))
    op.drop_index("ix_file_vectors_owner", "file_vectors")
    op.drop_table("file_vectors")  # chunks come back unembedded: run conveyor files reembed
