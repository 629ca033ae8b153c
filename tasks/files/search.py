"""Ranking a user's files (each by its best chunk): BM25 in the database, vectors in
numpy, and their fusion.

Words are plain on both databases: runs of word characters, case- and accent-folded, no
stemming and no stopwords (BM25's IDF already discounts common words; stemming cost
exact-word queries more than it won). Lexical ranking is BM25 (k1 = 1.2, b = 0.75) where
the index is:

* Postgres: ``file_chunks.tsv`` with a GIN index on ``(owner, tsv)`` that matches any of
  the query's words (ORed) *within the owner's chunks*. Term frequencies come from the
  matched chunk's tsvector cut down to the query's words before it is unnested; document
  frequency, chunk count and average length are the owner's (each user's corpus is its
  own collection).
* SQLite: FTS5 and its ``bm25()``; the owner is a token of its own column, so it is part
  of the match. FTS5 keeps one set of statistics per table, so there the IDF that ranks is
  computed over every user's chunks.

Vector ranking reads the owner's vectors from the database on every query (one
``file_vectors`` row per file) and scores each chunk by its own cosine plus its file's
(the mean of the file's chunk vectors): a question often matches what a document is about
better than any one passage of it.

:func:`blend` fuses the two with a weight the query itself decides: the share of the
query's information (its words' IDF) that the best lexical file contains. A query whose
words all occur in one file is a keyword query, and lexical ranking is trusted; a question
in other words than the document's leans on the vectors.
"""

from __future__ import annotations

import functools
import math
import re
import shlex
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import Connection, Engine, TextClause, func, select, text

from conveyor.store.db.namespace import schema_of, sqlite_prefix
from tasks.files.embedding import Embedder
from tasks.files.errors import EmbeddingModelMismatch
from tasks.files.models import READY, chunks, file_vectors, files

__all__ = [
    "CANDIDATES",
    "MAX_QUERY_WORDS",
    "Lexical",
    "Ranked",
    "Vector",
    "blend",
    "coverage",
    "lexical",
    "rank",
    "vector",
    "words",
]

CANDIDATES = 100  # files each ranking brings to the fusion
MAX_QUERY_WORDS = 64
_K1, _B = 1.2, 0.75
_WORD = re.compile(r"\w+")

_PG_BM25 = text(
    """
WITH q AS (
    SELECT array_agg(DISTINCT lexeme) AS lexemes,
           string_agg(DISTINCT '(' || plainto_tsquery('simple', lexeme)::text || ')', ' | ') AS any_of
    FROM unnest(tsvector_to_array(file_chunk_words(:query))) AS lexeme
),
stats AS (
    SELECT count(*) AS n, coalesce(avg(terms), 1)::float8 AS avgdl FROM file_chunks WHERE owner = :owner
),
hits AS MATERIALIZED (
    SELECT c.id, c.file_id, c.terms, u.lexeme, coalesce(array_length(u.positions, 1), 1) AS tf
    FROM q
    JOIN file_chunks c ON c.owner = :owner AND c.tsv @@ q.any_of::tsquery
        -- a user has few files that are not ready: a hashed list, not a lookup per chunk
        AND c.file_id NOT IN (SELECT id FROM files WHERE owner = :owner AND status <> :ready)
    CROSS JOIN LATERAL unnest(ts_filter(setweight(c.tsv, 'A', q.lexemes), '{a}')) AS u
),
idf AS (
    SELECT h.lexeme, ln(1 + (s.n - count(*) + 0.5) / (count(*) + 0.5)) AS w
    FROM hits h CROSS JOIN stats s GROUP BY h.lexeme, s.n
),
scored AS (
    SELECT h.id, h.file_id,
           sum(i.w * h.tf * (:k1 + 1) / (h.tf + :k1 * (1 - :b + :b * h.terms / s.avgdl))) AS score
    FROM hits h JOIN idf i USING (lexeme) CROSS JOIN stats s
    GROUP BY h.id, h.file_id
),
best AS (  -- each file by its best chunk
    SELECT DISTINCT ON (file_id) id, file_id, score FROM scored ORDER BY file_id, score DESC, id
)
SELECT id, file_id, score, (SELECT json_object_agg(lexeme, w) FROM idf) AS idf
FROM best
ORDER BY score DESC, id
LIMIT :limit
"""
)

