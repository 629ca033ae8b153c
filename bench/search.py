"""Search latency: :func:`pipelines.files.search` over 100k chunks, on Postgres and on SQLite,
against the search it replaced (every chunk of the user scored in Python) in the same run.

**Population.** Both databases get the same rows, written in one pass: a scratch Postgres
database (``--database``, dropped and created, migrated with ``config.migrations.upgrade``,
dropped at the end) and a throwaway SQLite file in a temporary home (the embedded store's
engine, :func:`conveyor.store.db.engine.make_engine`; deleted at the end). ``--chunks`` chunks
(100,000): one heavy user holds ``--heavy`` of them (20,000), 49 light users share the rest
evenly (1,632 or 1,633 each), in files of 20 chunks (a user's last file may be shorter),
every file ``ready``. The files of all users are inserted in one shuffled order, so a
user's rows are spread over the table as after months of uploads.

The text is synthetic and deterministic (``--seed``): chunks of 150-200 words in sentences
of 6-20 words, words drawn Zipf-like (weight 1/rank) from a vocabulary of 20,000 words:
155 common English words first (so stopwords are as frequent as in real prose), then
the words of ``tests/data/search_corpus`` (Python PEPs) by their frequency there, then
pronounceable pseudo-words to fill it up. Each chunk is embedded with the configured
embedder (``CONVEYOR_FILES``' ``embedder``, :func:`tasks.files.embedding.load_embedder`)
through :func:`tasks.files.embedding.embed_packed`, as the embed stage does, in a pool of
one spawned process per core while the previous window of files is being inserted; its
``model`` is the embedder's name. Rows go in with SQLAlchemy Core ``executemany`` inserts of
1,000 rows into ``files``, ``file_chunks`` (ids given by the bench) and ``file_vectors``
(one row per file, as the embed stage writes it); the lexical index (migration ``f003``:
generated ``tsvector`` + GIN on Postgres, FTS5 kept by triggers on SQLite) maintains itself
on insert. Then Postgres gets ``VACUUM ANALYZE`` of both tables (what autovacuum does after
that many inserts); SQLite gets nothing (the application never runs ``ANALYZE``).
``populate_s`` is the wall time of the whole population (generation, embedding, both
databases' inserts, the vacuum); stderr breaks it down.

**Measurement**, in a fresh ``python -m bench.search --measure`` process per database
(``CONVEYOR_DATABASE_URL`` pointing at it, no Redis configured or used), through the
deployment's own platform (``config.celery_app``) and so with its engine settings. Queries
are 2-5 words drawn uniformly from vocabulary ranks 100-3000 (words found in roughly 0.5%
to 15% of chunks), a quarter of them with one common word added; the same queries on both
databases. ``search(platform, query, owner=..., limit=5)`` is timed per call with
:func:`time.perf_counter_ns` (embedding the query included), for the heavy user and for
the light users (one query each, in turn), for the default ranking and, when the function
takes ``ranking``, for ``"lexical"`` and ``"vector"`` alone. Each series has 5 untimed
warm-up queries first. Every hit is checked to be the asking user's (outside the timing).
Nothing is cached between queries by the bench: the process is new, the database's own
caches (Postgres shared buffers, the OS page cache) are warm from the population.

**Baseline**: the search as it was before the lexical index (commit c9ebba3), copied in
:func:`naive_search`: read all the user's vectors (and texts) and score each with
:func:`tasks.files.embedding.cosine` in Python. It is slow, so it runs only
``--naive-queries`` queries (10; p95 of 10 samples is their maximum), the first ones of
the same list, after one warm-up.

Usage::

    .venv/bin/python -m bench.search                 # 100k chunks, 100 queries per series
    .venv/bin/python bench/search.py --smoke         # CI: 5k chunks (heavy 1k), 20 queries
    .venv/bin/python -m bench.search --keep          # keep both databases (for EXPLAIN)
    .venv/bin/python -m bench.search --reuse --sqlite-dir DIR   # measure a kept population

Progress goes to stderr; the last lines on stdout are ``name=value`` pairs, per database
``pg``/``sqlite`` and user ``heavy``/``light``: ``search_p95_ms_{db}_{user}`` (the goal
on Postgres: ≤ 200 ms heavy, ≤ 50 ms light), ``search_p50_ms_{db}_{user}``,
``search_p95_ms_{db}_{user}_lexical`` and ``..._vector`` (when rankings exist),
``naive_search_p95_ms_{db}_{user}``, ``naive_search_p50_ms_{db}_{user}``, then ``chunks``,
``heavy_chunks``, ``light_users``, ``files``, ``queries``, ``naive_queries``,
``populate_s``, ``vocabulary_words``, ``embedder``. Percentiles are nearest-rank.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import inspect
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import DEFAULT_PG, ROOT, BenchError, log, recreate_database

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from conveyor.platform import Platform
    from pipelines.files import Hit
    from tasks.files.embedding import Embedder

DATABASE = "conveyor_bench_search"
SEED = 2025
LIGHT_USERS = 49
HEAVY_OWNER = "bench-heavy"
CHUNKS_PER_FILE = 20
WORDS_PER_CHUNK = (150, 200)
SENTENCE_WORDS = (6, 20)
VOCABULARY = 20_000
QUERY_BAND = (100, 3000)  # vocabulary ranks (0-based) query words come from
QUERY_WORDS = (2, 5)
COMMON_SHARE = 0.25  # share of queries that also carry one common word
INSERT_BATCH = 1000
WINDOW_FILES = 100  # files generated and embedded while the previous window is inserted
WARMUP = 5
NAIVE_WARMUP = 1
LIMIT = 5
RANKINGS = ("lexical", "vector")  # measured alone when search() takes ``ranking``
KINDS = ("heavy", "light")
DBS = ("pg", "sqlite")
GOALS_MS = {("pg", "heavy"): 200.0, ("pg", "light"): 50.0}
CORPUS = ROOT / "tests" / "data" / "search_corpus"
BASE_TIME = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)

# The most frequent English words, most frequent first: the head of the Zipf ranking.
COMMON_WORDS = """
the of and to a in is you that it he was for on are as with his they at be this have from
or one had by word but not what all were we when your can said there use an each which she
do how their if will up other about out many then them these so some her would make like
him into time has look two more write go see number no way could people my than first water
been call who oil its now find long down day did get come made may part over new sound take
only little work know place year live me back give most very after thing our just name good
sentence man think say great where help through much before line right too mean old any same
tell boy follow came want show also around form three small set put end does another well
"""
ONSETS = (*"bcdfghklmnprstvz", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io")
CODAS = ("", "", "", "n", "r", "s", "l", "t", "nd", "st", "rk")


@dataclass(frozen=True)
class Scale:
    """How much data and how many queries."""

    chunks: int
    heavy: int
    queries: int
    naive_queries: int


FULL = Scale(chunks=100_000, heavy=20_000, queries=100, naive_queries=10)
SMOKE = Scale(chunks=5_000, heavy=1_000, queries=20, naive_queries=3)


def light_owner(i: int) -> str:
    """The ``i``-th light user."""
    return f"bench-light-{i:02d}"


def percentile_ms(samples_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..1) of nanosecond samples, in milliseconds."""
    ordered = sorted(samples_ns)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1] / 1e6


