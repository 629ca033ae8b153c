"""The files family's search, and the re-embedding it needs after the embedder changes:
what apps and ``conveyor files search|reembed`` call (the ranking itself is the worker
side's, :mod:`tasks.files.search`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import select, update

from conveyor.platform import Platform
from pipelines.files.batches import check_owner
from tasks.files import flow
from tasks.files.models import READY, chunks, files

__all__ = ["RANKINGS", "Hit", "Ranking", "reembed", "search"]


@dataclass(frozen=True)
class Hit:
    """One search result."""

    file_id: str
    name: str
    ordinal: int
    score: float
    text: str


Ranking = Literal["default", "fused", "lexical", "vector"]
RANKINGS: tuple[Ranking, ...] = ("default", "fused", "lexical", "vector")


def search(
    platform: Platform, query: str, *, owner: str, limit: int = 5, ranking: Ranking = "default"
) -> list[Hit]:
    """The best of ``owner``'s ``ready`` files for ``query``, one hit per file (its best
    chunk), best first; never another user's file, never a cancelled, failed or unfinished one.

    ``ranking``: ``"lexical"`` (BM25 over any of the query's words), ``"vector"`` (the
    configured model's vectors: a chunk's cosine plus its file's), ``"fused"`` (both,
    weighted by how much of the query the best lexical file explains: see
    :mod:`tasks.files.search`), or ``"default"``: fused when the configured embedder is a
    model, lexical with feature hashing. Scores are the ranking's own: compare them only
    within one answer.

    Raises:
        ValueError: an empty query, ``limit < 1`` or an unknown ranking.
        TypeError: a query that is not a str, or a limit that is not an int.
        EmbeddingModelMismatch: a ranking that uses vectors, and some of the owner's were
            made by another model than the configured one (it names both:
            ``conveyor files reembed``).
    """
    from tasks.files import search as rank
    from tasks.files.embedding import is_semantic
    from tasks.files.stages import _embedder, _settings

    check_owner(owner)
    if not isinstance(query, str):
        raise TypeError(f"the query must be a str, not {type(query).__name__}")
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, not {type(limit).__name__}")
    # Databases refuse NUL and lone surrogates (a Latin-1 argv); neither is a word anyway.
    query = query.encode("utf-8", "replace").decode().replace("\x00", " ")
    if not query.strip():
        raise ValueError("the query is empty")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if ranking not in RANKINGS:
        raise ValueError(f"unknown ranking {ranking!r}; one of {', '.join(RANKINGS)}")
    embedder = _embedder(_settings().files.embedder)
    if ranking == "default":
        ranking = "fused" if is_semantic(embedder) else "lexical"
    ranked = rank.rank(platform.engine, owner, query, embedder, ranking, limit=limit)
    with platform.engine.connect() as conn:
        rows = {
            r.id: r
            for r in conn.execute(
                select(chunks.c.id, chunks.c.file_id, chunks.c.ordinal, chunks.c.text, files.c.name)
                .join(files, files.c.id == chunks.c.file_id)
                .where(chunks.c.id.in_([r.chunk_id for r in ranked]), files.c.owner == owner)
            )
        }
    return [
        Hit(row.file_id, row.name, row.ordinal, item.score, row.text)
        for item in ranked
        if (row := rows.get(item.chunk_id)) is not None
    ]


def reembed(platform: Platform, owner: str) -> int:
    """Re-embed every chunk of ``owner``'s ready files with the configured model, a file
    at a time (each in its own short transaction, vectors computed before it); returns
    how many chunks were written. A file with a chunk longer than the model reads (its
    token budget) is chunked again for it, in the same transaction."""
    from tasks.files.chunking import chunk_text, fit_chunks
    from tasks.files.embedding import TokenBudget, embed_packed
    from tasks.files.stages import EMBED_BATCH, _embedder, _settings

    settings = _settings().files
    embedder = _embedder(settings.embedder)
    with platform.engine.connect() as conn:
        file_ids = (
            conn.execute(select(files.c.id).where(files.c.owner == owner, files.c.status == READY))
            .scalars()
            .all()
        )
    written = 0
    for file_id in file_ids:
        with platform.engine.connect() as conn:
            texts = flow.chunk_texts(conn, file_id)
            text = conn.execute(select(files.c.text).where(files.c.id == file_id)).scalar_one()
        pieces = None
        if isinstance(embedder, TokenBudget):
            counts = embedder.count_tokens([t for _, t in texts])
            if any(n > embedder.max_tokens for n in counts):
                cut = chunk_text(text or "", max_tokens=settings.chunk_tokens, overlap=settings.chunk_overlap)
                pieces = fit_chunks(cut, embedder.count_tokens, embedder.max_tokens)
                texts = [(p.ordinal, p.text) for p in pieces]
        vectors = embed_packed(embedder, texts, batch=EMBED_BATCH)
        staged = retired = None
        if pieces is not None and platform.engine.dialect.name == "sqlite":  # see flow.stage_chunks
            staged = flow.staging_key("reembed", file_id, uuid.uuid4())
            with platform.engine.begin() as conn:  # killed half way, the reconciler drains it
                flow.claim_staging(conn, staged, file_id)
            flow.stage_chunks(platform.engine.begin, staged, owner, pieces)
        try:
            with platform.engine.begin() as conn:
                if pieces is not None:  # new rows: vectors go to their ids, by ordinal
                    if staged is None:
                        flow.replace_chunks(conn, file_id, owner, pieces)
                    else:
                        retired = flow.retire_chunks(conn, file_id)
                        flow.adopt_chunks(conn, staged, file_id)
                    ids = [chunk_id for chunk_id, _ in flow.chunk_texts(conn, file_id)]
                    vectors = [(ids[ordinal], vector) for ordinal, vector in vectors]
                    conn.execute(update(files).where(files.c.id == file_id).values(chunk_count=len(pieces)))
                flow.write_vectors(conn, file_id, owner, embedder.name, vectors)
        except BaseException:
            if staged is not None:
                flow.release_staging(platform.engine.begin, staged)
            raise
        if retired is not None:
            flow.release_staging(platform.engine.begin, retired)
        written += len(vectors)
    return written
