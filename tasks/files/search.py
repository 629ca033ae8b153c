"""Ranking a user's chunks: BM25 in the database, vectors in numpy, and their fusion.

Words are plain on both databases: runs of word characters, case-folded, no stemming and
no stopwords (BM25's IDF already discounts common words; stemming cost exact-word queries
more than it won). Lexical ranking is BM25 (k1 = 1.2, b = 0.75) where the index is:

* Postgres: ``file_chunks.tsv`` with a GIN index on ``(owner, tsv)`` that matches any of
  the query's words (ORed) *within the owner's chunks*. Term frequencies come from the
  matched chunk's tsvector cut down to the query's words before it is unnested; document
  frequency, chunk count and average length are the owner's (each user's corpus is its
  own collection).
* SQLite: FTS5 and its ``bm25()``; the owner is a token of its own column, so it is part
  of the match. FTS5 keeps one set of statistics per table, so there the IDF that ranks is
  computed over every user's chunks.

Vector ranking reads the owner's vectors of the query's model from the database on every
query and scores each chunk by its own cosine plus its file's (the mean of the file's
chunk vectors): a question often matches what a document is about better than any one
passage of it.

:func:`blend` fuses the two with a weight the query itself decides: the share of the
query's information (its words' IDF) that the best lexical file contains. A query whose
words all occur in one file is a keyword query, and lexical ranking is trusted; a question
in other words than the document's leans on the vectors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import Connection, func, select, text

from tasks.files.models import READY, chunks

__all__ = ["CANDIDATES", "Lexical", "Ranked", "Vector", "blend", "coverage", "lexical", "vector", "words"]

CANDIDATES = 100  # chunks each ranking brings to the fusion
_K1, _B = 1.2, 0.75
_WORD = re.compile(r"\w+")

_PG_BM25 = text(
    """
WITH q AS (
    SELECT array_agg(DISTINCT lexeme) AS lexemes,
           string_agg(DISTINCT '(' || plainto_tsquery('simple', lexeme)::text || ')', ' | ') AS any_of
    FROM unnest(tsvector_to_array(to_tsvector('simple'::regconfig, regexp_replace(:query, '\\W+', ' ', 'g'))))
         AS lexeme
),
stats AS (
    SELECT count(*) AS n, coalesce(avg(terms), 1)::float8 AS avgdl FROM file_chunks WHERE owner = :owner
),
hits AS MATERIALIZED (
    SELECT c.id, c.terms, u.lexeme, coalesce(array_length(u.positions, 1), 1) AS tf
    FROM q
    JOIN file_chunks c ON c.owner = :owner AND c.tsv @@ q.any_of::tsquery
    JOIN files f ON f.id = c.file_id AND f.status = :ready
    CROSS JOIN LATERAL unnest(ts_filter(setweight(c.tsv, 'A', q.lexemes), '{a}')) AS u
),
idf AS (
    SELECT h.lexeme, ln(1 + (s.n - count(*) + 0.5) / (count(*) + 0.5)) AS w
    FROM hits h CROSS JOIN stats s GROUP BY h.lexeme, s.n
)
SELECT h.id, sum(i.w * h.tf * (:k1 + 1) / (h.tf + :k1 * (1 - :b + :b * h.terms / s.avgdl))) AS score,
       (SELECT json_object_agg(lexeme, w) FROM idf) AS idf
FROM hits h JOIN idf i USING (lexeme) CROSS JOIN stats s
GROUP BY h.id
ORDER BY score DESC, h.id
LIMIT :limit
"""
)

_SQLITE_BM25 = text(
    """
