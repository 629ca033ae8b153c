"""a lexical index on chunks: BM25 by owner (Postgres: tsvector + GIN; SQLite: FTS5)

Revision ID: f003
Revises: f002
"""

from __future__ import annotations

from alembic import op

revision = "f003"
down_revision = "f002"
branch_labels = None
depends_on = None

# Postgres: the chunk's words and its length in word occurrences (BM25's document length),
# both generated from ``text`` so every writer (stages, reembed, benches) keeps them. Words
# are plain: runs of word characters, lowercased, no stemming or stopwords (the default
# parser keeps ``os.path.join`` or a URL as one token, so "join" would not find it). A GIN index on (owner, tsv) needs btree_gin (trusted since Postgres 13) so the
# owner scopes the index scan itself.
_PG_UP = [
    "CREATE EXTENSION IF NOT EXISTS btree_gin",
    """CREATE FUNCTION file_chunk_terms(tsvector) RETURNS integer
       LANGUAGE sql IMMUTABLE PARALLEL SAFE
       AS $$ SELECT coalesce(sum(coalesce(array_length(positions, 1), 1)), 0)::integer FROM unnest($1) $$""",
    """ALTER TABLE file_chunks
       ADD COLUMN tsv tsvector GENERATED ALWAYS AS
           (to_tsvector('simple'::regconfig, regexp_replace(text, '\\W+', ' ', 'g'))) STORED,
       ADD COLUMN terms integer GENERATED ALWAYS AS
           (file_chunk_terms(to_tsvector('simple'::regconfig, regexp_replace(text, '\\W+', ' ', 'g')))) STORED""",
    "CREATE INDEX ix_file_chunks_owner_tsv ON file_chunks USING gin (owner, tsv)",
]
_PG_DOWN = [
    "DROP INDEX ix_file_chunks_owner_tsv",
    "ALTER TABLE file_chunks DROP COLUMN terms, DROP COLUMN tsv",
    "DROP FUNCTION file_chunk_terms(tsvector)",
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
    for statement in _PG_UP if op.get_bind().dialect.name == "postgresql" else _SQLITE_UP:
        op.execute(statement)


def downgrade() -> None:
    for statement in _PG_DOWN if op.get_bind().dialect.name == "postgresql" else _SQLITE_DOWN:
        op.execute(statement)
