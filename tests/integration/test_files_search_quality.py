"""Search quality on a fixed corpus of real documents (48 public-domain PEPs, see
``tests/data/search_corpus/README.md``), ingested through the real pipeline.

Two measures, both hit@1 (the top-ranked file is the answer):

* random-word queries (k = 2, 3, 5 words drawn from one document, fixed seed): the default
  ranking must stay within 2 points of a plain BM25 baseline computed here over the same
  chunks, or beat it;
* paraphrase questions (``questions.json``: each shares few words with its answer): the
  fused ranking must beat that BM25 by at least 10 points.

Every figure is printed as ``name=value`` and, when ``CONVEYOR_QUALITY_REPORT`` names a
file, appended to it.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from pipelines.files import Ranking, Upload, batch_status, process_batch, search
from tasks.files.models import chunks, files
from tests.integration.files_support import completed

pytestmark = pytest.mark.timeout(300)

CORPUS = Path(__file__).resolve().parent.parent / "data" / "search_corpus"
SEED = 20240611
QUERIES_PER_K = 100
WORD = re.compile(r"\w+")
RANKINGS: tuple[Ranking, ...] = ("lexical", "vector", "fused", "default")
# Words too common to count against a paraphrase (the overlap guard only).
_STOPWORDS_TEXT = """a about all an and any are as at be being but by can could do does don doesn for from get
    gets had has have how i if in into is isn it its like make me my not of on one or out over
    rather s should so some t than that the their them then there these this to two up use was
    way what when where which while who why will with without would you your"""
STOPWORDS = frozenset(_STOPWORDS_TEXT.split())


def _tokens(text: str) -> list[str]:
    return WORD.findall(text.lower())


class BM25:
    """Plain Okapi BM25 over chunks (lowercased ``\\w+`` tokens, no stemming, no stopwords;
    k1 = 1.5, b = 0.75, Lucene's idf); a file scores as its best chunk."""

    def __init__(self, chunk_rows: list[tuple[str, str]], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.names = [name for name, _ in chunk_rows]
        self.tfs = [Counter(_tokens(text)) for _, text in chunk_rows]
        self.lengths = [sum(tf.values()) for tf in self.tfs]
        self.avg = sum(self.lengths) / len(self.lengths)
        df: Counter[str] = Counter()
        for tf in self.tfs:
            df.update(tf.keys())
        n = len(self.tfs)
        self.idf = {t: math.log(1 + (n - d + 0.5) / (d + 0.5)) for t, d in df.items()}

    def top(self, query: str) -> str | None:
        """The name of the best file for ``query`` (None when no chunk matches)."""
        terms = _tokens(query)
        best: dict[str, float] = defaultdict(float)
        for name, tf, length in zip(self.names, self.tfs, self.lengths, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / self.avg)
            score = sum(self.idf[t] * tf[t] * (self.k1 + 1) / (tf[t] + norm) for t in terms if t in tf)
            if score > 0:
                best[name] = max(best[name], score)
        return max(best, key=lambda name: best[name]) if best else None


def _questions() -> list[dict[str, str]]:
    questions: list[dict[str, str]] = json.loads((CORPUS / "questions.json").read_text())
    return questions


def _documents() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(CORPUS.glob("pep-*.txt"))}


def _overlap(question: str, document: str) -> float:
    """The share of the question's content words found anywhere in the document."""
    words = [w for w in _tokens(question) if w not in STOPWORDS]
    vocabulary = set(_tokens(document))
    return sum(w in vocabulary for w in words) / len(words)


def _word_queries(documents: dict[str, str], k: int, rng: random.Random) -> list[tuple[str, str]]:
    """``QUERIES_PER_K`` queries of ``k`` words (3+ letters) drawn from one random document."""
    names = sorted(documents)
    queries = []
    for _ in range(QUERIES_PER_K):
        name = rng.choice(names)
        words = [w for w in _tokens(documents[name]) if len(w) >= 3]
        queries.append((" ".join(rng.choice(words) for _ in range(k)), name))
    return queries


def _report(figures: dict[str, float], backend: str) -> None:
    lines = [f"{name}={value:.2f}" for name, value in figures.items()]
    print(f"\nsearch quality ({backend}):\n" + "\n".join(lines))
    path = os.environ.get("CONVEYOR_QUALITY_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"# backend={backend}\n" + "\n".join(lines) + "\n")


def test_the_paraphrase_questions_stay_paraphrases() -> None:
    documents = _documents()
    questions = _questions()
    assert len(documents) >= 40 and len(questions) >= 20
    for q in questions:
        assert q["answer"] in documents, q
        assert _overlap(q["question"], documents[q["answer"]]) <= 0.5, q


def _ingest(platform: Any, owner: str, documents: dict[str, str]) -> list[tuple[str, str]]:
    """Every document through upload → extract → chunk → embed; returns (file name, chunk
    text) for every chunk of the owner's files."""
    uploads = [Upload(name, text.encode()) for name, text in documents.items()]
    batch_id = process_batch(platform, owner, uploads)
    batch = completed(platform, batch_id, timeout=240, interval=0.5)
    states = {f["name"]: f["status"] for f in batch_status(platform, batch_id)["files"]}
    assert batch["ready"] == len(documents) and set(states.values()) == {"ready"}, states
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(files.c.name, chunks.c.text)
            .join(files, files.c.id == chunks.c.file_id)
            .where(chunks.c.owner == owner, files.c.owner == owner)
            .order_by(files.c.name, chunks.c.ordinal)
        ).all()
    return [(r.name, r.text) for r in rows]


def _hit1(platform: Any, owner: str, queries: list[tuple[str, str]], ranking: Ranking) -> float:
    hits = 0
    for query, answer in queries:
        found = search(platform, query, owner=owner, limit=1, ranking=ranking)
        hits += bool(found) and found[0].name == answer
    return hits / len(queries)


def _bm25_hit1(bm25: BM25, queries: list[tuple[str, str]]) -> float:
    return sum(bm25.top(query) == answer for query, answer in queries) / len(queries)


def _check_quality(platform: Any, owner: str, backend: str) -> None:
    started = time.monotonic()
    documents = _documents()
    bm25 = BM25(_ingest(platform, owner, documents))
    ingested = time.monotonic() - started
    rng = random.Random(SEED)
    query_sets = {f"k{k}": _word_queries(documents, k, rng) for k in (2, 3, 5)}
    query_sets["paraphrase"] = [(q["question"], q["answer"]) for q in _questions()]
    figures: dict[str, float] = {}
    for label, queries in query_sets.items():
        for ranking in RANKINGS:
            figures[f"hit1_{label}_{ranking}"] = _hit1(platform, owner, queries, ranking)
        figures[f"hit1_{label}_bm25"] = _bm25_hit1(bm25, queries)
    figures["ingest_seconds"] = ingested
    figures["total_seconds"] = time.monotonic() - started
    _report(figures, backend)
    for k in (2, 3, 5):
        default, baseline = figures[f"hit1_k{k}_default"], figures[f"hit1_k{k}_bm25"]
        assert default >= baseline - 0.02, f"k={k}: default {default:.2f} < BM25 {baseline:.2f} - 0.02"
    fused, baseline = figures["hit1_paraphrase_fused"], figures["hit1_paraphrase_bm25"]
    assert fused >= baseline + 0.10, f"paraphrases: fused {fused:.2f} < BM25 {baseline:.2f} + 0.10"


def test_search_quality_against_bm25(platform: Any, worker: Any, tag: str) -> None:
    _check_quality(platform, tag, "postgres")


def test_search_quality_against_bm25_on_sqlite(on_sqlite: Any, worker: Any, tag: str) -> None:
    """The same on SQLite (FTS5's bm25(), IDF over the whole table: here, one user's)."""
    _check_quality(on_sqlite, tag, "sqlite")
