"""A real Django project (tests/projects/djangoshop: settings package ``config``, its own
``config/celery_app.py``) runs its own pytest-django suite against real Postgres, Redis and
worker processes: it calls this deployment by name in and out of ``atomic()``, rolls back,
and runs its own stage on its own worker. Then ``manage.py conveyor`` migrates and reports."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.conftest import PG_BASE
from tests.helpers import scratch_database

pytestmark = pytest.mark.timeout(400)

REPO = Path(__file__).resolve().parents[2]
SHOP = REPO / "tests" / "projects" / "djangoshop"


def shop_env(db_name: str, home: Path) -> dict[str, str]:
    """The environment of a developer's shell: none of this suite's CONVEYOR_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "DJANGO_"))}
    env.pop("PYTHONPATH", None)
    env.update(
        SHOP_DB_NAME=db_name,
        SHOP_REDIS_URL=os.environ["CONVEYOR_REDIS_URL"],
        SHOP_TEST_REDIS_URL=os.environ["CONVEYOR_REDIS_URL"],
        SHOP_CONVEYOR_HOME=str(home),
        SHOP_DEPLOYMENT=str(REPO),
    )
    return env


def run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=SHOP, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_shops_own_pytest_django_suite_passes(tmp_path: Path) -> None:
    name = f"shop_{uuid.uuid4().hex[:8]}"
    try:
        done = run([sys.executable, "-m", "pytest", "-q", "-x"], shop_env(name, tmp_path))
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
        assert "11 passed" in done.stdout
    finally:
        with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "test_{name}" WITH (FORCE)')


def test_manage_py_conveyor_migrates_and_reports(tmp_path: Path) -> None:
    with scratch_database("shop") as url:
        env = shop_env(url.rsplit("/", 1)[1], tmp_path)
        migrated = run([sys.executable, "manage.py", "conveyor", "migrate"], env, timeout=120)
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        status = run([sys.executable, "manage.py", "conveyor", "status"], env, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "schema conveyor" in status.stdout and "1 registered" in status.stdout, status.stdout
        assert "jobs      none" in status.stdout and "dlq       0 open" in status.stdout
        assert "migrations up to date" in status.stdout


def test_djangos_own_test_runner(tmp_path: Path) -> None:
    """``manage.py test``: Conveyor's tables come with the test database (post_migrate) and
    the run ends without a connection left on it (Django drops it cleanly)."""
    name = f"shop_{uuid.uuid4().hex[:8]}"
    try:
        done = run([sys.executable, "manage.py", "test", "shop", "--noinput"], shop_env(name, tmp_path))
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-6000:]
        assert "Ran 2 tests" in output and "OK" in output
        assert "being accessed by other users" not in output
    finally:
        with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as admin:
            exists = admin.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (f"test_{name}",)
            ).fetchone()
            admin.execute(f'DROP DATABASE IF EXISTS "test_{name}" WITH (FORCE)')
        assert exists is None, "Django could not drop its test database"
