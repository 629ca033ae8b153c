"""A Django site's own Celery app calls stages by name (tests/projects/cookiesite, laid out
as cookiecutter-django: settings in ``config/settings/``, ``config/celery_app.py``).

The site runs from its own directory, so its ``config`` package is the one imported (this
repository's ``config`` is never on its path); Conveyor's settings reach it through
``settings.CONVEYOR`` and ``DATABASES`` only: the environment's ``CONVEYOR_*`` point nowhere.
The test session's worker runs the jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from conveyor.client import registry
from tests.helpers import job_row

pytestmark = pytest.mark.timeout(120)

SITE = Path(__file__).resolve().parents[1] / "projects" / "cookiesite"


def site_env(platform: Any) -> dict[str, str]:
    settings = platform.settings
    db = make_url(settings.database_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "DJANGO_"))}
    env.pop("PYTHONPATH", None)
    env.update(
        SITE_DB_NAME=str(db.database),
        SITE_DB_USER=db.username or "",
        SITE_DB_PASSWORD=db.password or "",
        SITE_DB_HOST=db.host or "127.0.0.1",
        SITE_DB_PORT=str(db.port or 5432),
        SITE_REDIS_URL=str(settings.redis_url),
        # settings.CONVEYOR and DATABASES must win: these would fail every call.
        CONVEYOR_DATABASE_URL="postgresql://nobody@127.0.0.1:1/not_the_sites",
        CONVEYOR_REDIS_URL="redis://127.0.0.1:1/0",
    )
    if settings.broker_url:
        env["SITE_BROKER_URL"] = str(settings.broker_url)
    return env


def test_the_sites_own_celery_app_calls_a_stage_through_the_router(platform: Any, worker: Any) -> None:
    registry.write(platform.engine, platform.stages.values())
    done = subprocess.run(
        [sys.executable, "manage.py", "square", "7"],
        cwd=SITE,
        env=site_env(platform),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["result"] == {"n": 49}
    assert job_row(platform, report["id"])["queue"] == "demo"  # the router's queue, not `celery`
    assert report["status"] == "succeeded"  # conveyor.connect() inside Django: DATABASES
    assert report["database"] == make_url(platform.settings.database_url).database
    assert report["own_task_queue"] == "celery"
    assert report["refused"] and "did you mean 'conveyor.demo.square'?" in report["refused"]
    assert report["config"] == str(SITE / "config" / "__init__.py")
    assert report["deployment_modules"] == []