# -- the synthetic corpus ------------------------------------------------------------------


def build_vocabulary(seed: int, size: int = VOCABULARY) -> tuple[list[str], str]:
    """``size`` distinct words, most frequent first, and where they came from."""
    words = list(dict.fromkeys(COMMON_WORDS.split()))
    sources = [f"{len(words)} common words"]
    seen = set(words)
    if CORPUS.is_dir():
        counts: Counter[str] = Counter()
        for path in sorted(CORPUS.glob("*.txt")):
            counts.update(
                re.findall(r"[a-z]{3,}", path.read_text(encoding="utf-8", errors="replace").lower())
            )
        ranked = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if w not in seen]
        ranked = ranked[: size - len(words)]
        words += ranked
        seen.update(ranked)
        sources.append(f"{len(ranked)} words of {CORPUS.relative_to(ROOT)}")
    rng = random.Random(f"{seed}:vocabulary")
    pseudo = 0
    while len(words) < size:
        syllables = rng.randint(2, 3)
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)
        if word not in seen:
            seen.add(word)
            words.append(word)
            pseudo += 1
    if pseudo:
        sources.append(f"{pseudo} pseudo-words")
    return words[:size], ", ".join(sources)


def zipf_cum_weights(n: int) -> list[float]:
    """Cumulative weights 1/rank for ranks 1..n (for :meth:`random.Random.choices`)."""
    return list(itertools.accumulate(1.0 / r for r in range(1, n + 1)))


