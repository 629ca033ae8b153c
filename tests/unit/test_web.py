"""The HTTP API without services: its OpenAPI document (served, and kept in the repository),
problem details for what nothing else handles, owner names and token scopes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conveyor.errors import OwnerInvalid, ScopeInvalid
from conveyor.owners import callers_key, checked_owner, owned_key
from conveyor.settings import ConveyorSettings
from conveyor.tokens import checked_scopes
from conveyor.web import create_app
from conveyor.web.server import openapi_document

KEPT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
REGENERATE = "conveyor openapi --output docs/openapi.json"


def test_the_kept_openapi_document_is_the_served_one() -> None:
    with TestClient(create_app(ConveyorSettings())) as http:
        served = http.get("/openapi.json").json()
    assert json.loads(KEPT.read_text()) == served, f"docs/openapi.json is stale: run `{REGENERATE}`"
    assert KEPT.read_text() == openapi_document(), f"docs/openapi.json is not formatted: run `{REGENERATE}`"


def test_the_document_declares_bearer_auth_and_problem_details() -> None:
    doc = json.loads(openapi_document())
    assert doc["components"]["securitySchemes"]["bearer"] == {
        **doc["components"]["securitySchemes"]["bearer"],
        "type": "http",
        "scheme": "bearer",
    }
    operations = [(p, m, op) for p, ops in doc["paths"].items() for m, op in ops.items()]
    assert {(p, m) for p, m, _ in operations} == {
        ("/jobs", "post"),
        ("/jobs/{job_id}", "get"),
        ("/jobs/{job_id}/cancel", "post"),
        ("/jobs/dry-run", "post"),
        ("/dead-letters", "get"),
        ("/dead-letters/{entry_id}", "get"),
        ("/dead-letters/{entry_id}/retry", "post"),
        ("/dead-letters/retry", "post"),
        ("/dead-letters/purge", "post"),
        ("/events", "get"),
        ("/events/stream", "get"),
        ("/health", "get"),
    }
    for path, _, op in operations:
        assert (op.get("security") == [{"bearer": []}]) == (path != "/health")
        for status, answer in op["responses"].items():
            if int(status) >= 400:
                assert list(answer["content"]) == ["application/problem+json"]
        if path != "/health":
            assert {"401", "403"} <= set(op["responses"])


def test_an_unexpected_error_is_a_500_problem_saying_nothing_more() -> None:
    app = create_app(ConveyorSettings())

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internals")

    with TestClient(app, raise_server_exceptions=False) as http:
        resp = http.get("/boom")
    assert resp.status_code == 500 and resp.headers["content-type"] == "application/problem+json"
    assert "secret" not in resp.text and resp.json()["title"] == "Internal Server Error"


def test_owner_names_and_their_idempotency_keys() -> None:
    assert checked_owner("alice@example.com") == "alice@example.com"
    for bad in ("", "a:b", "-x", "x y", "x" * 65, "é"):
        with pytest.raises(OwnerInvalid):
            checked_owner(bad)
    assert owned_key(None, "k") == "k" and owned_key("alice", None) is None
    assert owned_key("alice", "order:42") == "alice:order:42"
    assert callers_key("alice", "alice:order:42") == "order:42" and callers_key(None, "k") == "k"
    with pytest.raises(OwnerInvalid):
        owned_key("a:b", None)


def test_token_scopes() -> None:
    assert checked_scopes(["Read", "submit"]) == {"read", "submit"}
    for bad in ([], ["write"], ["read", "root"]):
        with pytest.raises(ScopeInvalid):
            checked_scopes(bad)


def test_every_body_may_be_400_or_413_and_the_document_says_so() -> None:
    # Found by the contract run: a body that is not UTF-8 is FastAPI's 400, undeclared.
    doc = json.loads(openapi_document())
    with_bodies = [op for ops in doc["paths"].values() for op in ops.values() if "requestBody" in op]
    assert len(with_bodies) >= 5
    for op in with_bodies:
        assert {"400", "413", "422"} <= set(op["responses"]), op["operationId"]
    with TestClient(create_app(ConveyorSettings())) as http:
        resp = http.post("/jobs", content=b'{"stage": "\xff"}', headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/problem+json"


def test_links_lead_to_operations_and_parameters_that_exist() -> None:
    doc = json.loads(openapi_document())
    operations = {op["operationId"]: op for ops in doc["paths"].values() for op in ops.values()}
    links = {
        (source, status, name): link
        for source, op in operations.items()
        for status, answer in op["responses"].items()
        for name, link in answer.get("links", {}).items()
    }
    for (source, _, name), link in links.items():
        target = operations[link["operationId"]]
        names = {p["name"] for p in target.get("parameters", [])}
        assert set(link["parameters"]) <= names, (source, name)
        assert all(v.startswith("$response.body#/") for v in link["parameters"].values()), (source, name)
    for status in ("200", "201"):
        assert {("submitJob", status, n) for n in ("GetJob", "CancelJob", "JobEvents")} <= set(links)
    assert links["submitJob", "201", "GetJob"]["parameters"] == {"job_id": "$response.body#/id"}
    assert links["listDeadLetters", "200", "GetDeadLetter"]["parameters"] == {
        "entry_id": "$response.body#/items/0/id"
    }
