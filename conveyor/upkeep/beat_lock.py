"""One beat at a time: ``conveyor beat`` fires only while it holds a lock in the database.

Celery beat has no lock of its own: two beats (a rolling update, a second replica, a pod
replaced while its node is only unreachable) each fire every entry, and every firing is a
job. So ``conveyor beat`` first takes a session-level Postgres advisory lock on a
connection of its own and keeps it while it runs; a second beat waits for it, standing by.

The lock lasts as long as the session. If the connection is lost, Postgres may release the
lock (and a standby take it) while this beat still runs: a watchdog checks the connection
every few seconds, with TCP keepalives and a TCP user timeout so that a dead network
fails the check instead of hanging it, and ends the beat when the check fails. The
window left is the difference between the two sides noticing the loss (documented in
the README). On SQLite, whose database is one file on one host, an ``flock`` in the home
does the same.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from celery import beat as celery_beat
from sqlalchemy.engine import make_url

from conveyor.settings import ConveyorSettings
from conveyor.store.db.dialect import try_flock
from conveyor.store.db.engine import normalize_url

log = logging.getLogger("conveyor.beat")

BEAT_LOCK = 0x62656174  # "beat"


def _exit_now() -> None:
    """Stop this beat: SIGTERM (Celery beat exits on it), and exit hard if it did not."""
    # To the main thread itself: a signal taken by this thread would wait for beat's sleep
    # (up to its max interval) to end before Python ran the handler.
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)
    timer = threading.Timer(10.0, os._exit, (3,))
    timer.daemon = True
    timer.start()


class BeatLock:
    """The cluster-wide beat lock: :meth:`acquire` blocks until held, :meth:`watch` ends
    the process (``on_lost``) once it can no longer be sure it holds it."""

    def __init__(self, settings: ConveyorSettings, *, retry: float = 2.0, check: float = 2.0) -> None:
        self.settings = settings
        self.retry = retry
        self.check = check
        self._conn: Any = None
        self._fd: int | None = None
        self._stop = threading.Event()

    @property
    def on_postgres(self) -> bool:
        """Whether the lock is Postgres's (else an ``flock`` in the home, for SQLite)."""
        return bool(self.settings.database_url) and not normalize_url(
            self.settings.database_url or ""
        ).startswith("sqlite")

    def _connect(self) -> Any:
        import psycopg

        url = make_url(normalize_url(self.settings.database_url or "")).set(drivername="postgresql")
        return psycopg.connect(
            url.render_as_string(hide_password=False),
            autocommit=True,
            connect_timeout=self.settings.db_connect_timeout,
            application_name="conveyor beat lock",
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=2,
            tcp_user_timeout=10_000,
        )

    def try_acquire(self) -> bool:
        """Take the lock if free; True if this process holds it now."""
        if not self.on_postgres:
            return self._try_flock()
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        held = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (BEAT_LOCK,)).fetchone()[0]
        return bool(held)

    def _try_flock(self) -> bool:
        if self._fd is not None:
            return True
        self._fd = try_flock(self.settings.resolved_home() / "beat.lock")
        return self._fd is not None

    def held_anywhere(self) -> bool:
        """Whether some beat holds the lock now (this process, or another anywhere)."""
        if not self.on_postgres:
            if self._fd is not None:
                return True
            if self._try_flock():
                self.release()
                return False
            return True
        conn = self._connect()
        try:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND classid = %s AND objid = %s AND objsubid = 1",
                (BEAT_LOCK >> 32, BEAT_LOCK & 0xFFFFFFFF),
            ).fetchone()
        finally:
            conn.close()
        return bool(row and row[0])

    def acquire(self) -> None:
        """Block until this process holds the lock; says once that it stands by."""
        said = False
        while True:
            try:
                if self.try_acquire():
                    log.info("beat lock taken: this beat fires the schedule")
                    return
                if not said:
                    log.info("another beat holds the beat lock; standing by")
                    said = True
            except Exception as exc:  # the database away: keep waiting, it decides
                from conveyor.delivery.startup import database_at

                self._drop()
                detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                where = database_at(self.settings.database_url)
                log.warning("waiting for %s (the beat lock): %s; retrying in %g s", where, detail, self.retry)
            self._stop.wait(self.retry)

    def holds(self) -> bool:
        """Whether the lock's session still answers (the lock lives as long as it does)."""
        if not self.on_postgres:
            return self._fd is not None
        try:
            self._conn.execute("SELECT 1").fetchone()
        except Exception:
            return False
        return True

    def watch(self, on_lost: Callable[[], None] = _exit_now) -> threading.Thread:
        """Check the lock every ``check`` seconds in a daemon thread; call ``on_lost`` once
        when it may be gone."""

        def loop() -> None:
            while not self._stop.wait(self.check):
                if not self.holds():
                    log.error("lost the beat lock's database session; stopping so that no second beat fires")
                    self._drop()
                    on_lost()
                    return

        thread = threading.Thread(target=loop, name="conveyor-beat-lock", daemon=True)
        thread.start()
        return thread

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                log.debug("closing the beat lock's connection failed", exc_info=True)

    def release(self) -> None:
        """Stop watching and give the lock up (closing its session releases it)."""
        self._stop.set()
        self._drop()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Scheduler(celery_beat.Scheduler):  # type: ignore[misc]  # celery.beat has no hints
    """Celery's in-memory scheduler, built with SIGTERM and SIGINT held back.

    Beat builds its scheduler lazily, after it has installed its stop handler, and that
    handler asks for the scheduler again: a SIGTERM arriving mid-build re-entered the build
    (and an import half done) and beat exited 1 with a traceback. Here a stop asked for
    during the build is kept, and honoured once the build is done.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        asked: list[int] = []
        held = (signal.SIGTERM, signal.SIGINT)
        previous = {s: signal.signal(s, lambda signum, _frame: asked.append(signum)) for s in held}
        try:
            super().__init__(*args, **kwargs)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if asked:
            log.info("beat: asked to stop while starting; stopping")
            raise SystemExit(0)


__all__ = ["BEAT_LOCK", "BeatLock", "Scheduler"]