def make_chunk(rng: random.Random, vocabulary: Sequence[str], cum_weights: Sequence[float]) -> str:
    """One chunk: 150-200 Zipf-drawn words in capitalized sentences."""
    words = rng.choices(vocabulary, cum_weights=cum_weights, k=rng.randint(*WORDS_PER_CHUNK))
    sentences = []
    start = 0
    while start < len(words):
        end = start + rng.randint(*SENTENCE_WORDS)
        sentence = words[start:end]
        sentences.append(" ".join([sentence[0].capitalize(), *sentence[1:]]) + ".")
        start = end
    return " ".join(sentences)


@dataclass(frozen=True)
class FileSpec:
    """One file to write: its place in the insertion order (which seeds its text), owner, size."""

    index: int
    owner: str
    chunks: int


def plan(scale: Scale, seed: int) -> list[FileSpec]:
    """Every file of the population, in the (shuffled) order they are inserted."""

    def split(owner: str, n: int) -> list[tuple[str, int]]:
        full, rest = divmod(n, CHUNKS_PER_FILE)
        return [(owner, CHUNKS_PER_FILE)] * full + ([(owner, rest)] if rest else [])

    sizes = split(HEAVY_OWNER, scale.heavy)
    per_user, extra = divmod(scale.chunks - scale.heavy, LIGHT_USERS)
    for i in range(LIGHT_USERS):
        sizes += split(light_owner(i), per_user + (1 if i < extra else 0))
    random.Random(f"{seed}:order").shuffle(sizes)
    return [FileSpec(i, owner, n) for i, (owner, n) in enumerate(sizes)]


@dataclass
class MadeFile:
    """A generated file: its row and its chunks' texts and packed vectors."""

    row: dict[str, Any]
    texts: list[str]
    vectors: list[bytes]


@dataclass
class _Maker:
    """Per-process state of the generating/embedding pool."""

    seed: int
    vocabulary: list[str]
    cum_weights: list[float]
    embedder: Embedder


_maker: _Maker | None = None


def _init_maker(seed: int, vocabulary: list[str], embedder_name: str) -> None:
    from tasks.files.embedding import load_embedder

    global _maker
    _maker = _Maker(seed, vocabulary, zipf_cum_weights(len(vocabulary)), load_embedder(embedder_name))


def make_file(spec: FileSpec) -> MadeFile:
    """Generate one file's text (seeded by its index) and embed its chunks (pool worker)."""
    from tasks.files.embedding import embed_packed

    if _maker is None:
        raise BenchError("the generating process was not initialized")
    rng = random.Random(f"{_maker.seed}:file:{spec.index}")
    texts = [make_chunk(rng, _maker.vocabulary, _maker.cum_weights) for _ in range(spec.chunks)]
    vectors = [v for _, v in embed_packed(_maker.embedder, list(enumerate(texts)))]
    text = "\n\n".join(texts)
    data = text.encode()
    at = BASE_TIME + dt.timedelta(seconds=spec.index)
    row = {
        "id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        "owner": spec.owner,
        "batch_id": None,
        "name": f"notes-{spec.index:06d}.txt",
        "size": len(data),
        "content_ref": f"bench://search/{spec.owner}/{spec.index}",  # never read
        "checksum": hashlib.sha256(data).hexdigest(),
        "mime": "text/plain",
        "encoding": "utf-8",
        "status": "ready",
        "pages": None,
        "text": text,
        "chunk_count": spec.chunks,
        "error_type": None,
        "error": None,
        "failed_stage": None,
        "created_at": at,
        "updated_at": at,
    }
    return MadeFile(row, texts, vectors)


