"""``conveyor serve`` as a real server process over real HTTP, with tokens made and revoked
by ``conveyor tokens``: a job submitted over HTTP is run by a worker and shown with its
result; nothing the server or the commands log holds a token's secret."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor.store.db import schema as s
from tests.integration.http_support import conveyor_cli, serving

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(platform: Any, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``conveyor serve`` on a free port: its base URL and its log file."""
    log = tmp_path / "serve.log"
    with serving(platform, log, {"CONVEYOR_LOG_FORMAT": "json", "CONVEYOR_LOG_LEVEL": "DEBUG"}) as (base, _):
        yield base, log
    assert "Finished server process" in log.read_text()


def test_serve_submit_run_show_cancel_revoke(
    server: tuple[str, Path], worker: Any, platform: Any, tag: str
) -> None:
    base, log = server
    owner = f"web-{tag}"
    created = conveyor_cli("tokens", "create", "--owner", owner, "--scope", "read", "--scope", "submit")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()  # the secret alone on stdout
    assert secret.startswith("cvy_") and "\n" not in secret and secret not in created.stderr
    token_id = secret.split("_")[1]
    listed = json.loads(conveyor_cli("tokens", "list", "--owner", owner, "--json").stdout)
    assert [t["id"] for t in listed] == [token_id] and listed[0]["scopes"] == ["read", "submit"]
    assert secret.split("_", 2)[2] not in json.dumps(listed)

    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=base, headers=headers, timeout=10) as http:
        assert (
            http.get("/openapi.json").json()["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        )
        made = http.post("/jobs", json={"stage": "conveyor.demo.square", "payload": {"n": 6}})
        assert made.status_code == 201, made.text
        job_id = made.json()["id"]
        assert platform.job(job_id).wait(30) == s.SUCCEEDED
        shown = http.get(f"/jobs/{job_id}").json()
        assert shown["status"] == s.SUCCEEDED and shown["result"] == {"n": 36} and shown["owner"] == owner
        later = http.post("/jobs", json={"stage": "conveyor.demo.square", "payload": {"n": 1}, "delay": 60})
        cancelled = http.post(f"/jobs/{later.json()['id']}/cancel", json={"reason": "not needed"})
        assert cancelled.json()["status"] == s.CANCELLED
        denied = http.post("/jobs", json={"stage": "conveyor.demo.sqare"})
        assert denied.headers["content-type"].startswith("application/problem+json")
        assert denied.json()["suggestions"] == ["conveyor.demo.square"]

        revoked = conveyor_cli("tokens", "revoke", token_id)
        assert revoked.returncode == 0 and "revoked" in revoked.stdout
        after = http.get(f"/jobs/{job_id}")
        assert after.status_code == 401 and after.json()["type"] == "urn:conveyor:problem:unauthorized"
        assert conveyor_cli("tokens", "revoke", "0000000000000000").returncode == 1

    text = log.read_text()
    assert f"/jobs/{job_id}" in text  # the access log went to Conveyor's renderer...
    assert secret.split("_", 2)[2] not in text  # ...and no secret anywhere in the logs
    assert all(json.loads(line) for line in text.splitlines() if line.startswith("{"))


def test_conveyor_stages_lists_what_a_client_may_submit(platform: Any) -> None:
    from conveyor.client import registry

    registry.write(platform.engine, platform.stages.values())
    listed = conveyor_cli("stages", "--json")
    assert listed.returncode == 0, listed.stderr
    by_name = {s["name"]: s for s in json.loads(listed.stdout)}
    square = by_name["conveyor.demo.square"]
    assert square["queue"] == "demo" and square["on_retry"] is False
    assert square["payload_schema"]["properties"]["n"]["type"] == "integer"
    table = conveyor_cli("stages")
    assert table.returncode == 0 and "conveyor.demo.square" in table.stdout
