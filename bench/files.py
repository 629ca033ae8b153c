"""Files pipeline: a batch of small documents through Conveyor against a plain Celery chord.

Both sides process the same ``--n`` small documents (plain text, Markdown and HTML of a few
hundred bytes, varied words; the same documents on both sides of a run) with the same
pure functions (:func:`tasks.files.extract.extract`, :func:`tasks.files.chunking.chunk_text`
and the embedder of :mod:`tasks.files.embedding`, configured from the same settings), the
same storage reads by reference, the same ``files`` / ``file_chunks`` writes in the same
Postgres database, the same Celery config dict (:func:`conveyor.delivery.celeryconfig.celery_config`)
on the same Redis, and a real ``celery worker -P prefork`` subprocess with the same
concurrency and flags, rate limits disabled on both (``worker_disable_rate_limits``,
checked with ``inspect conf``). Only one worker runs at a time; runs are interleaved
(tracked, raw, tracked, raw, ...), each with a fresh worker and an untimed warm-up batch,
and the median per side is reported.

* tracked: :func:`pipelines.files.process_batch` (upload every file, seal the batch, queue
  the files, one chord of ``extract → chunk → embed`` chains with ``complete_batch`` as
  its body) on the files queues of ``celery -A config.celery_app`` (one per stage; extract
  parses in a memory- and time-bounded child process, the raw side in the task itself). Timed from the call
  until the batch row is ``completed`` *and* every job is terminal, i.e. the chord body
  has run too, the point the raw side's chord result marks (the database is polled every
  50 ms; the moment the batch row alone turned ``completed`` is logged on stderr). Every
  job must end ``succeeded``, with nothing in the DLQ.
* raw: a plain Celery app (:data:`raw_app`, no Conveyor base class, no job rows, claims,
  events or state-machine compare-and-set) on its own queue ``files_raw``: the same
  :func:`pipelines.files.upload` of every file into a batch of its own, one plain update
  that seals the batch and one that queues its files, then
  ``chord(group(chain(raw_extract.s(id), raw_chunk.s(), raw_embed.s()) ...), raw_complete)``.
  Each raw task does its stage's work with the helpers below and writes the file row with
  one plain ``UPDATE``; the body counts the batch's ready files and marks the batch
  ``completed``. Timed from the first upload until the chord result is in the Redis result
  backend (polled every 50 ms).

Both sides are then checked alike: every file of the batch ``ready``, every chunk embedded,
the batch ``completed`` with ``ready = total = N``.

Usage::

    .venv/bin/python -m bench.files                  # N=1000 files, 3 runs per side
    .venv/bin/python -m bench.files --smoke          # CI: N=40, 1 run
    .venv/bin/python -m bench.files --n 500 --concurrency 2 --runs 5

Progress goes to stderr; the last lines on stdout are ``name=value`` pairs:
``files_per_s``, ``raw_chord_files_per_s``, ``overhead_ratio`` (tracked wall time ÷ raw
wall time, medians; the goal is ≤ 1.3), ``n``, ``runs``.

Importing this module is cheap and reads no settings, except in a worker process started
by the bench (``celery -A bench.files:raw_app``), where ``CONVEYOR_REDIS_URL`` is set and
:data:`raw_app` configures itself from the environment exactly like ``config.celery_app``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import Celery, chain, chord, group
from celery.result import AsyncResult
from sqlalchemy import Engine, func, select, update

from bench.common import (
    POLL_INTERVAL,
    ROOT,
    BenchError,
    BenchWorker,
    RunResult,
    add_service_args,
    backlog,
    check_all_succeeded,
    log,
    open_platform,
    prepare,
    raw_queue_config,
    wait_drained,
)
from config.settings import Settings
from conveyor.store.db.dialect import db_now
from tasks.files import flow
from tasks.files.chunking import Chunk, chunk_text
from tasks.files.embedding import Embedder, embed_packed, load_embedder
from tasks.files.extract import Extracted, Limits, extract
from tasks.files.models import CHUNKING, EMBEDDING, QUEUED, READY, batches, chunks, files
from tasks.files.storage import storage_for

if TYPE_CHECKING:
    from redis import Redis

    from conveyor.platform import Platform
    from conveyor.settings import ConveyorSettings
    from pipelines.files import Upload

TRACKED_QUEUES = ("file-extract", "file-chunk", "file-embed", "batch-completion")  # config/queues.py
RAW_QUEUE = "files_raw"
QUEUES = (*TRACKED_QUEUES, RAW_QUEUE)
RAW_APP = "bench.files:raw_app"
REDIS_DB = 13
DATABASE = "conveyor_bench_files"
COMPLETE_STAGE = "conveyor.files.complete_batch"
TRACKED_OWNER = "bench-tracked"
RAW_OWNER = "bench-raw"
DEFAULT_N = 1000
SMOKE_N = 40
DEFAULT_CONCURRENCY = 4
IDLE_PAUSE = 0.5
JOBS_PER_FILE = 3  # extract, chunk, embed; plus one complete_batch job per batch
# Passed to both workers after ``--`` (Celery's command-line config, namespace ``worker``).
NO_RATE_LIMITS = ("--", "worker_disable_rate_limits=true")


# -- the work itself: what a stage body does, shared by the raw tasks -------------------
#
# The tracked side runs tasks/files/stages.py; these helpers call the same pure functions
# with the same settings, the same way, so that only the bookkeeping around them differs.


def read_and_extract(settings: Settings, content_ref: str, name: str) -> Extracted:
    """Read the content by reference and extract its text (``extract_stage``'s work)."""
    limits = Limits(max_bytes=settings.files.max_bytes, max_pages=settings.files.max_pages)
    storage = storage_for(content_ref, local_root=settings.files_storage_dir(), s3=settings.files.s3)
    return extract(storage.get(content_ref), name=name, limits=limits)


def split(settings: Settings, text: str) -> list[Chunk]:
    """Token-bounded, overlapping chunks (``chunk_stage``'s work)."""
    return chunk_text(text, max_tokens=settings.files.chunk_tokens, overlap=settings.files.chunk_overlap)


@cache
def embedder_named(name: str) -> Embedder:
    """The embedder, loaded once per process (as ``tasks.files.stages._embedder``)."""
    return load_embedder(name)


# -- the raw side: a plain Celery app and tasks, nothing from Conveyor's runtime ---------

raw_app = Celery("conveyor_bench_files_raw")


def configure_raw_app(settings: ConveyorSettings) -> None:
    """Give :data:`raw_app` the Celery config the deployment's app gets, on its own queue."""
    raw_app.conf.update(raw_queue_config(settings, RAW_QUEUE, "conveyor_bench_raw"))


@cache
def worker_settings() -> Settings:
    """The raw worker's settings, from the environment the bench gave it."""
    return Settings()


_engines: dict[int, Engine] = {}


def worker_engine() -> Engine:
    """This pool process's engine (made after the fork, like the platform's)."""
    from conveyor.store.db.engine import make_engine

    engine = _engines.get(os.getpid())
    if engine is None:
        settings = worker_settings()
        if not settings.database_url:
            raise RuntimeError("CONVEYOR_DATABASE_URL is not set")
        engine = _engines[os.getpid()] = make_engine(settings.database_url, pool_size=settings.db_pool_size)
    return engine


@raw_app.task(name="bench.raw.files.extract", queue=RAW_QUEUE)  # type: ignore[untyped-decorator]
def raw_extract(file_id: str) -> str:
    """Extract one file's text into its row; the raw counterpart of ``extract_stage``."""
    settings = worker_settings()
    with worker_engine().begin() as conn:
        row = flow.get_file(conn, file_id)
        if row is None:
            raise LookupError(f"file {file_id} not found")
        result = read_and_extract(settings, row["content_ref"], row["name"])
        conn.execute(
            update(files)
            .where(files.c.id == file_id)
            .values(
                status=CHUNKING, text=result.text, mime=result.mime, pages=result.pages, updated_at=db_now()
            )
        )
    return file_id


@raw_app.task(name="bench.raw.files.chunk", queue=RAW_QUEUE)  # type: ignore[untyped-decorator]
def raw_chunk(file_id: str) -> str:
    """Replace one file's chunk rows; the raw counterpart of ``chunk_stage``."""
    settings = worker_settings()
    with worker_engine().begin() as conn:
        row = flow.get_file(conn, file_id)
        if row is None:
            raise LookupError(f"file {file_id} not found")
        pieces = split(settings, row["text"] or "")
        flow.replace_chunks(conn, file_id, row["owner"], pieces)
        conn.execute(
            update(files)
            .where(files.c.id == file_id)
            .values(status=EMBEDDING, chunk_count=len(pieces), updated_at=db_now())
        )
    return file_id


@raw_app.task(name="bench.raw.files.embed", queue=RAW_QUEUE)  # type: ignore[untyped-decorator]
def raw_embed(file_id: str) -> str:
    """Write one vector per chunk and mark the file ready; the raw counterpart of ``embed_stage``."""
    settings = worker_settings()
    embedder = embedder_named(settings.files.embedder)
    with worker_engine().begin() as conn:
        vectors = embed_packed(embedder, flow.chunk_texts(conn, file_id))
        owner = conn.execute(select(files.c.owner).where(files.c.id == file_id)).scalar_one()
        flow.write_vectors(conn, file_id, owner, embedder.name, vectors)
        conn.execute(update(files).where(files.c.id == file_id).values(status=READY, updated_at=db_now()))
    return file_id


@raw_app.task(name="bench.raw.files.complete", queue=RAW_QUEUE)  # type: ignore[untyped-decorator]
def raw_complete(results: list[str], batch_id: str) -> dict[str, Any]:
    """The chord body: count the batch's ready files and mark the batch completed."""
    ready_count = (
        select(func.count())
        .select_from(files)
        .where(files.c.batch_id == batch_id, files.c.status == READY)
        .scalar_subquery()
    )
    with worker_engine().begin() as conn:
        row = (
            conn.execute(
                update(batches)
                .where(batches.c.id == batch_id)
                .values(
                    ready=ready_count,
                    terminal=ready_count,
                    status="completed",
                    completed_at=db_now(),
                )
                .returning(batches.c.total, batches.c.ready, batches.c.status)
            )
            .mappings()
            .one()
        )
    return {**dict(row), "results": len(results)}


if os.environ.get("CONVEYOR_REDIS_URL"):
    # A worker process: same environment as the tracked worker (conveyor.delivery.procs.service_env).
    # A fresh Settings(), not the cached get_settings(): in the bench process this runs at
    # import, before main() sets the environment (main() configures the app again).
    configure_raw_app(Settings())


# -- documents ---------------------------------------------------------------------------

_WORDS_RAW = """
glacier retreat valley river delta harbour mountain summit forest meadow granite basalt
sediment erosion rainfall drought monsoon tundra permafrost aquifer estuary lagoon reef
archive ledger invoice contract quarterly revenue forecast budget audit pipeline release
deploy rollback latency throughput cache replica shard index query cursor schema migration
kernel thread socket buffer packet router switch firewall certificate token session
orchard harvest vineyard barley wheat saffron cinnamon pepper lentil chestnut walnut
violin cello sonata chorus rhythm melody harmony tempo ballad overture libretto
comet nebula orbit eclipse quasar telescope satellite gravity photon spectrum
lantern compass anchor voyage cargo ferry canal bridge tunnel viaduct railway
"""
_SYLLABLES_RAW = "ka lo mi ne ru sa ti vo ze bra del fin gor hum jel kir lum mor nix pal quo rast"
WORDS = tuple(_WORDS_RAW.split())
SYLLABLES = tuple(_SYLLABLES_RAW.split())


def _word(rng: random.Random) -> str:
    if rng.random() < 0.75:
        return rng.choice(WORDS)
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(6, 14))]
    return " ".join(words).capitalize() + rng.choice(".!?..")


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


