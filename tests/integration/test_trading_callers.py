"""The trading family's callers: ``/trading/…`` over HTTP (the app in process) and
``conveyor trading …`` (a real process) against the test services. A bad payload is 422
naming the field and records nothing; a connection is kept encrypted and shows in the user's
standing, the token never answered back; the same import while pending is that job. No
worker runs here: the jobs stay pending (the stages' own tests run them)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from conveyor.delivery.procs import service_env
from conveyor.store.db import schema as s
from conveyor.web import create_app, tokens
from tasks.trading import tables as t
from tests.integration.http_support import auth, problem

pytestmark = pytest.mark.timeout(180)
IMPORTS = "/trading/imports"
SCORES = "/trading/scores"
SINCE = "2026-01-05"


@pytest.fixture(scope="module")
def http(platform: Any) -> Iterator[TestClient]:
    import conveyor as c

    client = c.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    from pipelines.trading.http import router

    with TestClient(create_app(client, routers=[router])) as api:
        yield api
    client.close()


def token(platform: Any, owner: str, *scopes: str) -> dict[str, str]:
    return auth(tokens.create(platform.engine, owner=owner, scopes=scopes or ("read", "submit")).secret)


def jobs_of(platform: Any, tag: str) -> list[Any]:
    """The trading jobs whose label names ``tag`` (``import <userId>``, ``score <userId>``)."""
    with platform.engine.connect() as conn:
        return list(conn.execute(select(s.jobs).where(s.jobs.c.label.contains(tag))).mappings())


def sealed_token(platform: Any, user: str, broker: str) -> str | None:
    with platform.engine.connect() as conn:
        query = select(t.connections.c.token_enc).where(
            t.connections.c.user_id == user, t.connections.c.broker == broker
        )
        found = conn.execute(query).scalar_one_or_none()
    return None if found is None else str(found)


def conveyor(platform: Any, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "trading", *args],
        env=service_env(platform.settings),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_bad_payload_is_422_naming_the_field_and_records_nothing(
    platform: Any, http: TestClient, tag: str
) -> None:
    me = token(platform, f"trader-{tag}")
    cases = [
        (IMPORTS, {"userId": f"{tag}@example.com"}, "body.userId"),
        (IMPORTS, {"userId": ".."}, "body.userId"),
        (IMPORTS, {"userId": tag, "sinceIso": "2025-13-01"}, "body.sinceIso"),
        (IMPORTS, {"userId": tag, "sinceIso": "05/01/2026"}, "body.sinceIso"),
        (IMPORTS, {"userId": tag, "broker": "kraken"}, "body.broker"),
        (IMPORTS, {"userId": tag, "since": SINCE}, "body.since"),
        (IMPORTS, {"sinceIso": SINCE}, "body.userId"),
        (SCORES, {"userId": tag, "broker": "coinbase"}, "body.broker"),
        (SCORES, {"userId": tag, "sinceIso": 20260105}, "body.sinceIso"),
    ]
    for path, body, field in cases:
        resp = http.post(path, json=body, headers=me)
        got = problem(resp, 422)
        assert field in {e["field"] for e in got["errors"]}, (body, got)
        assert "example.com" not in resp.text
    assert jobs_of(platform, tag) == []
    assert (
        http.post(IMPORTS, json={"userId": tag}, headers=token(platform, f"reader-{tag}", "read")).status_code
        == 403
    )
    assert http.post(IMPORTS, json={"userId": tag}).status_code == 401
    assert jobs_of(platform, tag) == []


def test_connect_keeps_the_token_encrypted_and_the_standing_shows_the_broker(
    platform: Any, http: TestClient, tag: str
) -> None:
    me = token(platform, f"trader-{tag}")
    secret = f"tok-{tag}-Zq9"
    path = f"/trading/users/{tag}/connections/coinbase"
    done = http.put(path, json={"token": secret}, headers=me)
    assert done.status_code == 204 and done.content == b"", done.text
    stored = sealed_token(platform, tag, "coinbase")
    assert stored is not None and secret not in stored

    shown = http.get(f"/trading/users/{tag}", headers=token(platform, f"trader-{tag}", "read"))
    assert shown.status_code == 200, shown.text
    assert shown.json() == {
        "userId": tag,
        "brokers": ["coinbase"],
        "trades": 0,
        "rejected": 0,
        "tags": 0,
        "reflect_events": 0,
    }
    assert secret not in shown.text

    # Refused, nothing kept, the token never in the answer.
    assert "body.token" in {
        e["field"] for e in problem(http.put(path, json={"token": "a b"}, headers=me), 422)["errors"]
    }
    refused = http.put(path, json={"token": secret, "extra": 1}, headers=me)
    assert problem(refused, 422) and secret not in refused.text
    binance = http.put(f"/trading/users/{tag}/connections/kraken", json={"token": secret}, headers=me)
    assert problem(binance, 422) and secret not in binance.text
    by_mail = http.put(
        f"/trading/users/{tag}@example.com/connections/coinbase", json={"token": secret}, headers=me
    )
    assert problem(by_mail, 422) and secret not in by_mail.text
    assert sealed_token(platform, f"{tag}@example.com", "coinbase") is None
    assert problem(http.get("/trading/users/a@b.c", headers=me), 422)
    reader = token(platform, f"reader-{tag}", "read")
    assert http.put(path, json={"token": secret}, headers=reader).status_code == 403
    assert sealed_token(platform, tag, "coinbase") == stored  # unchanged by the refusals
    assert http.get(f"/trading/users/{tag}", headers=me).json()["brokers"] == ["coinbase"]


def test_an_import_again_while_pending_is_that_job(platform: Any, http: TestClient, tag: str) -> None:
    owner = f"trader-{tag}"
    me = token(platform, owner)
    body = {"userId": tag, "sinceIso": SINCE, "broker": "coinbase"}
    first = http.post(IMPORTS, json=body, headers=me)
    assert first.status_code == 202, first.text
    made = first.json()
    assert made["deduplicated"] is False and made["status"] == s.QUEUED
    assert first.headers["Location"].endswith(f"/jobs/{made['job_id']}")
    again = http.post(IMPORTS, json=body, headers=me)
    assert again.status_code == 202 and again.json() == {**made, "deduplicated": True}
    # Another window is another import; the dedup key is over the fields as submitted.
    other = http.post(IMPORTS, json={"userId": tag, "sinceIso": SINCE}, headers=me).json()
    assert other["job_id"] != made["job_id"] and other["deduplicated"] is False
    # Another owner's pending job is not this caller's to see.
    theirs = http.post(IMPORTS, json=body, headers=token(platform, f"other-{tag}"))
    assert problem(theirs, 409)["type"].endswith("duplicate-of-another-owner")

    score = http.post(SCORES, json={"userId": tag, "sinceIso": SINCE}, headers=me)
    assert score.status_code == 202 and score.json()["deduplicated"] is False
    assert http.post(SCORES, json={"userId": tag, "sinceIso": SINCE}, headers=me).json() == {
        **score.json(),
        "deduplicated": True,
    }
    rows = {r["id"]: r for r in jobs_of(platform, tag)}
    assert set(rows) == {made["job_id"], other["job_id"], score.json()["job_id"]}
    assert {r["owner"] for r in rows.values()} == {owner}
    assert {rows[made["job_id"]]["stage"], rows[score.json()["job_id"]]["stage"]} == {
        "conveyor.trading.import_trades",
        "conveyor.trading.score_bias",
    }
    for job_id in rows:
        platform.cancel(job_id)


def test_a_user_is_only_the_connecting_owners(platform: Any, http: TestClient, tag: str) -> None:
    mine, theirs = token(platform, f"trader-{tag}"), token(platform, f"other-{tag}")
    path = f"/trading/users/{tag}/connections/coinbase"
    assert http.put(path, json={"token": f"tok-{tag}"}, headers=mine).status_code == 204
    stored = sealed_token(platform, tag, "coinbase")
    # Another owner learns nothing and changes nothing: 404, as for a user never seen.
    assert problem(http.get(f"/trading/users/{tag}", headers=theirs), 404)
    assert problem(http.put(path, json={"token": f"stolen-{tag}"}, headers=theirs), 404)
    assert sealed_token(platform, tag, "coinbase") == stored
    assert problem(http.post(IMPORTS, json={"userId": tag}, headers=theirs), 404)
    assert problem(http.post(SCORES, json={"userId": tag}, headers=theirs), 404)
    assert jobs_of(platform, tag) == []
    admin = token(platform, f"ops-{tag}", "admin")
    assert http.get(f"/trading/users/{tag}", headers=admin).json()["brokers"] == ["coinbase"]
    # A user nobody connected is anyone's to connect (then theirs).
    fresh = f"{tag}-new"
    assert (
        http.put(
            f"/trading/users/{fresh}/connections/binance", json={"token": "x"}, headers=theirs
        ).status_code
        == 204
    )
    assert problem(http.get(f"/trading/users/{fresh}", headers=mine), 404)


def test_cli_connects_from_stdin_and_shows_the_standing(platform: Any, tag: str) -> None:
    secret = f"cli-{tag}-Xy7"
    done = conveyor(
        platform, "connect", "--user", tag, "--broker", "binance", "--token-stdin", stdin=secret + "\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"connected user={tag} broker=binance"
    stored = sealed_token(platform, tag, "binance")
    assert stored is not None and secret not in stored

    shown = conveyor(platform, "status", "--user", tag, "--json")
    assert shown.returncode == 0, shown.stderr
    standing = json.loads(shown.stdout)
    assert {k: standing[k] for k in ("trades", "rejected", "tags", "reflect_events")} == dict.fromkeys(
        ("trades", "rejected", "tags", "reflect_events"), 0
    )
    assert standing["brokers"] == ["binance"]

    # Refusals: exit 2, one line naming the field, never the token, nothing kept.
    bad = conveyor(
        platform,
        "connect",
        "--user",
        f"{tag}@example.com",
        "--broker",
        "binance",
        "--token-stdin",
        stdin=secret,
    )
    assert bad.returncode == 2 and "userId" in bad.stderr and secret not in bad.stderr + bad.stdout
    assert "Traceback" not in bad.stderr
    assert sealed_token(platform, f"{tag}@example.com", "binance") is None
    argv = conveyor(platform, "connect", "--user", tag, "--broker", "binance", stdin=secret)
    assert argv.returncode == 2 and "--token-stdin" in argv.stderr


def test_cli_import_prints_the_job_and_refuses_a_bad_day(platform: Any, tag: str) -> None:
    first = conveyor(platform, "import", "--user", tag, "--since", SINCE, "--json")
    assert first.returncode == 0, first.stderr
    made = json.loads(first.stdout)
    assert made == {"job": made["job"], "status": s.QUEUED, "deduplicated": False, "result": None}
    # No worker here: the wait ends with the job still queued (exit 1), counts 0.
    waited = conveyor(platform, "import", "--user", tag, "--since", SINCE, "--wait", "0.5")
    assert waited.returncode == 1, waited.stderr
    assert waited.stdout.strip() == f"job={made['job']} status=queued fetched=0 stored=0 rejected=0"
    again = conveyor(platform, "import", "--user", tag, "--since", SINCE)
    assert again.returncode == 0 and again.stdout.strip() == f"job={made['job']} status=queued deduplicated"

    bad = conveyor(platform, "import", "--user", tag, "--since", "2025-13-01")
    assert bad.returncode == 2 and "sinceIso" in bad.stderr and "Traceback" not in bad.stderr
    assert [r["id"] for r in jobs_of(platform, tag)] == [made["job"]]
    platform.cancel(made["job"])


def test_an_app_submitting_by_name_joins_its_transaction_and_shares_the_seed_ids(
    platform: Any, tag: str
) -> None:
    """An app with no stage code (a Node-like producer, a Flask view) submits the seed's
    payloads by name: inside its own transaction (a rollback records nothing), with the
    same deterministic dedup key as the deployment's own submit."""
    from sqlalchemy.orm import Session

    import conveyor as c
    from conveyor.client import registry
    from pipelines.trading.jobs import submit_import

    registry.write(platform.engine, platform.stages.values())
    client = c.connect(database_url=platform.settings.database_url, redis_url=platform.settings.redis_url)
    payload = {"userId": tag, "sinceIso": SINCE, "broker": "binance"}
    try:
        with Session(platform.engine) as session:
            dropped = client.submit("conveyor.trading.import_trades", payload, session=session)
            session.rollback()
        assert jobs_of(platform, tag) == []
        with pytest.raises(c.PayloadInvalid, match="userId"):
            client.submit("conveyor.trading.import_trades", {**payload, "userId": "x@y.z"})
        with Session(platform.engine) as session:
            kept = client.submit("conveyor.trading.import_trades", payload, session=session)
            session.commit()
        assert kept.id != dropped.id
        ours = submit_import(platform, tag, since=SINCE, broker="binance")
        assert ours.id == kept.id and ours.deduplicated
        again = client.submit("conveyor.trading.import_trades", payload)
        assert again.id == kept.id and again.deduplicated
    finally:
        for row in jobs_of(platform, tag):
            platform.cancel(row["id"])
        client.close()


