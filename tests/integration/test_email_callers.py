"""The email family's callers: ``conveyor email …`` (a real process against the test
services) and ``/email/messages`` over HTTP. Bad input gets a clear answer and records
nothing; the same message again is the same job; another message under its id conflicts."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from conveyor.delivery.procs import service_env
from conveyor.store.db import schema as s
from conveyor.web import create_app, tokens
from pipelines.email.peers import SmtpPeer
from tasks.email import tables as t
from tests.helpers import job_row
from tests.integration.email_support import COMPANY, HTML, email_settings, message, outbox_row, smtp_at
from tests.integration.http_support import auth, problem

pytestmark = pytest.mark.timeout(180)


def conveyor(
    platform: Any, *args: str, email: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    env = service_env(platform.settings)
    env["CONVEYOR_EMAIL"] = json.dumps({"allow_test_domains": True, "pii_key": "k" * 32, **(email or {})})
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "email", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def page(tmp_path: Path) -> Path:
    path = tmp_path / "boleto.html"
    path.write_text(HTML, encoding="utf-8")
    return path


def _send_args(tag: str, page: Path, outbox_id: str, *extra: str) -> list[str]:
    return [
        "send",
        "--company", COMPANY,
        "--to", f"cliente.{tag}@empresa.test",
        "--subject", "Seu boleto",
        "--html-file", str(page),
        "--outbox-id", outbox_id,
        "--external-id", f"CUST-{tag}",
        *extra,
    ]  # fmt: skip


def test_cli_send_is_idempotent_refuses_conflicts_and_bad_input(platform: Any, page: Path, tag: str) -> None:
    outbox_id = str(uuid.uuid4())
    first = conveyor(
        platform, *_send_args(tag, page, outbox_id, "--priority", "2", "--delay", "3600", "--json")
    )
    assert first.returncode == 0, first.stderr
    sent = json.loads(first.stdout)
    assert sent == {"outbox_id": outbox_id, "job_id": outbox_id, "status": "PENDING", "deduplicated": False}
    assert job_row(platform, outbox_id)["priority"] == 9
    again = conveyor(
        platform, *_send_args(tag, page, outbox_id, "--priority", "2", "--delay", "3600", "--json")
    )
    assert again.returncode == 0 and json.loads(again.stdout)["deduplicated"] is True
    other = conveyor(platform, *_send_args(tag, page, outbox_id), "--tag", "changed")
    assert other.returncode == 1 and "conflict" in other.stderr and tag not in other.stderr
    bad_id = str(uuid.uuid4())
    bad = conveyor(platform, *_send_args(tag, page, bad_id), "--cc", "nope")
    assert bad.returncode == 1 and "cc" in bad.stderr and "nope" not in bad.stderr
    assert outbox_row(platform, bad_id) is None and job_row(platform, bad_id) is None
    shown = conveyor(platform, "show", outbox_id, "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["to"] == "c***@e***.test"
    assert tag not in shown.stdout
    listed = conveyor(platform, "list", "--status", "PENDING", "--json")
    assert outbox_id in {r["outbox_id"] for r in json.loads(listed.stdout)} and tag not in listed.stdout
    assert conveyor(platform, "list", "--status", "NOPE").returncode == 1
    platform.cancel(outbox_id)


def test_cli_hashes_a_cpf_with_the_key_and_refuses_one_without_it(
    platform: Any, page: Path, tag: str
) -> None:
    outbox_id = str(uuid.uuid4())
    digits = "52998224725"
    sent = conveyor(platform, *_send_args(tag, page, outbox_id, "--cpf-cnpj", digits, "--delay", "3600"))
    assert sent.returncode == 0, sent.stderr
    stored = job_row(platform, outbox_id)["payload"]["recipient"]["cpfCnpjHash"]
    assert len(stored) == 64 and digits not in json.dumps(job_row(platform, outbox_id)["payload"])
    platform.cancel(outbox_id)
    keyless = conveyor(
        platform, *_send_args(tag, page, str(uuid.uuid4()), "--cpf-cnpj", digits), email={"pii_key": None}
    )
    assert keyless.returncode == 1 and "pii_key" in keyless.stderr and digits not in keyless.stderr


@pytest.fixture(scope="module")
def http(platform: Any) -> Iterator[TestClient]:
    import conveyor as c

    client = c.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    from pipelines.email.http import router

    with TestClient(create_app(client, routers=[router])) as api:
        yield api
    client.close()


def test_http_send_show_and_resolve(platform: Any, worker: Any, http: TestClient, tag: str) -> None:
    owner = f"mailer-{tag}"
    submit = tokens.create(platform.engine, owner=owner, scopes=["submit", "read"]).secret
    stranger = tokens.create(platform.engine, owner=f"other-{tag}", scopes=["read"]).secret
    admin = tokens.create(platform.engine, owner="ops", scopes=["admin", "read"]).secret
    data = message(tag)
    with SmtpPeer(drop_at_data=True) as smtp, email_settings(platform, **smtp_at(smtp.port)):
        made = http.post("/email/messages", json={**data, "html": HTML}, headers=auth(submit))
        assert made.status_code == 201, made.text
        outbox_id = made.json()["outbox_id"]
        again = http.post(
            "/email/messages", json={**data, "html": HTML, "requestId": "x"}, headers=auth(submit)
        )
        assert again.status_code == 200 and again.json()["deduplicated"] is True
        conflict = http.post("/email/messages", json={**data, "html": HTML + "!"}, headers=auth(submit))
        assert problem(conflict, 409, "idempotency-conflict")["job_id"] == outbox_id
        bad = problem(
            http.post("/email/messages", json={**message(tag, to="x"), "html": HTML}, headers=auth(submit)),
            422,
        )
        assert "to" in bad["detail"] and tag not in json.dumps(bad)
        assert platform.job(outbox_id).wait(30) == s.DEAD  # the reply was lost: held UNKNOWN
    sender = tokens.create(platform.engine, owner=f"other-{tag}", scopes=["submit"]).secret
    for body in ({**data, "html": HTML}, {**data, "html": HTML + "?"}):  # same message, or another
        hidden = problem(http.post("/email/messages", json=body, headers=auth(sender)), 409)
        assert hidden["type"].endswith("duplicate-of-another-owner") and "status" not in hidden.get(
            "detail", ""
        )
    shown = http.get(f"/email/messages/{outbox_id}", headers=auth(submit))
    assert shown.status_code == 200 and shown.json()["status"] == t.UNKNOWN and tag not in shown.text
    problem(http.get(f"/email/messages/{outbox_id}", headers=auth(stranger)), 404)
    problem(
        http.post(f"/email/messages/{outbox_id}/resolve", json={"delivered": True}, headers=auth(submit)), 403
    )
    settled = http.post(f"/email/messages/{outbox_id}/resolve", json={"delivered": True}, headers=auth(admin))
    assert settled.status_code == 200 and settled.json()["status"] == t.SENT
    problem(
        http.post(f"/email/messages/{outbox_id}/resolve", json={"delivered": True}, headers=auth(admin)), 409
    )