def make_document(rng: random.Random, index: int) -> Upload:
    """One small document (a few hundred bytes): plain text, Markdown or HTML in turn."""
    from pipelines.files import Upload

    title = " ".join(_word(rng) for _ in range(3)).title()
    kind = index % 3
    if kind == 0:
        text = f"{title}\n\n{_paragraph(rng, 2)}\n\n{_paragraph(rng, 2)}\n"
        return Upload(f"doc-{index:05d}.txt", text.encode())
    if kind == 1:
        items = "\n".join(f"- {_sentence(rng)}" for _ in range(2))
        text = (
            f"# {title}\n\n{_paragraph(rng, 2)}\n\n{items}\n\n"
            f"See [{_word(rng)}](https://example.com/{_word(rng)}) and **{_word(rng)}**.\n"
        )
        return Upload(f"doc-{index:05d}.md", text.encode())
    html = (
        f"<!doctype html><html><head><title>{title}</title></head><body>"
        f"<h1>{title}</h1><p>{_paragraph(rng, 2)}</p><ul><li>{_sentence(rng)}</li>"
        f"<li>{_sentence(rng)}</li></ul><p>{_paragraph(rng, 1)}</p></body></html>\n"
    )
    return Upload(f"doc-{index:05d}.html", html.encode())


def make_documents(n: int, seed: int) -> list[Upload]:
    """``n`` documents, the same ones for the same seed."""
    rng = random.Random(seed)
    return [make_document(rng, i) for i in range(n)]