# The FTS table must drive this join (with another order SQLite runs the MATCH once per
# joined row: minutes, not milliseconds); each file's best chunk is picked while reading.
# Names carry Conveyor's SQLite prefix (``p``), as the f004 migration made them.
_SQLITE_BM25 = """
SELECT c.id, c.file_id, -bm25({p}file_chunks_fts, 1.0, 0.0) AS score
FROM {p}file_chunks_fts
JOIN {p}file_chunks c ON c.id = {p}file_chunks_fts.rowid
JOIN {p}files f ON f.id = c.file_id
WHERE {p}file_chunks_fts MATCH :match AND c.owner = :owner AND f.status = :ready
ORDER BY bm25({p}file_chunks_fts, 1.0, 0.0), c.id
"""
_SQLITE_DF = "SELECT count(*) FROM {p}file_chunks_fts WHERE {p}file_chunks_fts MATCH :match"


@functools.lru_cache(maxsize=8)
def _sqlite_statements(prefix: str) -> tuple[TextClause, TextClause]:
    return text(_SQLITE_BM25.format(p=prefix)), text(_SQLITE_DF.format(p=prefix))


@dataclass(frozen=True)
class Ranked:
    """A file, by its best chunk, and its score in one ranking (higher is better)."""

    chunk_id: int
    file_id: str
    score: float


@dataclass(frozen=True)
class Lexical:
    """BM25's best chunks, and the IDF of each query word the owner's chunks contain."""

    ranked: list[Ranked]
    idf: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Vector:
    """The best chunks by vector score, and the median score over all the owner's chunks
    (where "unrelated" lies for this query and model)."""

    ranked: list[Ranked]
    median: float = 0.0


def words(value: str) -> list[str]:
    """The words of ``value`` as the index sees them: runs of word characters, case-folded
    and accent-folded ("Café" -> "cafe")."""
    decomposed = unicodedata.normalize("NFKD", value.casefold())
    return _WORD.findall("".join(ch for ch in decomposed if not unicodedata.combining(ch)))


def _fts_phrase(word: str) -> str:
    return '"' + word.replace('"', '""') + '"'


def _owner_token(owner: str) -> str:
    return _fts_phrase("o" + owner.encode().hex().upper())


def lexical(conn: Connection, owner: str, query: str, *, limit: int = CANDIDATES) -> Lexical:
    """The owner's ready files by BM25 for ``query`` (any of its words), each by its best
    chunk, best first; empty when none of its words occurs in them. Only the first
    ``MAX_QUERY_WORDS`` distinct words count (a pasted page is not a query)."""
    terms = list(dict.fromkeys(words(query)))[:MAX_QUERY_WORDS]
    if conn.dialect.name != "sqlite":
        query = " ".join(terms)
        params = {"query": query, "owner": owner, "ready": READY, "limit": limit, "k1": _K1, "b": _B}
        rows = conn.execute(_PG_BM25, params).all()
        idf = {str(k): float(v) for k, v in (rows[0].idf or {}).items()} if rows else {}
        return Lexical([Ranked(int(r.id), str(r.file_id), float(r.score)) for r in rows], idf)
    if not terms:
        return Lexical([])
    # Each word a quoted phrase, so nothing in a query is FTS5 syntax.
    match = f"okey : {_owner_token(owner)} AND text : ({' OR '.join(map(_fts_phrase, terms))})"
    bm25, df_of = _sqlite_statements(sqlite_prefix(schema_of(conn)))
    best: dict[str, Ranked] = {}
    for r in conn.execute(bm25, {"match": match, "owner": owner, "ready": READY}):
        if r.file_id not in best:
            best[r.file_id] = Ranked(int(r.id), str(r.file_id), float(r.score))
            if len(best) == limit:
                break
    if not best:
        return Lexical([])
    n = conn.execute(select(func.count()).where(chunks.c.owner == owner)).scalar_one()
    idf = {}
    for term in terms:
        df = conn.execute(
            df_of, {"match": f"okey : {_owner_token(owner)} AND text : {_fts_phrase(term)}"}
        ).scalar_one()
        if df:
            idf[term] = math.log(1 + (n - df + 0.5) / (df + 0.5))
    return Lexical(list(best.values()), idf)


