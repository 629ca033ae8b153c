"""A real Flask app (``tests/projects/flaskapp``: Flask-SQLAlchemy, a top-level ``config.py``)
calls Conveyor through ``conveyor.contrib.flask``: run from its own directory with this
repository (and its ``config`` package) on the path too, on a Postgres database of its own,
with the test worker running its jobs. Its settings reach Conveyor through ``app.config``
only: the environment's ``CONVEYOR_*`` point nowhere."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from config.migrations import upgrade
from conveyor.client import registry
from conveyor.store.db import schema as s
from conveyor.store.db.engine import make_engine
from conveyor.web import tokens
from tests.helpers import bound_to, effect_count, eventually, job_row, scratch_database

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
SHOP = ROOT / "tests" / "projects" / "flaskapp"


@pytest.fixture(scope="module")
def shop_db(platform: Any) -> Iterator[str]:
    """The shop's database: Conveyor migrated into it (``conveyor db upgrade``)."""
    with scratch_database("conveyor_flask") as url:
        engine = make_engine(url, pool_size=1)
        try:
            upgrade(engine)
            registry.write(engine, platform.stages.values())
        finally:
            engine.dispose()
        yield url


def shop_env(platform: Any, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(
        SHOP_DATABASE_URL=url,
        SHOP_REDIS_URL=str(platform.settings.redis_url),
        # app.config must win: these would fail every submit.
        CONVEYOR_DATABASE_URL="postgresql://nobody@127.0.0.1:1/not_the_shops",
        CONVEYOR_REDIS_URL="redis://127.0.0.1:1/0",
        PYTHONPATH=str(ROOT),  # the deployment's `config` package is importable as well
    )
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def shop(platform: Any, shop_db: str) -> Iterator[str]:
    """``flask --app shop run`` (threaded dev server); yields its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", "shop", "run", "--port", str(port), "--no-reload"],
        cwd=SHOP,
        env=shop_env(platform, shop_db),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the shop exited: {proc.stderr.read() if proc.stderr else ''}")
            try:
                requests.get(f"{base}/health", timeout=1)
                break
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_shop_loads_its_own_config_py(shop: str) -> None:
    assert requests.get(f"{shop}/health", timeout=5).json() == {"config": str(SHOP / "config.py")}


def test_an_order_and_its_job_commit_together_and_a_worker_runs_it(
    shop: str, shop_db: str, platform: Any, worker: Any
) -> None:
    with bound_to(platform, shop_db):
        created = requests.post(f"{shop}/orders", json={"n": 7}, timeout=10)
        assert created.status_code == 201, created.text
        order = created.json()

        def done() -> Any:
            body = requests.get(f"{shop}/orders/{order['order_id']}", timeout=10).json()
            return body if body["status"] in s.TERMINAL else None

        assert eventually(done, timeout=30) == {
            "order_id": order["order_id"],
            "status": "succeeded",
            "result": {"n": 49},
        }
        assert job_row(platform, order["job_id"])["label"] == f"order {order['order_id']}"

        refused = requests.post(f"{shop}/orders", json={"n": 8, "fail": True}, timeout=10)
        assert refused.status_code == 409
        gone = refused.json()
        assert requests.get(f"{shop}/orders/{gone['order_id']}", timeout=10).status_code == 404
        assert job_row(platform, gone["job_id"]) is None


def test_a_rolled_back_savepoint_drops_its_job_only(
    shop: str, shop_db: str, platform: Any, worker: Any, tag: str
) -> None:
    with bound_to(platform, shop_db):
        response = requests.post(f"{shop}/notes", json={"keep": tag, "drop": tag + "-x"}, timeout=10)
        assert response.status_code == 201, response.text
        ids = response.json()
        assert platform.job(ids["kept"]).wait(30) == s.SUCCEEDED
        assert effect_count(platform, note=tag) == 1
        assert job_row(platform, ids["dropped"]) is None and effect_count(platform, note=tag + "-x") == 0


def test_the_mounted_http_api_submits_and_shows_jobs_beside_the_shops_routes(
    shop: str, shop_db: str, platform: Any, worker: Any
) -> None:
    """``mount_api(app, "/conveyor")`` in the shop: the API on the extension's client (the
    shop's database from app.config, not the environment's), under the prefix."""
    engine = make_engine(shop_db, pool_size=1)
    try:
        secret = tokens.create(engine, owner="shop", scopes=("read", "submit")).secret
    finally:
        engine.dispose()
    bearer = {"Authorization": f"Bearer {secret}"}
    api = f"{shop}/conveyor"
    with bound_to(platform, shop_db):
        created = requests.post(
            f"{api}/jobs",
            json={"stage": "conveyor.demo.square", "payload": {"n": 6}},
            headers=bearer,
            timeout=10,
        )
        assert created.status_code == 201, created.text
        job = created.json()
        assert created.headers["Location"] == f"/conveyor/jobs/{job['id']}" and job["owner"] == "shop"

        def finished() -> Any:
            shown = requests.get(f"{shop}{created.headers['Location']}", headers=bearer, timeout=10)
            assert shown.status_code == 200, shown.text
            return shown.json() if shown.json()["status"] in s.TERMINAL else None

        done = eventually(finished, timeout=30)
        assert done["status"] == "succeeded" and done["result"] == {"n": 36}
        assert "job.succeeded" in [e["topic"] for e in done["events"]]

        # Server-Sent Events pass through the WSGI server as they are written.
        with requests.get(
            f"{api}/events/stream", params={"job": job["id"]}, headers=bearer, stream=True, timeout=10
        ) as stream:
            assert stream.status_code == 200 and stream.headers["Content-Type"].startswith(
                "text/event-stream"
            )
            topics: list[str] = []
            for line in stream.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    topics.append(line.removeprefix("event: "))
                if "job.succeeded" in topics:
                    break
            assert topics[0] == "job.submitted"

    refused = requests.post(f"{api}/jobs", json={"stage": "conveyor.demo.square"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["instance"] == "/conveyor/jobs"
    assert requests.get(f"{api}/health", timeout=10).json() == {"status": "ok"}
    assert requests.get(f"{shop}/health", timeout=5).json() == {"config": str(SHOP / "config.py")}
    assert requests.get(f"{shop}/orders/0", timeout=5).status_code == 404  # the shop's own 404 page
    assert "/conveyor/openapi.json" in requests.get(f"{api}/docs", timeout=10).text


def test_listeners_stay_constant_over_a_thousand_requests(platform: Any, shop_db: str) -> None:
    done = subprocess.run(
        [sys.executable, "listeners.py", "1000"],
        cwd=SHOP,
        env=shop_env(platform, shop_db),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["config"] == str(SHOP / "config.py")
    assert counts["last"] == counts["first"]
    assert counts["statuses"] == {"201": 500, "409": 500}
    # Conveyor's own: at most one each on commit, savepoint rollback and transaction end.
    added = {k: counts["first"][k] - counts["before"][k] for k in counts["first"]}
    assert sum(added.values()) <= 6 and max(added.values()) <= 1, added