# -- measurements ------------------------------------------------------------------------


@dataclass
class Bench:
    """Everything one benchmark invocation needs: services, platform, options."""

    platform: Platform
    redis: Redis
    n: int
    concurrency: int
    home: Path
    tracked_jobs: int = 0
    tracked_batches: int = 0
    results: list[RunResult] = field(default_factory=list)
    worker: BenchWorker = field(init=False)

    def __post_init__(self) -> None:
        self.worker = BenchWorker(self.home)

    # -- workers ---------------------------------------------------------------------

    def start_worker(self, side: str, run: int) -> str:
        """Start the worker of ``side`` (only one at a time) and wait until it answers."""
        settings, app, queues = self.platform.settings, self.platform.app, list(TRACKED_QUEUES)
        if side == "raw":
            settings, app, queues = settings.model_copy(update={"app": RAW_APP}), raw_app, [RAW_QUEUE]
        hostname = self.worker.start(
            settings,
            app,
            name=f"files-{side}-{run}",
            queues=queues,
            concurrency=self.concurrency,
            extra_args=NO_RATE_LIMITS,
        )
        self.check_worker_conf(app, hostname)
        return hostname

    @staticmethod
    def check_worker_conf(app: Celery, hostname: str) -> None:
        """The worker runs with rate limits disabled (Celery's ``inspect conf``)."""
        replies = app.control.inspect(destination=[hostname], timeout=2.0).conf() or {}
        conf = replies.get(hostname) or {}
        if conf.get("worker_disable_rate_limits") is not True:
            raise BenchError(f"worker {hostname} runs with rate limits enabled")

    def stop_worker(self) -> None:
        """Warm-stop the running worker, after its last ack reached Redis."""
        if self.worker.proc is None:
            return
        try:
            wait_drained(self.redis, QUEUES)
        finally:
            self.worker.stop()

    def timeout(self, n: int) -> float:
        """How long a batch of ``n`` files may take before the run is declared broken."""
        return max(120.0, n * 0.5)

    # -- checks common to both sides -------------------------------------------------

    def check_batch(self, batch_id: str, n: int) -> None:
        """Every file ready, every chunk embedded, the batch completed with ready = total = n."""
        by_status = (
            select(files.c.status, func.count()).where(files.c.batch_id == batch_id).group_by(files.c.status)
        )
        in_batch = select(files.c.id).where(files.c.batch_id == batch_id)
        total = select(func.count()).where(chunks.c.file_id.in_(in_batch))
        with self.platform.engine.connect() as conn:
            statuses = {str(k): int(v) for k, v in conn.execute(by_status)}
            total_chunks = conn.execute(total).scalar_one()
            with_vectors = flow.embedded_chunks(conn, in_batch)
            batch = flow.batch_summary(conn, batch_id)
        if statuses != {READY: n}:
            raise BenchError(f"batch {batch_id}: expected {n} ready files, found {statuses}")
        if total_chunks < n or with_vectors != total_chunks:
            raise BenchError(f"batch {batch_id}: {with_vectors} of {total_chunks} chunks embedded")
        if batch is None or (batch["status"], batch["total"], batch["ready"]) != ("completed", n, n):
            raise BenchError(f"batch {batch_id}: {dict(batch) if batch else None}")

    # -- tracked side ----------------------------------------------------------------

    def tracked_state(self, batch_id: str) -> tuple[str, int, int]:
        """The batch row's status, how many jobs are not yet terminal, how many chord bodies ran.

        A chord body's job row only appears once the header's last member has returned,
        so "no job pending" alone may be seen just before it.
        """
        from conveyor.store.db.schema import TERMINAL, jobs

        pending = select(func.count()).select_from(jobs).where(jobs.c.status.not_in(sorted(TERMINAL)))
        bodies = (
            select(func.count())
            .select_from(jobs)
            .where(jobs.c.stage == COMPLETE_STAGE, jobs.c.status.in_(sorted(TERMINAL)))
        )
        with self.platform.engine.connect() as conn:
            status = conn.execute(select(batches.c.status).where(batches.c.id == batch_id)).scalar_one()
            return (
                str(status),
                int(conn.execute(pending).scalar_one()),
                int(conn.execute(bodies).scalar_one()),
            )

    def tracked_batch(self, items: Sequence[Upload]) -> tuple[float, float, float]:
        """Process one batch through Conveyor; seconds to submitted, batch completed, all done."""
        from pipelines.files import process_batch

        start = time.perf_counter()
        batch_id = process_batch(self.platform, TRACKED_OWNER, items)
        submitted = time.perf_counter()
        self.tracked_jobs += JOBS_PER_FILE * len(items) + 1
        self.tracked_batches += 1
        completed = 0.0
        deadline = time.monotonic() + self.timeout(len(items))
        while True:
            status, pending, bodies = self.tracked_state(batch_id)
            now = time.perf_counter()
            if status == "completed":
                completed = completed or now
                if bodies >= self.tracked_batches and not pending:
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"tracked batch {status} with {pending} jobs pending after the timeout")
            self.worker.check()
            time.sleep(POLL_INTERVAL)
        self.check_batch(batch_id, len(items))
        check_all_succeeded(self.platform, self.tracked_jobs)
        return submitted - start, completed - start, now - start

    def run_tracked(self, run: int) -> RunResult:
        """One timed tracked run with a fresh worker."""
        self.start_worker("tracked", run)
        try:
            self.tracked_batch(make_documents(2 * self.concurrency, seed=-1 - run))
            wait_drained(self.redis, QUEUES)
            items = make_documents(self.n, seed=run)
            time.sleep(IDLE_PAUSE)
            submitted, completed, done = self.tracked_batch(items)
        finally:
            self.stop_worker()
        log(f"  tracked batch row completed at {completed:.2f}s, chord body done at {done:.2f}s")
        return RunResult("tracked", self.n, done, submitted)

    # -- raw side --------------------------------------------------------------------

    def raw_batch(self, items: Sequence[Upload]) -> tuple[float, float]:
        """Process one batch as a plain chord; seconds to submitted and to the chord result."""
        from pipelines.files import new_batch, upload

        start = time.perf_counter()
        batch_id = new_batch(self.platform, RAW_OWNER)
        file_ids = [upload(self.platform, RAW_OWNER, item, batch_id=batch_id) for item in items]
        with self.platform.engine.begin() as conn:
            conn.execute(
                update(batches)
                .where(batches.c.id == batch_id)
                .values(sealed=True, total=len(file_ids), status="processing")
            )
            conn.execute(
                update(files).where(files.c.batch_id == batch_id).values(status=QUEUED, updated_at=db_now())
            )
        header = group(chain(raw_extract.s(f), raw_chunk.s(), raw_embed.s()) for f in file_ids)
        result: AsyncResult = chord(header, raw_complete.s(batch_id=batch_id)).apply_async()
        submitted = time.perf_counter()
        deadline = time.monotonic() + self.timeout(len(items))
        while not result.ready():
            if time.monotonic() > deadline:
                raise BenchError(f"raw chord not done after {self.timeout(len(items)):.0f}s")
            self.worker.check()
            time.sleep(POLL_INTERVAL)
        end = time.perf_counter()
        if not result.successful():
            raise BenchError(f"raw chord failed: {result.result!r}")
        summary = result.result
        n = len(items)
        if summary != {"total": n, "ready": n, "status": "completed", "results": n}:
            raise BenchError(f"raw chord body returned {summary!r}")
        result.forget()
        self.check_batch(batch_id, len(items))
        return submitted - start, end - start

    def run_raw(self, run: int) -> RunResult:
        """One timed raw-Celery run with a fresh worker."""
        self.start_worker("raw", run)
        try:
            self.raw_batch(make_documents(2 * self.concurrency, seed=-1 - run))
            wait_drained(self.redis, QUEUES)
            items = make_documents(self.n, seed=run)
            time.sleep(IDLE_PAUSE)
            submitted, end = self.raw_batch(items)
        finally:
            self.stop_worker()
        return RunResult("raw", self.n, end, submitted)

    # -- the whole thing -------------------------------------------------------------

    def run(self, runs: int) -> tuple[float, float, float]:
        """Interleave ``runs`` runs per side; return the median rates and wall-time ratio."""
        sides: list[tuple[str, Callable[[int], RunResult]]] = [
            ("tracked", self.run_tracked),
            ("raw", self.run_raw),
        ]
        for run in range(runs):
            for side, fn in sides:
                if backlog(self.redis, QUEUES):
                    raise BenchError(f"queues not empty before the {side} run")
                result = fn(run)
                self.results.append(result)
                log(
                    f"run {run + 1}/{runs} {side:7s}: {result.per_second:8.1f} files/s "
                    f"({result.seconds:.2f}s total, {result.submit_seconds:.2f}s uploading and submitting)"
                )
        tracked = statistics.median(r.seconds for r in self.results if r.side == "tracked")
        raw = statistics.median(r.seconds for r in self.results if r.side == "raw")
        after = {
            side: statistics.median(r.seconds - r.submit_seconds for r in self.results if r.side == side)
            for side in ("tracked", "raw")
        }
        log(
            f"medians: tracked {tracked:.2f}s, raw {raw:.2f}s; after the submit returned: "
            f"tracked {after['tracked']:.2f}s, raw {after['raw']:.2f}s "
            f"(ratio {after['tracked'] / after['raw']:.3f})"
        )
        return self.n / tracked, self.n / raw, tracked / raw


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=DEFAULT_N, help=f"files per batch (default {DEFAULT_N})")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"pool size, both sides (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per side, interleaved (default 3)")
    parser.add_argument("--smoke", action="store_true", help=f"CI: n={SMOKE_N}, 1 run")
    add_service_args(parser, redis_db=REDIS_DB, database=DATABASE)
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.runs = SMOKE_N, 1
    if args.n < 1 or args.runs < 1 or args.concurrency < 1:
        parser.error("--n, --runs and --concurrency must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the ``name=value`` lines. Exit 0 unless something broke."""
    args = parse_args(argv)
    services = prepare(args, prefix="conveyor-bench-files-")
    redis_url, database_url, home = services.redis_url, services.database_url, services.home
    bench: Bench | None = None
    try:
        platform = open_platform()
        configure_raw_app(platform.settings)
        bench = Bench(
            platform=platform,
            redis=services.redis,
            n=args.n,
            concurrency=args.concurrency,
            home=home,
        )
        log(
            f"files: n={args.n} runs={args.runs} concurrency={bench.concurrency} "
            f"redis={redis_url} db={database_url} home={home}"
        )
        tracked, raw, ratio = bench.run(args.runs)
    except BenchError as exc:
        log(f"benchmark failed: {exc} (logs kept in {home / 'logs'})")
        return 1
    finally:
        if bench is not None:
            try:
                bench.stop_worker()
            except BenchError as exc:
                log(f"cleanup: {exc}")
            bench.platform.reset()
        raw_app.close()
        services.release()
    shutil.rmtree(home, ignore_errors=True)
    print(f"files_per_s={tracked:.1f}")
    print(f"raw_chord_files_per_s={raw:.1f}")
    print(f"overhead_ratio={ratio:.3f}")
    print(f"n={args.n}")
    print(f"runs={args.runs}")
    return 0


if __name__ == "__main__":
    # Run as ``python -m bench.files`` or as a file: either way the worker must import the
    # very module that registered the raw tasks, so hand over to ``bench.files``.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.files import main as bench_main

    raise SystemExit(bench_main())