# -- population --------------------------------------------------------------------------


@dataclass
class Target:
    """One database being populated."""

    db: str
    url: str
    engine: Engine
    insert_s: float = 0.0
    next_chunk_id: int = 1  # ids given here, so each file's vectors row can name its chunks


@dataclass
class Population:
    """What :func:`populate` did, for the report."""

    seconds: float
    files: int
    chunks: int
    wait_s: float = 0.0
    inserts: dict[str, float] = field(default_factory=dict)
    vacuum_s: float = 0.0


def write(target: Target, made: Sequence[MadeFile], model: str) -> None:
    """Insert one window of files, their chunks and their vectors rows (as the embed stage
    writes them: one per file), ``INSERT_BATCH`` rows per statement."""
    from sqlalchemy import insert

    from tasks.files.embedding import pack_ids
    from tasks.files.models import chunks, file_vectors, files

    start = time.perf_counter()
    file_rows = [m.row for m in made]
    chunk_rows: list[dict[str, Any]] = []
    vector_rows: list[dict[str, Any]] = []
    for m in made:
        ids = list(range(target.next_chunk_id, target.next_chunk_id + len(m.texts)))
        target.next_chunk_id += len(m.texts)
        owner = m.row["owner"]
        chunk_rows.extend(
            {"id": i, "file_id": m.row["id"], "owner": owner, "ordinal": n, "text": text}
            for n, (i, text) in enumerate(zip(ids, m.texts, strict=True))
        )
        vector_rows.append(
            {
                "file_id": m.row["id"],
                "owner": owner,
                "model": model,
                "chunk_ids": pack_ids(ids),
                "vectors": b"".join(m.vectors),
            }
        )
    # One transaction per statement: a long one would hold SQLite's single writer lock.
    for table, rows in ((files, file_rows), (chunks, chunk_rows), (file_vectors, vector_rows)):
        for i in range(0, len(rows), INSERT_BATCH):
            with target.engine.begin() as conn:
                conn.execute(insert(table), rows[i : i + INSERT_BATCH])
    target.insert_s += time.perf_counter() - start


def populate(
    targets: Sequence[Target], specs: Sequence[FileSpec], vocabulary: list[str], embedder: Embedder, seed: int
) -> Population:
    """Generate, embed and insert every file into every target; then vacuum Postgres."""
    start = time.perf_counter()
    windows = [specs[i : i + WINDOW_FILES] for i in range(0, len(specs), WINDOW_FILES)]
    workers = max(1, os.cpu_count() or 1)
    population = Population(0.0, len(specs), sum(s.chunks for s in specs))
    done = 0
    ctx = multiprocessing.get_context("spawn")
    with (
        ctx.Pool(workers, initializer=_init_maker, initargs=(seed, vocabulary, embedder.name)) as pool,
        ThreadPoolExecutor(len(targets), thread_name_prefix="bench-insert") as writers,
    ):
        pending = pool.map_async(make_file, windows[0], chunksize=4)
        for k in range(len(windows)):
            waited = time.perf_counter()
            made = pending.get()
            population.wait_s += time.perf_counter() - waited
            if k + 1 < len(windows):
                pending = pool.map_async(make_file, windows[k + 1], chunksize=4)
            # Both databases at once (their drivers release the GIL while the database works).
            for future in [writers.submit(write, target, made, embedder.name) for target in targets]:
                future.result()
            done += sum(len(m.texts) for m in made)
            if k % 10 == 9 or k + 1 == len(windows):
                log(f"  {done}/{population.chunks} chunks written ({time.perf_counter() - start:.0f}s)")
    vacuum = time.perf_counter()
    for target in targets:
        if target.engine.dialect.name == "postgresql":
            with target.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                # The ids were given by the bench: the sequence must not hand them out again.
                conn.exec_driver_sql(
                    "SELECT setval(pg_get_serial_sequence('file_chunks', 'id'),"
                    " (SELECT max(id) FROM file_chunks))"
                )
                conn.exec_driver_sql("VACUUM ANALYZE files, file_chunks, file_vectors")
    population.vacuum_s = time.perf_counter() - vacuum
    population.inserts = {t.db: t.insert_s for t in targets}
    population.seconds = time.perf_counter() - start
    return population


