"""What the ``conveyor`` command imports: what the command named needs, nothing for every
command (``--help`` without SQLAlchemy, Redis, Celery or the deployment's app module; a
``jobs list`` on SQLite without Redis, Celery or the platform). Timings: ``bench/cli.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.store.db.engine import make_engine, sqlite_url

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: the command's own output on stdout, then the modules it loaded.
PROBE = """
import json, sys
out, args = sys.argv[1], json.loads(sys.argv[2])
sys.argv = ["conveyor", *args]
code = 0
if args != ["import"]:
    from conveyor.cli.main import main
    try:
        main()
    except SystemExit as exc:
        code = exc.code
else:
    import conveyor
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""

# Loaded by every command before: each costs 0.1-0.2 s of start-up.
HEAVY = ("sqlalchemy", "redis", "celery", "kombu", "psycopg", "structlog", "opentelemetry", "jsonschema")
DEPLOYMENT = ("config.celery_app", "conveyor.platform", "conveyor.worker.step")
COMMANDS = [
    "up", "worker", "beat", "flower", "demo", "top", "serve", "openapi", "stages",
    "jobs", "dlq", "db", "probe", "tokens",
]  # fmt: skip


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, set[str]]:
    """``conveyor ARGS`` in a fresh interpreter: its stdout, and the top modules it loaded."""
    out = tmp_path / "modules.json"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    environ.update({"CONVEYOR_HOME": str(tmp_path / "home"), "COLUMNS": "120", **(env or {})})
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), json.dumps(list(args))],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["code"] == 0, proc.stdout + proc.stderr
    modules = set(result["modules"])
    return proc.stdout, {m.split(".")[0] for m in modules} | (modules & set(DEPLOYMENT))


def test_import_conveyor_loads_no_driver_and_no_settings(tmp_path: Path) -> None:
    _, loaded = run(tmp_path, "import")
    assert loaded.isdisjoint({*HEAVY, "pydantic_settings"}), sorted(loaded & {*HEAVY, "pydantic_settings"})


def test_help_lists_every_command_without_loading_the_services_or_the_app(tmp_path: Path) -> None:
    shown, loaded = run(tmp_path, "--help")
    assert loaded.isdisjoint({*HEAVY, *DEPLOYMENT}), sorted(loaded & {*HEAVY, *DEPLOYMENT})
    rows = [line.split() for line in shown.splitlines() if line.startswith("│ ")]
    listed = [row[1] for row in rows if len(row) > 2]
    from config import CLI_EXTENSIONS

    assert [c for c in listed if c in COMMANDS or c in CLI_EXTENSIONS] == [*COMMANDS, *CLI_EXTENSIONS]
    if "files" in CLI_EXTENSIONS:
        shown, _ = run(tmp_path, "files", "--help")
        assert "submit" in shown and "reembed" in shown


@pytest.mark.sqlite
def test_jobs_list_on_sqlite_loads_no_broker_and_no_platform(tmp_path: Path) -> None:
    from config.migrations import upgrade

    url = sqlite_url(tmp_path)
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    # Nothing listens on port 1: the command must not need Redis.
    env = {"CONVEYOR_DATABASE_URL": url, "CONVEYOR_REDIS_URL": "redis://127.0.0.1:1/0"}
    shown, loaded = run(tmp_path, "jobs", "list", "--json", env=env)
    assert json.loads(shown) == []
    assert loaded.isdisjoint({"redis", "celery", "kombu", "psycopg", *DEPLOYMENT}), sorted(
        loaded & {"redis", "celery", "kombu", "psycopg", *DEPLOYMENT}
    )
