"""The HTTP API's contract: schemathesis (``st run``, settings in schemathesis.toml here)
against ``conveyor serve`` on a database migrated fresh, every operation of the served
document but the SSE stream and uploads, in all its phases: the document's examples,
coverage (boundary and invalid values), fuzzing, and stateful sequences following the
document's links (a submitted job's id to show and cancel it). No answer may be a 5xx, or
break the document (status, content type, schema, headers).

The run is bounded by examples (``max-examples``, ``max-steps``) and killed past
:data:`BUDGET` seconds. Jobs stay queued: nothing consumes the Redis DB the server gets.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, insert, select

from config.migrations import upgrade
from conveyor.client import registry
from conveyor.store.db import schema as s
from conveyor.store.db.engine import make_engine
from conveyor.web import tokens
from tests.helpers import scratch_database, scratch_redis
from tests.integration.http_support import serving

BUDGET = 240  # seconds: the whole run, hard (the issue allows five minutes)
pytestmark = [pytest.mark.contract, pytest.mark.timeout(BUDGET + 90)]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the run starts here: schemathesis.toml names its hooks from the root
ST = str(Path(sys.executable).parent / "st")
JSON = "application/json"
# Tested elsewhere (schemathesis.toml disables them too, for a run by hand).
STREAM = "/events/stream"


@dataclass(frozen=True)
class Live:
    base: str
    env: dict[str, str]
    log: Path


def dead_letter(conn: Any, i: int) -> None:
    """An entry as a dead-lettering worker writes it (no job: a retry is refused 409)."""
    conn.execute(
        insert(s.dead_letters).values(
            job_id=None,
            stage="conveyor.demo.square",
            queue="demo",
            label=f"contract {i}",
            error_type="ValueError",
            message="seeded by the contract run",
            traceback="Traceback (most recent call last): ...",
            attempts=1,
            headers={"i": i},
            created_at=func.now(),
        )
    )


@contextmanager
def dead_letters_arriving(url: str, keep: int = 5) -> Iterator[None]:
    """Entries arriving while the run lasts (at least ``keep`` open), so that the dead-letter
    operations have entries to list, show and retry whatever the run purged before."""
    engine = make_engine(url, pool_size=1)
    done = threading.Event()

    def top_up() -> None:
        i = 0
        while not done.wait(0.25):
            with engine.begin() as conn:
                open_ = (
                    select(func.count())
                    .select_from(s.dead_letters)
                    .where(s.dead_letters.c.retried_at.is_(None))
                )
                for _ in range(keep - conn.execute(open_).scalar_one()):
                    dead_letter(conn, i := i + 1)

    thread = threading.Thread(target=top_up, name="dead-letters", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)
        engine.dispose()


@pytest.fixture(scope="module")
def live(platform: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """``conveyor serve`` on a new database (migrated, the stage registry written) and a Redis
    DB of its own, with a read+submit token and an admin token in the run's environment."""
    tmp = tmp_path_factory.mktemp("contract")
    with scratch_database("conveyor_contract") as url, scratch_redis() as redis_url:
        engine = make_engine(url, pool_size=1)
        try:
            upgrade(engine)
            registry.write(engine, platform.stages.values())
            user = tokens.create(engine, owner="contract", scopes=["read", "submit"], name="schemathesis")
            admin = tokens.create(engine, owner="contract-admin", scopes=["admin"], name="schemathesis")
        finally:
            engine.dispose()
        log = tmp / "serve.log"
        service = {"CONVEYOR_DATABASE_URL": url, "CONVEYOR_REDIS_URL": redis_url}
        with serving(platform, log, service) as (base, _), dead_letters_arriving(url):
            env = {
                **os.environ,
                "CONVEYOR_CONTRACT_TOKEN": user.secret,
                "CONVEYOR_CONTRACT_ADMIN_TOKEN": admin.secret,
                "NO_COLOR": "1",
            }
            yield Live(base, env, log)


def uploads(document: dict[str, Any]) -> list[str]:
    """The operations (``METHOD /path``) whose body is not JSON: files, forms."""
    found = []
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            content = operation.get("requestBody", {}).get("content", {})
            if set(content) - {JSON} or path.endswith("/files"):
                found.append(f"{method.upper()} {path}")
    return found


def reported(junit: Path) -> set[str]:
    """The operations a JUnit report of ``st run`` has a test case of."""
    return {case.get("name", "") for case in ET.parse(junit).getroot().iter("testcase")}


def test_the_api_keeps_its_documented_contract(live: Live, tmp_path: Path) -> None:
    document = httpx.get(f"{live.base}/openapi.json", timeout=10).json()
    excluded = uploads(document)
    expected = {
        f"{method.upper()} {path}"
        for path, operations in document["paths"].items()
        for method in operations
        if path != STREAM
    } - set(excluded)
    junit = tmp_path / "junit.xml"
    command = [
        ST,
        "--config-file",
        str(HERE / "schemathesis.toml"),
        "run",
        f"{live.base}/openapi.json",
        "--report",
        "junit",
        "--report-junit-path",
        str(junit),
        *[arg for name in excluded for arg in ("--exclude-name", name)],
        # A deeper run by hand: CONVEYOR_CONTRACT_ARGS="--seed 7 --max-examples 200".
        *shlex.split(os.environ.get("CONVEYOR_CONTRACT_ARGS", "")),
    ]
    started = time.monotonic()
    try:
        run = subprocess.run(
            command, cwd=ROOT, env=live.env, capture_output=True, text=True, timeout=BUDGET, check=False
        )
    except subprocess.TimeoutExpired as exc:  # killed: a hard budget
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"the contract run took over {BUDGET} s:\n{out[-20000:]}")
    took = time.monotonic() - started
    report = f"{run.stdout}\n{run.stderr}\n(took {took:.0f} s)"
    print(report[-4000:])
    assert run.returncode == 0, report[-20000:]
    assert "Stateful" in run.stdout, report[-4000:]
    assert expected <= reported(junit), f"untested: {sorted(expected - reported(junit))}\n{report[-4000:]}"
    assert "Traceback" not in live.log.read_text(), live.log.read_text()[-5000:]
