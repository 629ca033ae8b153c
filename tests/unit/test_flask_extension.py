"""``conveyor.contrib.flask``: settings from ``app.config`` over the environment, one client
per app, made on first use; Flask imported by that module alone. No services needed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from flask import Flask

from conveyor.contrib.flask import Conveyor, ConveyorState, _close_all, mount_api, settings_from_config
from conveyor.errors import ConfigurationError

PACKAGE = Path(__file__).resolve().parents[2] / "conveyor"


def make_app(name: str, **config: object) -> Flask:
    app = Flask(name)
    app.config.update(config)
    return app


def test_app_config_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", "postgresql://env@db/env")
    monkeypatch.setenv("CONVEYOR_REDIS_URL", "redis://env:6379/0")
    monkeypatch.setenv("CONVEYOR_SUBMIT_REDIS_COOLDOWN", "7")
    settings = settings_from_config(
        {
            "CONVEYOR_DATABASE_URL": "postgresql://app@db/app",
            "CONVEYOR_REDIS_URL": None,  # unset here: the environment's
            "CONVEYOR_DB_SCHEMA": "shop_jobs",
            "CONVEYOR_SUBMIT_REDIS_TIMEOUT": "0.5",
            "SQLALCHEMY_DATABASE_URI": "sqlite://",
        }
    )
    assert settings.database_url == "postgresql://app@db/app"
    assert settings.redis_url == "redis://env:6379/0"
    assert settings.db_schema == "shop_jobs"
    assert settings.submit_redis_timeout == 0.5 and settings.submit_redis_cooldown == 7


def test_a_misspelt_setting_is_refused_with_the_close_names() -> None:
    with pytest.raises(ConfigurationError, match="CONVEYOR_DATABASE_URL"):
        Conveyor(make_app("typo", CONVEYOR_DATABSE_URL="postgresql://x@db/x"))


def test_an_invalid_setting_names_the_key_and_never_a_secret() -> None:
    with pytest.raises(ConfigurationError) as caught:
        settings_from_config(
            {
                "CONVEYOR_DATABASE_URL": "postgresql://u:hunter2@db/x",
                "CONVEYOR_REDIS_URL": ["redis://:hunter2@r:6379/0"],
                "CONVEYOR_DB_SCHEMA": "A;B",
            }
        )
    message = str(caught.value)
    assert "CONVEYOR_DB_SCHEMA" in message and "CONVEYOR_REDIS_URL" in message
    assert "hunter2" not in message


def test_each_app_has_its_own_client_made_on_first_use() -> None:
    ext = Conveyor()
    one = make_app("one", CONVEYOR_DATABASE_URL="postgresql://a@db/one")
    two = make_app("two", CONVEYOR_DATABASE_URL="postgresql://a@db/two")
    ext.init_app(one)
    ext.init_app(two)
    state = one.extensions["conveyor"]
    assert isinstance(state, ConveyorState) and state._client is None  # nothing made or connected yet
    with one.app_context():
        client = ext.client
        assert ext.client is client and client.settings.database_url == "postgresql://a@db/one"
    with two.app_context():
        assert ext.client is not client and ext.settings.database_url == "postgresql://a@db/two"
    with pytest.raises(RuntimeError, match="app context"):
        _ = ext.client
    with pytest.raises(RuntimeError, match="already set up"):
        ext.init_app(one)
    with pytest.raises(RuntimeError, match="init_app"), make_app("three").app_context():
        _ = ext.client
    _close_all()  # what runs at exit: the clients' connections closed, none ever opened


def test_created_with_an_app_it_works_outside_an_app_context() -> None:
    app = make_app("solo", CONVEYOR_DATABASE_URL="postgresql://a@db/solo")
    ext = Conveyor(app)
    assert ext.client is app.extensions["conveyor"].client


NOWHERE = {
    "CONVEYOR_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
    "CONVEYOR_REDIS_URL": "redis://127.0.0.1:1/0",
}


def test_mount_api_serves_the_api_under_its_prefix_built_at_its_first_request() -> None:
    app = make_app("mounted", **NOWHERE)
    mounted = mount_api(app, "conveyor/")  # before init_app: the client is looked up per request
    Conveyor(app)

    @app.get("/ping")
    def ping() -> dict[str, bool]:
        return {"pong": True}

    http = app.test_client()
    assert http.get("/ping").json == {"pong": True}
    assert http.get("/conveyorx").status_code == 404  # Flask's own 404: not under the prefix
    state = app.extensions["conveyor"]
    assert state._client is None and mounted.api._api is None  # nothing built, nothing connected

    refused = http.post("/conveyor/jobs", json={"stage": "conveyor.demo.square"})
    assert refused.status_code == 401 and refused.content_type.startswith("application/problem+json")
    assert refused.json["instance"] == "/conveyor/jobs"
    assert mounted.api.application.state.conveyor_client is state.client  # the extension's client
    docs = http.get("/conveyor/docs")
    assert docs.status_code == 200 and "/conveyor/openapi.json" in docs.text
    assert http.get("/conveyor/openapi.json").json["servers"] == [{"url": "/conveyor"}]
    assert http.get("/ping").json == {"pong": True}


def test_mount_api_refuses_the_root_and_needs_init_app() -> None:
    with pytest.raises(ValueError, match="prefix"):
        mount_api(make_app("root"), "/")
    app = make_app("bare")
    mount_api(app)
    with pytest.raises(RuntimeError, match="init_app"):
        app.test_client().get("/conveyor/health")


def test_only_the_flask_module_imports_flask() -> None:
    importers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(n.split(".")[0] in {"flask", "flask_sqlalchemy"} for n in names):
                importers.append(path.relative_to(PACKAGE).as_posix())
    assert sorted(set(importers)) == ["contrib/flask.py"]