def count_chunks(engine: Engine) -> int:
    """Rows in ``file_chunks`` (to check a reused population)."""
    from sqlalchemy import func, select

    from tasks.files.models import chunks

    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(chunks)).scalar_one())


def stored_models(engine: Engine) -> list[str]:
    """The models of the stored vectors (to check a reused population)."""
    from sqlalchemy import select

    from tasks.files.models import file_vectors

    with engine.connect() as conn:
        return sorted(str(m) for m in conn.execute(select(file_vectors.c.model).distinct()).scalars())


def make_queries(vocabulary: Sequence[str], n: int, seed: int) -> list[str]:
    """``n`` queries of 2-5 mid-frequency words, a quarter with one common word."""
    rng = random.Random(f"{seed}:queries")
    band = vocabulary[QUERY_BAND[0] : QUERY_BAND[1]]
    common = vocabulary[: QUERY_BAND[0]]
    queries = []
    for _ in range(n):
        words = rng.sample(band, rng.randint(*QUERY_WORDS))
        if rng.random() < COMMON_SHARE:
            words.insert(rng.randrange(len(words) + 1), rng.choice(common))
        queries.append(" ".join(words))
    return queries


# -- measurement (in a fresh process per database) ---------------------------------------


def naive_search(platform: Platform, query: str, *, owner: str, limit: int = LIMIT) -> list[Hit]:
    """The search before the lexical index (commit c9ebba3), on today's tables: every vector
    of the user's ready files read, unpacked and scored in Python (cosine); one hit per
    file, best first."""
    import struct

    from sqlalchemy import select

    from pipelines.files import Hit
    from tasks.files.embedding import cosine, unpack
    from tasks.files.errors import EmbeddingModelMismatch
    from tasks.files.models import READY, chunks, file_vectors, files
    from tasks.files.stages import _embedder, _settings

    embedder = _embedder(_settings().files.embedder)
    with platform.engine.connect() as conn:
        stored = conn.execute(
            select(file_vectors, files.c.name)
            .join(files, files.c.id == file_vectors.c.file_id)
            .where(file_vectors.c.owner == owner, files.c.owner == owner, files.c.status == READY)
        ).all()
        if any(r.model != embedder.name for r in stored):
            raise EmbeddingModelMismatch(f"{owner}'s chunks are not all embedded with {embedder.name!r}")
        texts = dict(
            conn.execute(
                select(chunks.c.id, chunks.c.text).where(chunks.c.file_id.in_([r.file_id for r in stored]))
            ).all()
        )
    vector = embedder.embed([query])[0]
    scored = []
    for r in stored:
        ids = struct.unpack(f"<{len(r.chunk_ids) // 8}q", r.chunk_ids)
        width = len(r.vectors) // len(ids)
        for n, chunk_id in enumerate(ids):
            v = unpack(r.vectors[n * width : (n + 1) * width])
            scored.append(Hit(r.file_id, r.name, n, cosine(vector, v), texts[chunk_id]))
    scored.sort(key=lambda h: h.score, reverse=True)
    best: dict[str, Hit] = {}
    for hit in scored:
        best.setdefault(hit.file_id, hit)
    return list(best.values())[: max(0, limit)]


