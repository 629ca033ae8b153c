"""pytest-django fixtures for a project that calls Conveyor.

In ``conftest.py``: ``pytest_plugins = ["conveyor.contrib.django.testing"]``. A test that
needs its job run marks itself ``@pytest.mark.django_db(transaction=True)`` (the worker is
another process: it sees committed rows only) and asks for ``conveyor_worker`` (this
project's own stages) or starts another deployment's worker with ``conveyor_workers``.
Workers are real ``conveyor worker`` processes on Django's test database and on
``settings.CONVEYOR["TEST"]["REDIS_URL"]``; nothing runs eagerly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from conveyor.contrib.django import close, conf
from conveyor.delivery.procs import service_env, start_worker, stop
from conveyor.store.db.engine import make_engine
from conveyor.store.db.migrate import upgrade


@pytest.fixture(scope="session")
def conveyor_database(django_db_setup: Any, django_db_blocker: Any) -> Iterator[str]:
    """Conveyor's tables (the platform's migrations) in Django's test database; its URL.
    Ask for it (or for a worker) in every test that submits."""
    with django_db_blocker.unblock():
        settings = conf.conveyor_settings()
        assert settings.database_url
        engine = make_engine(settings.database_url, schema=settings.db_schema)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
    yield settings.database_url
    close()  # before Django drops the test database


class Workers:
    """Starts ``conveyor worker`` processes of any deployment on the test services."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        *,
        app: str | None = None,
        root: str | Path | None = None,
        queues: list[str] | None = None,
        concurrency: int = 2,
        django: bool = True,
        timeout: float = 60.0,
    ) -> subprocess.Popen[bytes]:
        """Migrate the deployment (``conveyor db upgrade``: its tables, its stage registry)
        into the test database, then start its worker and wait until it is ready.

        ``app``/``root``: the deployment's app module and directory (default: this project's,
        ``settings.CONVEYOR["APP"]`` from the current directory). ``django=False`` for a
        deployment that is not this Django project (it is given the database by URL)."""
        given = conf.options()
        settings = conf.conveyor_settings()
        update: dict[str, Any] = {"app": app or given.get("APP") or settings.app}
        update["root"] = Path(root) if root is not None else settings.resolved_root()
        settings = settings.model_copy(update=update)
        extra = {"CONVEYOR_APP": settings.app, "CONVEYOR_DB_SCHEMA": settings.db_schema}
        if django:
            tests = {alias: str(connections[alias].settings_dict["NAME"]) for alias in connections}
            extra["CONVEYOR_TEST_DATABASES"] = json.dumps(tests)
        else:
            extra["DJANGO_SETTINGS_MODULE"] = ""  # keeps Celery's Django fixup off in it
        env = service_env(settings, extra)
        migrated = subprocess.run(
            [sys.executable, "-m", "conveyor", "db", "upgrade"],
            env=env, cwd=settings.resolved_root(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if migrated.returncode != 0:
            raise RuntimeError(
                f"conveyor db upgrade failed in {settings.resolved_root()}:\n{migrated.stderr}"
            )
        log = self.logs / f"worker-{len(self.procs)}.log"
        names = queues or [str(q) for q in given.get("QUEUES") or ["default"]]
        proc = start_worker(settings, queues=names, concurrency=concurrency, log_path=log, extra_env=extra)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout
        while " ready." not in (log.read_text() if log.exists() else ""):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        return proc

    def stop_all(self) -> None:
        """Warm shutdown of every worker started, together (SIGKILL after 30 s)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            stop(proc)


@pytest.fixture(scope="session")
def conveyor_workers(conveyor_database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Start workers with ``conveyor_workers.start(...)``; all are stopped at the end."""
    workers = Workers(tmp_path_factory.mktemp("conveyor-workers"))
    try:
        yield workers
    finally:
        workers.stop_all()


@pytest.fixture(scope="session")
def conveyor_worker(conveyor_workers: Workers) -> subprocess.Popen[bytes]:
    """A worker for this project's own stages (``settings.CONVEYOR["APP"]``)."""
    return conveyor_workers.start()