def test_two_owners_connecting_one_new_user_at_once_one_wins_whole(platform: Any, tag: str) -> None:
    import threading

    from pipelines.trading.jobs import UserOfAnotherOwner, connect_broker, user_owner

    for i in range(8):
        user = f"{tag}-race-{i}"
        gate = threading.Barrier(2)
        outcome: dict[str, str] = {}

        def connect(
            owner: str, user: str = user, gate: threading.Barrier = gate, outcome: dict[str, str] = outcome
        ) -> None:
            gate.wait()
            try:
                connect_broker(platform, user, "coinbase", f"tok-{owner}", owner=owner)
                outcome[owner] = "connected"
            except UserOfAnotherOwner:
                outcome[owner] = "refused"

        threads = [threading.Thread(target=connect, args=(who,)) for who in ("alice", "bob")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(outcome.values()) == ["connected", "refused"], outcome
        [winner] = [who for who, what in outcome.items() if what == "connected"]
        assert user_owner(platform, user) == (True, winner)
        from tasks.trading.settings import trading_settings_of
        from tasks.trading.tokens import fernet, read_token

        box = fernet(trading_settings_of(platform.settings), platform.settings.resolved_home())
        with platform.engine.connect() as conn:
            assert read_token(conn, box, user, "coinbase") == f"tok-{winner}"  # the winner's token, whole