SearchFn = Callable[[str, str], "list[Hit]"]


def run_series(
    fn: SearchFn,
    queries: Sequence[str],
    owners: Sequence[str],
    warmup: Sequence[str],
    owned: dict[str, set[str]],
) -> tuple[list[int], int]:
    """Warm up, then time ``fn`` once per query (owners in turn); nanoseconds and misses."""
    for i, query in enumerate(warmup):
        fn(query, owners[i % len(owners)])
    samples: list[int] = []
    empty = 0
    for i, query in enumerate(queries):
        owner = owners[i % len(owners)]
        start = time.perf_counter_ns()
        hits = fn(query, owner)
        samples.append(time.perf_counter_ns() - start)
        empty += not hits
        strangers = {h.file_id for h in hits} - owned[owner]
        if strangers or len(hits) > LIMIT:
            raise BenchError(f"search for {owner} returned {len(hits)} hits, other users' files: {strangers}")
    return samples, empty


def measure(spec_path: Path) -> dict[str, Any]:
    """Run every series against the database of ``CONVEYOR_DATABASE_URL`` (child process)."""
    from sqlalchemy import select

    from config.celery_app import platform
    from tasks.files.models import files

    platform.app.loader.import_default_modules()
    from pipelines.files import search
    from tasks.files.stages import _embedder, _settings

    spec = json.loads(spec_path.read_text())
    configured = _embedder(_settings().files.embedder).name
    if configured != spec["embedder"]:
        raise BenchError(f"the vectors are {spec['embedder']}'s but this process embeds with {configured}")
    queries: list[str] = spec["queries"]
    warmup: list[str] = spec["warmup"]
    owners = {"heavy": [HEAVY_OWNER], "light": [light_owner(i) for i in range(LIGHT_USERS)]}
    owned: dict[str, set[str]] = {}
    with platform.engine.connect() as conn:
        for fid, owner in conn.execute(select(files.c.id, files.c.owner)):
            owned.setdefault(owner, set()).add(fid)
    rankings = ["default"]
    if "ranking" in inspect.signature(search).parameters:
        rankings += RANKINGS
    else:
        log("  search() takes no ranking: measuring the default only")

    def searcher(ranking: str) -> SearchFn:
        if ranking == "default":
            return lambda q, o: search(platform, q, owner=o, limit=LIMIT)
        chosen: dict[str, Any] = {"ranking": ranking}
        return lambda q, o: search(platform, q, owner=o, limit=LIMIT, **chosen)

    out: dict[str, Any] = {"samples": {}, "empty": {}}
    for kind in KINDS:
        series: list[tuple[str, SearchFn, Sequence[str], Sequence[str]]] = [
            (r, searcher(r), queries, warmup) for r in rankings
        ]
        series.append(
            (
                "naive",
                lambda q, o: naive_search(platform, q, owner=o, limit=LIMIT),
                queries[: spec["naive_queries"]],
                warmup[:NAIVE_WARMUP],
            )
        )
        for name, fn, timed, warm in series:
            samples, empty = run_series(fn, timed, owners[kind], warm, owned)
            out["samples"][f"{name}/{kind}"] = samples
            out["empty"][f"{name}/{kind}"] = empty
            log(
                f"  {kind:5s} {name:7s}: p50 {percentile_ms(samples, 0.5):8.1f} ms, "
                f"p95 {percentile_ms(samples, 0.95):8.1f} ms, max {max(samples) / 1e6:8.1f} ms "
                f"({len(samples)} queries, {empty} without a hit)"
            )
    platform.reset()
    return out


