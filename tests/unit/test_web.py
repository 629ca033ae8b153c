"""The HTTP API without services: its OpenAPI document (served, and kept in the repository),
problem details for what nothing else handles, owner names and token scopes, and a
deployment's routers (``HTTP_EXTENSIONS``)."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conveyor.client.owners import callers_key, checked_owner, owned_key
from conveyor.errors import ConfigurationError, OwnerInvalid, ScopeInvalid
from conveyor.settings import ConveyorSettings
from conveyor.web import create_app
from conveyor.web.server import deployment_routers, openapi_document
from conveyor.web.tokens import checked_scopes

KEPT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
REGENERATE = "conveyor openapi --output docs/openapi.json"


def test_the_kept_openapi_document_is_the_served_one() -> None:
    settings = ConveyorSettings()  # this deployment's, with its routers: as `conveyor serve` builds it
    with TestClient(create_app(settings, routers=deployment_routers(settings))) as http:
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
        # the files family's (pipelines.files.http)
        ("/batches", "post"),
        ("/batches/{batch_id}", "get"),
        ("/batches/{batch_id}/files", "post"),
        ("/files/{file_id}/confirm", "post"),
        ("/batches/{batch_id}/seal", "post"),
        ("/batches/{batch_id}/cancel", "post"),
        ("/batches/{batch_id}/retry-failed", "post"),
        # the email family's (pipelines.email.http)
        ("/email/messages", "post"),
        ("/email/messages/{outbox_id}", "get"),
        ("/email/messages/{outbox_id}/resolve", "post"),
        # the publisher family's (pipelines.publisher.http)
        ("/publisher/jobs", "post"),
        ("/publisher/jobs", "get"),
        ("/publisher/jobs/test", "post"),
        ("/publisher/jobs/{post_id}", "get"),
        ("/publisher/jobs/{post_id}", "patch"),
        ("/publisher/jobs/{post_id}/cancel", "post"),
        ("/publisher/jobs/{post_id}/replay", "post"),
        # the trading family's (pipelines.trading.http)
        ("/trading/imports", "post"),
        ("/trading/scores", "post"),
        ("/trading/users/{userId}", "get"),
        ("/trading/users/{userId}/connections/{broker}", "put"),
        ("/trading/users/{userId}/trades", "get"),
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


# -- a deployment's routers ---------------------------------------------------------------

WIDGETS = '''"""Widgets: made to order.

More about widgets.
"""
from fastapi import APIRouter, Request

from conveyor.web.limits import streamed

platform = object()
router = APIRouter(tags=["widgets"])
HTTP_EXTENSIONS = {"widgets": "MODULE:router"}


@router.post("/widgets/size")
@streamed
async def size(request: Request) -> dict[str, int]:
    n = 0
    async for chunk in request.stream():
        n += len(chunk)
    return {"size": n}


@router.post("/widgets/plain")
async def plain(request: Request) -> dict[str, int]:
    return {"size": len(await request.body())}
'''


def deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> ConveyorSettings:
    """A deployment in ``tmp_path`` whose app module is ``source`` (MODULE: its name)."""
    name = f"app_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(source.replace("MODULE", name))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return ConveyorSettings(root=tmp_path, app=name, max_payload_bytes=256)


def test_a_deployments_routers_join_the_api_and_a_streamed_endpoint_takes_any_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = deployment(tmp_path, monkeypatch, WIDGETS)
    routers = deployment_routers(settings)
    assert len(routers) == 1
    big = b"x" * 200_000  # over the API's body limit (4 x 256 bytes + 64 KiB)
    with TestClient(create_app(settings, routers=routers)) as http:
        assert http.post("/widgets/size", content=big).json() == {"size": len(big)}
        assert http.post("/widgets/size", content=iter([big, big])).json() == {"size": 2 * len(big)}
        refused = http.post("/widgets/plain", content=big)
        assert refused.status_code == 413 and refused.json()["type"] == "urn:conveyor:problem:too-large"
        assert http.post("/widgets/plain", content=b"small").json() == {"size": 5}
        doc = http.get("/openapi.json").json()
    assert {"/widgets/size", "/widgets/plain", "/jobs"} <= set(doc["paths"])
    assert doc["tags"][-1] == {"name": "widgets", "description": "Widgets: made to order."}


def test_without_a_deployment_the_core_api_is_served_and_one_line_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    for app in ("nowhere_at_all", "nowhere_pkg.celery_app"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="conveyor.web"):
            assert deployment_routers(ConveyorSettings(root=tmp_path, app=app)) == []
        lines = [r.getMessage() for r in caplog.records if r.name == "conveyor.web"]
        assert len(lines) == 1 and "core API only" in lines[0] and app.split(".")[0] in lines[0]


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        ("raise RuntimeError('the deployment is broken')", RuntimeError, "broken"),
        ("import not_installed_anywhere_xyz", ModuleNotFoundError, "not_installed_anywhere_xyz"),
        ("HTTP_EXTENSIONS = {}", ConfigurationError, "builds no Conveyor `platform`"),
        (
            "platform = 1\nHTTP_EXTENSIONS = {'x': 'MODULE:platform'}",
            ConfigurationError,
            "not a fastapi.APIRouter",
        ),
        ("platform = 1\nHTTP_EXTENSIONS = {'x': 'MODULE:nothing'}", ConfigurationError, "has no 'nothing'"),
        ("platform = 1\nHTTP_EXTENSIONS = {'x': 'MODULE_gone:router'}", ConfigurationError, "cannot import"),
        ("platform = 1\nHTTP_EXTENSIONS = ['MODULE:router']", ConfigurationError, "must map names"),
    ],
    ids=[
        "raises",
        "missing-dependency",
        "no-platform",
        "not-a-router",
        "no-attribute",
        "no-module",
        "a-list",
    ],
)
def test_a_broken_deployment_fails_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        deployment_routers(deployment(tmp_path, monkeypatch, source))


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