def vector(
    conn: Connection, owner: str, query: Sequence[float], model: str, *, limit: int = CANDIDATES
) -> Vector:
    """The owner's ready files by their best chunk, best first; a chunk scores the cosine
    of its vector plus that of its file's mean vector to ``query`` (a ``model`` vector).

    Raises:
        EmbeddingModelMismatch: some of those files were embedded by another model.
    """
    rows = _stored_vectors(conn, owner)
    others = sorted({r[0] for r in rows if r[0] != model})
    if others:
        raise EmbeddingModelMismatch(
            f"{owner}'s chunks are embedded with {', '.join(map(repr, others))} but search embeds "
            f"queries with {model!r}: run `conveyor files reembed --user {shlex.quote(owner)}`"
        )
    if not rows:
        return Vector([])
    q = np.asarray(query, dtype=np.float32)
    ids = np.frombuffer(b"".join(r[2] for r in rows), dtype="<i8")
    matrix = np.frombuffer(b"".join(r[3] for r in rows), dtype="<f4")
    if matrix.size != ids.size * q.size:
        raise ValueError(f"{model} vectors do not have the query's {q.size} components")
    matrix = matrix.reshape(ids.size, q.size)
    counts = np.array([len(r[2]) // 8 for r in rows])
    file_of = np.repeat(np.arange(len(rows)), counts)
    gist = np.add.reduceat(matrix, np.concatenate(([0], np.cumsum(counts)[:-1])), axis=0)
    scores = _cosines(matrix, q) + _cosines(gist, q)[file_of]
    # Each file's best chunk: sorted by file, then score; the first of each file's run.
    order = np.lexsort((ids, -scores, file_of))
    firsts = order[np.flatnonzero(np.r_[True, np.diff(file_of[order]) != 0])]
    top = firsts[np.lexsort((ids[firsts], -scores[firsts]))][:limit]
    ranked = [Ranked(int(ids[i]), rows[file_of[i]][1], float(scores[i])) for i in top]
    return Vector(ranked, float(np.median(scores)))


_PG_VECTORS = (
    "SELECT v.model, v.file_id, v.chunk_ids, v.vectors FROM file_vectors v JOIN files f ON f.id = v.file_id"
    " WHERE v.owner = %(owner)s AND f.owner = %(owner)s AND f.status = %(ready)s"
)


def _stored_vectors(conn: Connection, owner: str) -> list[tuple[str, str, bytes, bytes]]:
    """``(model, file_id, chunk_ids, vectors)`` of the owner's ready files."""
    if conn.dialect.name == "postgresql":
        # Binary results: in text format every vector byte arrives as two hex digits to
        # decode, which cost more than the whole query for a user with 20k chunks.
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor(binary=True) as cursor:
            cursor.execute(_PG_VECTORS, {"owner": owner, "ready": READY})
            return [(str(m), str(f), bytes(i), bytes(v)) for m, f, i, v in cursor.fetchall()]
    rows = conn.execute(
        select(file_vectors.c.model, file_vectors.c.file_id, file_vectors.c.chunk_ids, file_vectors.c.vectors)
        .join(files, files.c.id == file_vectors.c.file_id)
        .where(file_vectors.c.owner == owner, files.c.owner == owner, files.c.status == READY)
    ).all()
    return [(str(r.model), str(r.file_id), bytes(r.chunk_ids), bytes(r.vectors)) for r in rows]


def _cosines(matrix: np.ndarray, q: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix)) * float(np.linalg.norm(q))
    out = np.zeros(len(matrix), dtype=np.float32)
    np.divide(matrix @ q, norms, out=out, where=norms > 0)
    return out


def coverage(conn: Connection, file_id: str, idf: dict[str, float]) -> float:
    """The share of the query's IDF mass (``idf``: its words) found in the file's chunks."""
    total = sum(idf.values())
    if total <= 0:
        return 0.0
    present: set[str] = set()
    for (chunk_text,) in conn.execute(select(chunks.c.text).where(chunks.c.file_id == file_id)):
        present.update(words(chunk_text))
    return sum(w for term, w in idf.items() if term in present) / total


# Lexical ranking runs in the database while vectors are scored here: in parallel, a
# query costs the slower of the two instead of their sum.
_LEXICAL_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="search-lexical")


