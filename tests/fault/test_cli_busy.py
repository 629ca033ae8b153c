"""The CLI and a busy or unreachable database: it waits up to ``--wait`` seconds with a
status line on stderr, then exits 2 with one line saying what it waited for; never a
traceback, never a password, never a second (or half-written) batch.
"""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.delivery.procs import service_env
from pipelines.files import Upload
from tasks.files.models import batches
from tests.fault.conftest import Spawn

pytestmark = [pytest.mark.timeout(180), pytest.mark.sqlite]

# ``files submit`` streams each path through ``Upload.from_path``, which another change adds.
needs_from_path = pytest.mark.skipif(
    not hasattr(Upload, "from_path"), reason="PENDING: pipelines.files.Upload.from_path has not landed"
)



def _db_file(platform: Any) -> str:
    return str(platform.settings.database_url).removeprefix("sqlite:///")


@contextlib.contextmanager
def held(platform: Any, *, readers_too: bool = False) -> Iterator[Callable[[], None]]:
    """Hold SQLite's write lock from a raw connection (an uncommitted insert) until the
    block ends or it calls the release function it was given; with ``readers_too``, in
    exclusive locking mode, so that readers are locked out as well."""
    platform.reset()  # no connection of ours may stay open (exclusive mode needs that)
    conn = sqlite3.connect(_db_file(platform), isolation_level=None, check_same_thread=False)
    if readers_too:
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO conveyor_counters(name, value) VALUES ('cli-busy-test', 1)")
    if readers_too:
        conn.execute("COMMIT")  # the exclusive lock stays until the connection closes
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE conveyor_counters SET value = 2 WHERE name = 'cli-busy-test'")
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            conn.rollback()
            conn.close()

    try:
        yield release
    finally:
        release()


def released_while_waiting(
    env: dict[str, str], release: Callable[[], None], *args: str
) -> tuple[int, str, str]:
    """Run ``conveyor ARGS``; once it says it is waiting for the database, wait 1 s more
    and release the lock. Returns its exit code, stdout and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "waiting for the database" in line:
                break
        time.sleep(1.0)
        release()
        out, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, "".join(seen) + rest


def conveyor(
    env: dict[str, str], *args: str, timeout: float = 120
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - started


def gave_up(proc: subprocess.CompletedProcess[str], *, after: str, what: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [line for line in proc.stderr.splitlines() if "gave up" in line]
    assert len(lines) == 1, proc.stderr
    assert f"gave up after {after}" in lines[0] and what in lines[0], lines[0]


def owned_batches(platform: Any, owner: str) -> int:
    with platform.engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(batches.c.owner == owner)).scalar_one())


@pytest.fixture
def document(tmp_path: Path, tag: str) -> Path:
    path = tmp_path / f"{tag}-doc.txt"
    path.write_text("Beekeepers inspect the brood frames every week, checking the queen.")
    return path


# -- SQLite: the writer is held ------------------------------------------------------------


@needs_from_path
def test_submit_gives_up_on_a_held_writer_and_writes_nothing(
    on_sqlite: Any, document: Path, tag: str
) -> None:
    env = service_env(on_sqlite.settings)
    with held(on_sqlite):
        proc, took = conveyor(env, "files", "submit", "--wait", "2", "--user", tag, str(document))
    gave_up(proc, after="2 s", what="locked by another writer")
    assert "sqlite:///" in proc.stderr and "waiting for the database" in proc.stderr
    assert took < 20
    assert owned_batches(on_sqlite, tag) == 0


@needs_from_path
def test_submit_goes_on_once_the_writer_lets_go(
    on_sqlite: Any, spawn: Spawn, document: Path, tag: str
) -> None:
    spawn(concurrency=1, settings=on_sqlite.settings)
    env = service_env(on_sqlite.settings)
    with held(on_sqlite) as release:
        args = ["files", "submit", "--wait", "10", "--user", tag, "--timeout", "90", str(document)]
        code, out, errs = released_while_waiting(env, release, *args)
    assert code == 0, out + errs
    assert "waiting for the database (locked by another writer)" in errs and "Traceback" not in errs
    assert "ready=1" in out
    assert owned_batches(on_sqlite, tag) == 1


def test_reads_never_queue_behind_the_writer(on_sqlite: Any) -> None:
    env = service_env(on_sqlite.settings)
    with held(on_sqlite):
        for args in (["jobs", "list"], ["dlq", "list"], ["dlq", "list", "--json"]):
            proc, took = conveyor(env, *args, "--wait", "2")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert took < 10 and "waiting" not in proc.stderr


def test_a_repeatable_write_gives_up_on_a_held_writer(on_sqlite: Any) -> None:
    env = service_env(on_sqlite.settings)
    with held(on_sqlite):
        proc, took = conveyor(env, "dlq", "purge", "--wait", "2")
    gave_up(proc, after="2 s", what="locked by another writer")
    assert took < 20


# -- SQLite: readers locked out too ---------------------------------------------------------


def test_reads_give_up_when_readers_are_locked_out(on_sqlite: Any) -> None:
    env = service_env(on_sqlite.settings)
    with held(on_sqlite, readers_too=True):
        for args in (["jobs", "list"], ["dlq", "list", "--json"], ["files", "status", "nobatch"]):
            proc, took = conveyor(env, *args, "--wait", "2")
            gave_up(proc, after="2 s", what="locked by another writer")
            assert proc.stdout == "" and took < 20


def test_a_read_goes_on_once_the_lock_is_released(on_sqlite: Any) -> None:
    env = service_env(on_sqlite.settings)
    with held(on_sqlite, readers_too=True) as release:
        code, out, errs = released_while_waiting(env, release, "jobs", "list", "--json", "--wait", "10")
    assert code == 0, out + errs
    assert out.strip().startswith("[")
    assert "waiting for the database (locked by another writer)" in errs and "Traceback" not in errs


# -- unreachable ------------------------------------------------------------------------------


UNREACHABLE_PG = "postgresql://postgres:hunter2@127.0.0.1:1/x"


def test_postgres_unreachable(platform: Any) -> None:
    env = service_env(platform.settings, {"CONVEYOR_DATABASE_URL": UNREACHABLE_PG})
    for args in (["jobs", "list"], ["dlq", "list", "--json"], ["files", "status", "nobatch"]):
        proc, took = conveyor(env, *args, "--wait", "1")
        gave_up(proc, after="1 s", what="unreachable")
        assert "127.0.0.1:1" in proc.stderr and "hunter2" not in proc.stdout + proc.stderr
        assert took < 20


@needs_from_path
def test_submit_to_an_unreachable_postgres(platform: Any, document: Path, tag: str) -> None:
    env = service_env(platform.settings, {"CONVEYOR_DATABASE_URL": UNREACHABLE_PG})
    proc, took = conveyor(env, "files", "submit", "--wait", "1", "--user", tag, str(document))
    gave_up(proc, after="1 s", what="unreachable")
    assert "hunter2" not in proc.stdout + proc.stderr and took < 20


def test_sqlite_file_unreachable(platform: Any, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/no/such/dir/conveyor.db"
    env = service_env(platform.settings, {"CONVEYOR_DATABASE_URL": url})
    proc, took = conveyor(env, "jobs", "list", "--wait", "1")
    gave_up(proc, after="1 s", what="unreachable")
    assert url in proc.stderr and took < 20
