"""Search scopes by owner inside the index query, never after (issue #11, "Scale").

On a table of 50 users' chunks (50k chunks, analyzed), the statements search runs are
explained: on Postgres every read of ``file_chunks`` and ``file_vectors`` goes through an
index whose condition names the owner (no sequential scan, no owner filter applied after
the rows were read), and the query's words are matched by the GIN index on
``(owner, tsv)``. On SQLite the FTS5 table drives the lexical query, its MATCH carrying the
owner's token, and chunks are then looked up by rowid. Everything is inserted and analyzed
in one transaction that is rolled back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, text

from tasks.files import search as search_module
from tasks.files.models import READY

pytestmark = pytest.mark.timeout(120)

OWNERS = 50
FILES_PER_OWNER = 50
CHUNKS_PER_FILE = 20
VOCABULARY = [
    *("glacier", "moraine", "lighthouse", "orchid", "basalt", "caldera", "sourdough", "volcano"),
    *("beekeeper", "grandmaster", "fresnel", "velamen", "meltwater", "cirque", "erratic"),
    *("drumlin", "esker", "tarn", "col", "arete"),
]

FILL_FILES = """
INSERT INTO files (id, owner, name, size, content_ref, checksum, status, created_at, updated_at)
SELECT :tag || '-' || g, :tag || '-owner-' || (g % :owners), g || '.txt', 1, '-', '-', :ready, now(), now()
  FROM generate_series(1, :files) AS g
"""
# Ten words per chunk, drawn deterministically from the vocabulary plus a rare word each.
FILL_CHUNKS = """
INSERT INTO file_chunks (file_id, owner, ordinal, text)
SELECT f.id, f.owner, o,
       (SELECT string_agg(words[1 + ((o * 31 + w * 17 + hashtext(f.id)) & 1023) % cardinality(words)], ' ')
          FROM generate_series(1, 10) AS w, CAST(:words AS text[]) AS words) || ' rare' || o || hashtext(f.id)
  FROM files f, generate_series(0, :chunks - 1) AS o
 WHERE f.id LIKE :tag || '-%'
"""
FILL_VECTORS = """
INSERT INTO file_vectors (file_id, owner, model, chunk_ids, vectors)
SELECT id, owner, 'plan-model', '\\x00'::bytea, '\\x00'::bytea FROM files WHERE id LIKE :tag || '-%'
"""


@pytest.fixture
def filled(platform: Any, tag: str) -> Iterator[tuple[Connection, str]]:
    """A connection inside a transaction holding the rows and fresh statistics (rolled back)."""
    if platform.engine.dialect.name != "postgresql":
        pytest.skip("the platform's database is not Postgres")
    with platform.engine.connect() as conn:
        transaction = conn.begin()
        try:
            params = {"tag": tag, "owners": OWNERS, "ready": READY, "files": OWNERS * FILES_PER_OWNER}
            conn.execute(text(FILL_FILES), params)
            conn.execute(
                text(FILL_CHUNKS),
                {"tag": tag, "words": VOCABULARY, "chunks": CHUNKS_PER_FILE},
            )
            conn.execute(text(FILL_VECTORS), {"tag": tag})
            conn.exec_driver_sql("ANALYZE files, file_chunks, file_vectors")
            yield conn, f"{tag}-owner-7"
        finally:
            transaction.rollback()


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _explain(conn: Connection, statement: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    raw = conn.execute(text("EXPLAIN (FORMAT JSON) " + statement), params).scalar_one()
    plan = raw if isinstance(raw, list) else json.loads(raw)
    return list(_nodes(plan[0]["Plan"]))


def _reads_of(nodes: list[dict[str, Any]], table: str) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("Relation Name") == table]


def _owner_scoped(node: dict[str, Any]) -> bool:
    """``node`` (a read of a table) gets its rows from an index condition on the owner."""
    if node["Node Type"] in ("Index Scan", "Index Only Scan"):
        return "owner" in node.get("Index Cond", "")
    if node["Node Type"] == "Bitmap Heap Scan":
        below = [n for n in _nodes(node) if n["Node Type"] == "Bitmap Index Scan"]
        return bool(below) and all("owner" in n.get("Index Cond", "") for n in below)
    return False


def test_postgres_lexical_search_matches_words_and_owner_in_one_index_scan(
    filled: tuple[Connection, str],
) -> None:
    conn, owner = filled
    params = {"query": "glacier moraine", "owner": owner, "ready": READY, "limit": 100, "k1": 1.2, "b": 0.75}
    nodes = _explain(conn, search_module._PG_BM25.text, params)
    reads = _reads_of(nodes, "file_chunks")
    assert reads and all(_owner_scoped(n) for n in reads), [
        (n["Node Type"], n.get("Index Name"), n.get("Index Cond"), n.get("Filter")) for n in reads
    ]
    matched = [
        n
        for n in nodes
        if n["Node Type"] == "Bitmap Index Scan"
        and n.get("Index Name") == "ix_file_chunks_owner_tsv"
        and "owner" in n.get("Index Cond", "")
        and "@@" in n.get("Index Cond", "")
    ]
    assert matched, [(n["Node Type"], n.get("Index Name"), n.get("Index Cond")) for n in nodes]
    # and the results are the owner's, as the plan says
    found = search_module.lexical(conn, owner, "glacier moraine").ranked
    assert found
    owners = set(
        conn.execute(
            text("SELECT DISTINCT owner FROM file_chunks WHERE id = ANY(:ids)"),
            {"ids": [r.chunk_id for r in found]},
        ).scalars()
    )
    assert owners == {owner}


def test_postgres_vector_search_reads_only_the_owners_vectors_through_an_index(
    filled: tuple[Connection, str],
) -> None:
    conn, owner = filled
    statement = search_module._PG_VECTORS.replace("%(owner)s", ":owner").replace("%(ready)s", ":ready")
    nodes = _explain(conn, statement, {"owner": owner, "ready": READY})
    reads = _reads_of(nodes, "file_vectors")
    assert reads and all(_owner_scoped(n) for n in reads), [
        (n["Node Type"], n.get("Index Name"), n.get("Index Cond"), n.get("Filter")) for n in reads
    ]
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], [
        (n["Node Type"], n.get("Relation Name")) for n in nodes
    ]


def test_sqlite_lexical_search_is_driven_by_the_fts_match_that_carries_the_owner(
    on_sqlite: Any, tag: str
) -> None:
    from conveyor.store.db.namespace import schema_of, sqlite_prefix

    with on_sqlite.engine.connect() as conn:
        prefix = sqlite_prefix(schema_of(conn))
        bm25, _ = search_module._sqlite_statements(prefix)
        match = f'okey : {search_module._owner_token(tag)} AND text : ("glacier" OR "moraine")'
        rows = conn.execute(
            text("EXPLAIN QUERY PLAN " + bm25.text), {"match": match, "owner": tag, "ready": READY}
        ).all()
    details = [str(r[-1]) for r in rows]
    # the FTS table is read first, through its index (the MATCH, owner token included)
    first_scan = next(d for d in details if d.startswith(("SCAN", "SEARCH")))
    assert first_scan.startswith("SCAN") and "_fts VIRTUAL TABLE INDEX" in first_scan, details
    # chunks and files are then looked up by key, never scanned
    assert not [d for d in details if d.startswith("SCAN") and d is not first_scan], details
    assert any(d.startswith("SEARCH c USING INTEGER PRIMARY KEY") for d in details), details
