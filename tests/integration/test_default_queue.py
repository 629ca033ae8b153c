"""Workers that consume Celery's default queue (``CONVEYOR_CONSUME_DEFAULT_QUEUE``): a plain
Celery caller with no route at all reaches the stages, and what is not a stage there is
left to the other Celery workers of that queue.

The caller of the last test is a script in a fresh venv with only ``celery[redis]``. The
queue ``celery`` lives in this session's own Redis DB (see conftest).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from conveyor.delivery.celeryconfig import CELERY_DEFAULT_QUEUE
from conveyor.store.db import schema as s
from conveyor.store.db.schema import dead_letters
from tests.helpers import eventually, job_row

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_broker]

PAUSE = 1.0  # default_queue_pause of the worker here
QUIET = ["--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "WARNING"]

SHOP_APP = """
import os
from celery import Celery

app = Celery("shop", broker=os.environ["SHOP_REDIS"], backend=os.environ["SHOP_REDIS"])


@app.task(name="shop.add")
def add(a, b):
    return a + b
"""

PLAIN_SCRIPT = """
import sys
from celery import Celery

app = Celery("shop", broker=sys.argv[1], backend=sys.argv[1])
result = app.send_task("conveyor.demo.square", kwargs={"n": 7})
print(result.id, result.get(timeout=60))
try:
    app.send_task("conveyor.demo.square", kwargs={"n": "seven"}).get(timeout=60)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] == "conveyor"))
"""


@pytest.fixture(scope="module")
def dq_worker(platform: Any) -> Iterator[Any]:
    """The in-process worker of conftest, consuming the default queue too (opt-in)."""
    from celery.contrib.testing.worker import start_worker

    before = platform.settings
    platform.settings = before.model_copy(
        update={"consume_default_queue": True, "default_queue_pause": PAUSE}
    )
    try:
        with start_worker(
            platform.app,
            pool="solo",
            concurrency=1,
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=30,
            queues=[q.name for q in platform.queues],
        ) as w:
            yield w
        platform.stop_background()
    finally:
        platform.settings = before
        platform.app.amqp.queues.deselect(CELERY_DEFAULT_QUEUE)
        platform.redis.delete(CELERY_DEFAULT_QUEUE)


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only ``celery[redis]``: a Celery user's, without Conveyor."""
    venv = tmp_path_factory.mktemp("plain") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "celery[redis]",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return venv


def _plain_env(platform: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "PYTHONPATH"}
    env["SHOP_REDIS"] = platform.settings.redis_url
    return env


def _plain_app(platform: Any) -> Celery:
    url = platform.settings.redis_url
    return Celery("shop", broker=url, backend=url, set_as_current=False)


def _waiting(platform: Any, task_id: str) -> list[dict[str, Any]]:
    """The messages of ``task_id`` waiting in the default queue, as stored."""
    raw = platform.redis.lrange(CELERY_DEFAULT_QUEUE, 0, -1)
    return [m for m in (json.loads(r) for r in raw) if m["headers"]["id"] == task_id]


def test_send_task_with_no_route_runs_from_the_default_queue(platform: Any, dq_worker: Any) -> None:
    app = _plain_app(platform)
    result = app.send_task("conveyor.demo.square", kwargs={"n": 3})
    assert result.get(timeout=30) == {"n": 9}
    row = job_row(platform, result.id)
    assert row["status"] == s.SUCCEEDED and row["queue"] == "demo"  # the stage's queue, for republishes
    app.close()


def test_a_task_that_is_not_a_stage_is_left_to_other_workers(
    platform: Any, dq_worker: Any, plain_venv: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.consumer")
    app = _plain_app(platform)
    result = app.send_task("shop.add", args=(2, 3))
    watched = 4 * PAUSE
    deadline = time.monotonic() + watched
    while time.monotonic() < deadline:  # taken and put back, never lost, never dead-lettered
        time.sleep(0.2)
    (message,) = eventually(lambda: _waiting(platform, result.id), timeout=10)
    assert message["headers"]["task"] == "shop.add"
    assert json.loads(base64.b64decode(message["body"]))[:2] == [[2, 3], {}]
    with platform.engine.connect() as conn:
        refused = conn.execute(select(dead_letters.c.id).where(dead_letters.c.stage == "shop.add")).all()
    assert refused == []
    left = [r for r in caplog.records if "left task 'shop.add'" in r.getMessage()]
    assert 1 <= len(left) <= watched / PAUSE + 2, len(left)  # at most once per pause: no hot loop

    (tmp_path / "shop.py").write_text(SHOP_APP)
    shop_worker = subprocess.Popen(
        [
            str(plain_venv / "bin" / "celery"),
            "-A",
            "shop",
            "worker",
            "-P",
            "solo",
            "-Q",
            CELERY_DEFAULT_QUEUE,
            *QUIET,
        ],
        cwd=tmp_path,
        env=_plain_env(platform),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert result.get(timeout=60) == 5  # served by the Celery worker it was meant for
    finally:
        os.killpg(shop_worker.pid, signal.SIGTERM)
        shop_worker.wait(timeout=30)
        app.close()


def test_a_plain_celery_script_with_only_celery_installed(
    platform: Any, dq_worker: Any, plain_venv: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [str(plain_venv / "bin" / "python"), "-c", PLAIN_SCRIPT, platform.settings.redis_url],
        cwd=tmp_path,
        env=_plain_env(platform),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    first, refused, loaded = done.stdout.splitlines()
    task_id, value = first.split(" ", 1)
    assert value == "{'n': 49}"
    assert refused.startswith("PayloadInvalid: invalid payload for conveyor.demo.square: n: "), refused
    assert "seven" not in refused
    assert loaded == "loaded: []"
    assert job_row(platform, task_id)["status"] == s.SUCCEEDED  # the job of the script's task id
