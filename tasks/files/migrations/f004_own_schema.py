"""the files family's tables, functions and search index move into Conveyor's schema (on
SQLite: take its prefix, the FTS index rebuilt under the prefixed names)

Revision ID: f004
Revises: f003
"""

from __future__ import annotations

from alembic import op

from conveyor.store.db.migrate import SCHEMA_KEY, abandon, adopt
from conveyor.store.db.namespace import sqlite_prefix

revision = "f004"
down_revision = "f003"
branch_labels = None
depends_on = None

TABLES = ["file_batches", "files", "file_chunks", "file_vectors"]
FUNCTIONS = ["file_chunk_words(text)", "file_chunk_terms(tsvector)"]

# SQLite's external-content FTS5 index names its view and table in its own definition, so
# it is dropped and built again (from the chunks, by 'rebuild') under the new names.
_OKEY = "'o' || hex({row}.owner)"
_NEW = "(new.id, new.text, " + _OKEY.format(row="new") + ")"
_FTS_UP = [
    "CREATE VIEW {p}file_chunks_fts_src AS SELECT id, text, 'o' || hex(owner) AS okey FROM {c}",
    """CREATE VIRTUAL TABLE {p}file_chunks_fts USING fts5(
       text, okey, content='{p}file_chunks_fts_src', content_rowid='id',
       tokenize='unicode61 remove_diacritics 2')""",
    f"""CREATE TRIGGER {{p}}file_chunks_fts_ai AFTER INSERT ON {{c}} BEGIN
       INSERT INTO {{p}}file_chunks_fts(rowid, text, okey) VALUES {_NEW};
       END""",
    f"""CREATE TRIGGER {{p}}file_chunks_fts_ad AFTER DELETE ON {{c}} BEGIN
       INSERT INTO {{p}}file_chunks_fts({{p}}file_chunks_fts, rowid, text, okey)
       VALUES ('delete', old.id, old.text, {_OKEY.format(row="old")});
       END""",
    f"""CREATE TRIGGER {{p}}file_chunks_fts_au AFTER UPDATE OF text, owner ON {{c}} BEGIN
       INSERT INTO {{p}}file_chunks_fts({{p}}file_chunks_fts, rowid, text, okey)
       VALUES ('delete', old.id, old.text, {_OKEY.format(row="old")});
       INSERT INTO {{p}}file_chunks_fts(rowid, text, okey) VALUES {_NEW};
       END""",
    "INSERT INTO {p}file_chunks_fts({p}file_chunks_fts) VALUES ('rebuild')",
]
_FTS_DOWN = [
    "DROP TRIGGER IF EXISTS {p}file_chunks_fts_au",
    "DROP TRIGGER IF EXISTS {p}file_chunks_fts_ad",
    "DROP TRIGGER IF EXISTS {p}file_chunks_fts_ai",
    "DROP TABLE IF EXISTS {p}file_chunks_fts",
    "DROP VIEW IF EXISTS {p}file_chunks_fts_src",
]


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        adopt(TABLES, functions=FUNCTIONS)
        return
    _drop_fts("")
    adopt(TABLES)
    _create_fts(_prefix())


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        abandon(TABLES, functions=FUNCTIONS)
        return
    _drop_fts(_prefix())
    abandon(TABLES)
    _create_fts("")


def _prefix() -> str:
    return sqlite_prefix(op.get_context().config.attributes[SCHEMA_KEY])  # type: ignore[union-attr]


def _drop_fts(prefix: str) -> None:
    for statement in _FTS_DOWN:
        op.execute(statement.format(p=prefix))


def _create_fts(prefix: str) -> None:
    for statement in _FTS_UP:
        op.execute(statement.format(p=prefix, c=f"{prefix}file_chunks"))