SELECT c.id, -bm25(file_chunks_fts, 1.0, 0.0) AS score
FROM file_chunks_fts
JOIN file_chunks c ON c.id = file_chunks_fts.rowid
JOIN files f ON f.id = c.file_id
WHERE file_chunks_fts MATCH :match AND c.owner = :owner AND f.status = :ready
ORDER BY bm25(file_chunks_fts, 1.0, 0.0), c.id
LIMIT :limit
"""
)
_SQLITE_DF = text("SELECT count(*) FROM file_chunks_fts WHERE file_chunks_fts MATCH :match")


@dataclass(frozen=True)
class Ranked:
    """A chunk and its score in one ranking (higher is better)."""

    chunk_id: int
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
    """The words of ``value`` as the index sees them: runs of word characters, case-folded."""
    return _WORD.findall(value.casefold())


def _fts_phrase(word: str) -> str:
    return '"' + word.replace('"', '""') + '"'


def _owner_token(owner: str) -> str:
    return _fts_phrase("o" + owner.encode().hex().upper())


def lexical(conn: Connection, owner: str, query: str, *, limit: int = CANDIDATES) -> Lexical:
    """The owner's ready chunks by BM25 for ``query`` (any of its words), best first;
    empty when none of its words occurs in them."""
    if conn.dialect.name != "sqlite":
        params = {"query": query, "owner": owner, "ready": READY, "limit": limit, "k1": _K1, "b": _B}
        rows = conn.execute(_PG_BM25, params).all()
        idf = {str(k): float(v) for k, v in (rows[0].idf or {}).items()} if rows else {}
        return Lexical([Ranked(int(r.id), float(r.score)) for r in rows], idf)
    terms = sorted(set(words(query)))
    if not terms:
        return Lexical([])
    # Each word a quoted phrase, so nothing in a query is FTS5 syntax.
    match = f"okey : {_owner_token(owner)} AND text : ({' OR '.join(map(_fts_phrase, terms))})"
    params = {"match": match, "owner": owner, "ready": READY, "limit": limit}
    rows = conn.execute(_SQLITE_BM25, params).all()
    if not rows:
        return Lexical([])
    n = conn.execute(select(func.count()).where(chunks.c.owner == owner)).scalar_one()
    idf = {}
    for term in terms:
        df = conn.execute(
            _SQLITE_DF, {"match": f"okey : {_owner_token(owner)} AND text : {_fts_phrase(term)}"}
        ).scalar_one()
        if df:
            idf[term] = math.log(1 + (n - df + 0.5) / (df + 0.5))
    return Lexical([Ranked(int(r.id), float(r.score)) for r in rows], idf)


def vector(
    conn: Connection, owner: str, query: Sequence[float], model: str, *, limit: int = CANDIDATES
) -> Vector:
    """The owner's ready chunks embedded by ``model``, best first, each scored by the
    cosine of its vector and of its file's mean vector to ``query`` (a ``model`` vector)."""
    rows = conn.execute(
        text(
            "SELECT c.id, c.file_id, c.embedding FROM file_chunks c JOIN files f ON f.id = c.file_id"
            " WHERE c.owner = :owner AND c.model = :model AND c.embedding IS NOT NULL"
            " AND f.status = :ready"
        ),
        {"owner": owner, "model": model, "ready": READY},
    ).all()
    if not rows:
        return Vector([])
    q = np.asarray(query, dtype=np.float32)
    matrix = np.frombuffer(b"".join(bytes(r.embedding) for r in rows), dtype="<f4").reshape(len(rows), -1)
    if matrix.shape[1] != q.shape[0]:
        raise ValueError(f"{model} vectors have {matrix.shape[1]} components, the query {q.shape[0]}")
    _, file_of = np.unique([r.file_id for r in rows], return_inverse=True)
    gist = np.zeros((int(file_of.max()) + 1, matrix.shape[1]), dtype=np.float32)
    np.add.at(gist, file_of, matrix)
    scores = _cosines(matrix, q) + _cosines(gist, q)[file_of]
    top = np.argsort(-scores, kind="stable")[:limit]
    return Vector([Ranked(int(rows[i].id), float(scores[i])) for i in top], float(np.median(scores)))


def _cosines(matrix: np.ndarray, q: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(matrix, axis=1) * float(np.linalg.norm(q))
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


def blend(lexical: Lexical, vector: Vector, weight: float) -> list[Ranked]:
    """Fuse the two rankings: ``weight * bm25 / best_bm25 + (1 - weight) * height``, where
    ``height`` is the vector score's height above the median over the best's (clipped at
    0); best first, ties by chunk id."""
    scores: dict[int, float] = {}
    top_lexical = max((r.score for r in lexical.ranked), default=0.0)
    if top_lexical > 0:
        for r in lexical.ranked:
            scores[r.chunk_id] = weight * r.score / top_lexical
    span = max((r.score for r in vector.ranked), default=vector.median) - vector.median
    if span > 0:
        for r in vector.ranked:
            height = max(0.0, (r.score - vector.median) / span)
            scores[r.chunk_id] = scores.get(r.chunk_id, 0.0) + (1 - weight) * height
    return [Ranked(c, s) for c, s in sorted(scores.items(), key=lambda cs: (-cs[1], cs[0])) if s > 0]
