"""``manage.py conveyor migrate|worker|status``: Conveyor on Django's database and settings."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from sqlalchemy import func, select

from conveyor.contrib.django import conf
from conveyor.delivery.procs import service_env
from conveyor.logs import redact_text
from conveyor.store.db.engine import make_engine
from conveyor.store.db.migrate import pending, upgrade
from conveyor.store.db.namespace import table_exists
from conveyor.store.db.schema import dead_letters, jobs, stages


def _where(url: str | None, schema: str) -> str:
    return f"table prefix {schema}_" if (url or "").startswith("sqlite") else f"schema {schema}"


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type hints
    """The ``conveyor`` command of a project with ``conveyor.contrib.django`` installed."""

    help = (
        "migrate: Conveyor's tables in Django's database (the deployment's own migrations and "
        "stage registry when CONVEYOR['APP'] names one); worker ARGS: `conveyor worker ARGS` on "
        "Django's database; status: migrations, registered stages, jobs by status, dead letters"
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", choices=["migrate", "worker", "status"])
        parser.add_argument("args", nargs=argparse.REMAINDER, help="passed on to `conveyor worker`")

    def handle(self, *args: str, action: str, **__: Any) -> None:
        settings = conf.conveyor_settings()
        env = service_env(settings, {"CONVEYOR_APP": settings.app, "CONVEYOR_DB_SCHEMA": settings.db_schema})
        if action == "worker":
            os.execvpe(sys.executable, [sys.executable, "-m", "conveyor", "worker", *args], env)
        if action == "migrate":
            self._migrate(settings, env)
        else:
            self._status(settings)

    def _migrate(self, settings: Any, env: dict[str, str]) -> None:
        if "APP" in conf.options():
            done = subprocess.run([sys.executable, "-m", "conveyor", "db", "upgrade"], env=env, check=False)
            if done.returncode != 0:
                raise CommandError("conveyor db upgrade failed (see above)")
            return
        engine = make_engine(settings.database_url, schema=settings.db_schema)
        try:
            upgrade(engine)  # the platform's own tables; the deployment registers its stages
        finally:
            engine.dispose()
        where = _where(settings.database_url, settings.db_schema)
        self.stdout.write(f"Conveyor's tables are up to date ({where}).")

    def _status(self, settings: Any) -> None:
        engine = make_engine(settings.database_url, schema=settings.db_schema)
        try:
            with engine.connect() as conn:
                where = _where(settings.database_url, settings.db_schema)
                self.stdout.write(f"database  {redact_text(settings.database_url)} ({where})")
                if not table_exists(conn, jobs):
                    raise CommandError("Conveyor's tables do not exist: run `manage.py conveyor migrate`")
                behind = pending(engine)
                state = (
                    f"{len(behind)} to apply: run `manage.py conveyor migrate`" if behind else "up to date"
                )
                self.stdout.write(f"migrations {state}")
                registered = conn.execute(select(func.count()).select_from(stages)).scalar_one()
                self.stdout.write(f"stages    {registered} registered")
                counts = conn.execute(select(jobs.c.status, func.count()).group_by(jobs.c.status)).all()
                summary = ", ".join(f"{status} {n}" for status, n in sorted(counts)) or "none"
                self.stdout.write(f"jobs      {summary}")
                open_letters = conn.execute(
                    select(func.count()).select_from(dead_letters).where(dead_letters.c.retried_at.is_(None))
                ).scalar_one()
                self.stdout.write(f"dlq       {open_letters} open")
        finally:
            engine.dispose()