def measure_in_child(db: str, url: str, home: Path, spec_path: Path) -> dict[str, Any]:
    """:func:`measure` in a new interpreter pointed at ``url``; its JSON answer."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= {
        "CONVEYOR_DATABASE_URL": url,
        "CONVEYOR_HOME": str(home),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    # The embedder is a setting: the child must use the one the vectors were made with.
    if "CONVEYOR_FILES" in os.environ:
        env["CONVEYOR_FILES"] = os.environ["CONVEYOR_FILES"]
    home.mkdir(parents=True, exist_ok=True)
    log(f"{db}: measuring in a fresh process")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.search", "--measure", str(spec_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        check=False,
    )
    if proc.returncode != 0:
        raise BenchError(f"the {db} measuring process exited with {proc.returncode}")
    answer: dict[str, Any] = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return answer


# -- the whole thing -----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--chunks", type=int, default=FULL.chunks, help="chunks in all (default 100000)")
    parser.add_argument(
        "--heavy", type=int, default=FULL.heavy, help="the heavy user's chunks (default 20000)"
    )
    parser.add_argument("--queries", type=int, default=FULL.queries, help="timed queries per series (100)")
    parser.add_argument("--naive-queries", type=int, default=FULL.naive_queries, help="baseline queries (10)")
    parser.add_argument("--seed", type=int, default=SEED, help="text and queries (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="CI: 5k chunks (heavy 1k), 20 queries, 3 naive")
    parser.add_argument("--pg", default=DEFAULT_PG, help="Postgres base URL, without a database")
    parser.add_argument("--database", default=DATABASE, help="Postgres database (dropped and created)")
    parser.add_argument(
        "--sqlite-dir", type=Path, default=None, help="where the SQLite file goes (temporary)"
    )
    parser.add_argument("--keep", action="store_true", help="keep both databases at the end")
    parser.add_argument("--reuse", action="store_true", help="measure a kept population (needs --sqlite-dir)")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.chunks, args.heavy = SMOKE.chunks, SMOKE.heavy
        args.queries, args.naive_queries = SMOKE.queries, SMOKE.naive_queries
    if args.reuse and args.sqlite_dir is None:
        parser.error("--reuse needs the --sqlite-dir of the kept population")
    if not 0 < args.heavy < args.chunks or args.chunks - args.heavy < LIGHT_USERS:
        parser.error("need 0 < --heavy < --chunks, and a chunk for each of the 49 light users")
    if args.queries < 1 or args.naive_queries < 1:
        parser.error("--queries and --naive-queries must be positive")
    return args


def report(results: dict[str, dict[str, Any]]) -> list[str]:
    """The ``name=value`` lines of the latencies, and a log line per goal."""
    lines: list[str] = []
    names = [("default", "search_p95_ms_{db}_{kind}", 0.95), ("default", "search_p50_ms_{db}_{kind}", 0.5)]
    names += [(r, f"search_p95_ms_{{db}}_{{kind}}_{r}", 0.95) for r in RANKINGS]
    names += [
        ("naive", "naive_search_p95_ms_{db}_{kind}", 0.95),
        ("naive", "naive_search_p50_ms_{db}_{kind}", 0.5),
    ]
    for series, name, q in names:
        for db in DBS:
            for kind in KINDS:
                samples = results[db]["samples"].get(f"{series}/{kind}")
                if samples:
                    lines.append(f"{name.format(db=db, kind=kind)}={percentile_ms(samples, q):.1f}")
    for (db, kind), goal in GOALS_MS.items():
        p95 = percentile_ms(results[db]["samples"][f"default/{kind}"], 0.95)
        log(f"goal {db} {kind}: p95 {p95:.1f} ms {'<=' if p95 <= goal else '>'} {goal:.0f} ms")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Populate, measure each database in a fresh process, print the ``name=value`` lines."""
    args = parse_args(argv)
    if args.measure is not None:
        try:
            print(json.dumps(measure(args.measure)), flush=True)
        except BenchError as exc:
            log(f"measurement failed: {exc}")
            return 1
        return 0

    from config.migrations import upgrade
    from config.settings import get_settings
    from conveyor.store.db.engine import make_engine, sqlite_url
    from tasks.files.embedding import load_embedder

    scale = Scale(args.chunks, args.heavy, args.queries, args.naive_queries)
    home = Path(tempfile.mkdtemp(prefix="conveyor-bench-search-"))
    sqlite_dir = args.sqlite_dir or Path(tempfile.mkdtemp(prefix="conveyor-bench-search-sqlite-"))
    sqlite_dir.mkdir(parents=True, exist_ok=True)
    urls = {"pg": f"{args.pg.rstrip('/')}/{args.database}", "sqlite": sqlite_url(sqlite_dir)}
    embedder = load_embedder(get_settings().files.embedder)
    vocabulary, source = build_vocabulary(args.seed)
    specs = plan(scale, args.seed)
    log(
        f"search: {scale.chunks} chunks in {len(specs)} files (heavy user {scale.heavy}, "
        f"{LIGHT_USERS} light), embedder {embedder.name}, vocabulary {len(vocabulary)} ({source}); "
        f"pg={urls['pg']} sqlite={urls['sqlite']}"
    )
    if not args.reuse:
        recreate_database(args.pg, args.database)
        Path(urls["sqlite"].removeprefix("sqlite:///")).unlink(missing_ok=True)
    targets = [Target(db, url, make_engine(url, pool_size=2)) for db, url in urls.items()]
    population: Population | None = None
    try:
        for target in targets:
            upgrade(target.engine)
        if args.reuse:
            counts = {t.db: count_chunks(t.engine) for t in targets}
            if set(counts.values()) != {scale.chunks}:
                raise BenchError(f"the kept population has {counts} chunks, not {scale.chunks}")
            models = {t.db: stored_models(t.engine) for t in targets}
            if any(m != [embedder.name] for m in models.values()):
                raise BenchError(f"the kept population's vectors are {models}'s, not {embedder.name}'s")
            log("reusing the kept population")
        else:
            population = populate(targets, specs, vocabulary, embedder, args.seed)
            log(
                f"populated in {population.seconds:.1f}s: inserts "
                + ", ".join(f"{db} {s:.1f}s" for db, s in population.inserts.items())
                + f", waiting for the embedding pool {population.wait_s:.1f}s,"
                + f" vacuum {population.vacuum_s:.1f}s"
            )
        for target in targets:
            target.engine.dispose()
        queries = make_queries(vocabulary, WARMUP + scale.queries, args.seed)
        spec_path = home / "queries.json"
        spec_path.write_text(
            json.dumps(
                {
                    "warmup": queries[:WARMUP],
                    "queries": queries[WARMUP:],
                    "naive_queries": scale.naive_queries,
                    "embedder": embedder.name,
                }
            )
        )
        results = {db: measure_in_child(db, urls[db], home / f"home-{db}", spec_path) for db in DBS}
    except BenchError as exc:
        log(f"benchmark failed: {exc}")
        return 1
    finally:
        for target in targets:
            target.engine.dispose()
        if args.keep:
            log(
                f"kept: {urls['pg']} and {urls['sqlite']} "
                f"(measure again with --reuse --sqlite-dir {sqlite_dir})"
            )
        else:
            recreate_database(args.pg, args.database, create=False)
            shutil.rmtree(sqlite_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    for line in report(results):
        print(line)
    print(f"chunks={scale.chunks}")
    print(f"heavy_chunks={scale.heavy}")
    print(f"light_users={LIGHT_USERS}")
    print(f"files={len(specs)}")
    print(f"queries={scale.queries}")
    print(f"naive_queries={scale.naive_queries}")
    if population is not None:
        print(f"populate_s={population.seconds:.1f}")
    print(f"vocabulary_words={len(vocabulary)}")
    print(f"embedder={embedder.name}")
    return 0


if __name__ == "__main__":
    # Run as ``python bench/search.py`` or ``python -m bench.search``: the pool's spawned
    # processes must import the very module that defines :func:`make_file`.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.search import main as bench_main

    raise SystemExit(bench_main())