def rank(
    engine: Engine, owner: str, query: str, embedder: Embedder, ranking: str, *, limit: int = CANDIDATES
) -> list[Ranked]:
    """The owner's best files for ``query`` by ``ranking`` ("lexical", "vector" or
    "fused"), each by its best chunk, best first; none for a query without a word.

    Raises:
        EmbeddingModelMismatch: a ranking with vectors, and some of the owner's files were
            embedded by another model than ``embedder``.
    """
    if not words(query):  # punctuation or symbols alone: nothing to look for
        return []
    candidates = max(limit, CANDIDATES) if ranking == "fused" else limit

    def run_lexical() -> Lexical:
        with engine.connect() as conn:
            return lexical(conn, owner, query, limit=candidates)

    if ranking == "lexical":
        return run_lexical().ranked
    pending = _LEXICAL_POOL.submit(run_lexical) if ranking == "fused" else None
    try:
        query_vector = embedder.embed([query])[0]
        with engine.connect() as conn:
            found = vector(conn, owner, query_vector, embedder.name, limit=candidates)
    finally:
        lexical_result = pending.result() if pending is not None else Lexical([])
    if ranking == "vector":
        return found.ranked
    weight = 0.0
    if lexical_result.ranked:
        with engine.connect() as conn:
            weight = coverage(conn, lexical_result.ranked[0].file_id, lexical_result.idf)
    return blend(lexical_result, found, weight)[:limit]


def blend(lexical: Lexical, vector: Vector, weight: float) -> list[Ranked]:
    """Fuse two rankings of files: ``weight * bm25 / best_bm25 + (1 - weight) * height``,
    ``height`` being the file's vector score above the median, over the best's (clipped
    at 0). Every score is then scaled by the query's confidence, ``weight + (1 - weight) *
    similarity`` (the best vector score, a cosine sum, halved and clipped to [0, 1]): the
    order stays, and a query that neither its words nor its meaning match scores low.
    A file shows its best lexical chunk, else its best vector chunk. Best first, ties by
    chunk id; scores under 0.001 are dropped."""
    chunk_of: dict[str, int] = {}
    scores: dict[str, float] = {}
    top_lexical = max((r.score for r in lexical.ranked), default=0.0)
    if top_lexical > 0:
        for r in lexical.ranked:
            chunk_of[r.file_id] = r.chunk_id
            scores[r.file_id] = weight * r.score / top_lexical
    best_vector = max((r.score for r in vector.ranked), default=vector.median)
    span = best_vector - vector.median
    if span > 0:
        for r in vector.ranked:
            chunk_of.setdefault(r.file_id, r.chunk_id)
            height = max(0.0, (r.score - vector.median) / span)
            scores[r.file_id] = scores.get(r.file_id, 0.0) + (1 - weight) * height
    confidence = weight + (1 - weight) * min(1.0, max(0.0, best_vector / 2))
    fused = [Ranked(chunk_of[f], f, s * confidence) for f, s in scores.items() if s * confidence >= 0.001]
    return sorted(fused, key=lambda r: (-r.score, r.chunk_id))
