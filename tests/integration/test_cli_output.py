"""What ``conveyor`` prints: ``--json`` on every list and show command, whole cells when
stdout is a pipe, and ``files seal`` / ``files submit`` (streamed from the path).

Tests marked ``PENDING`` need functions another change adds to ``pipelines.files``
(``seal_batch``, ``Upload.from_path``); they skip, saying so, until those land.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pipelines.files as pf
from conveyor.delivery.procs import service_env
from tests.integration.files_support import TOPICS, completed, docs

pytestmark = pytest.mark.timeout(300)

needs_seal = pytest.mark.skipif(
    not hasattr(pf, "seal_batch"), reason="PENDING: pipelines.files.seal_batch has not landed"
)
needs_from_path = pytest.mark.skipif(
    not hasattr(pf.Upload, "from_path"), reason="PENDING: pipelines.files.Upload.from_path has not landed"
)

# Settings rich reads to size its output: the pipe must be judged as a pipe.
_TERMINAL_HINTS = ("COLUMNS", "LINES", "FORCE_COLOR", "FORCE_TERMINAL", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


def conveyor(platform: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m conveyor ARGS`` against the test services, stdout and stderr piped."""
    env = {k: v for k, v in service_env(platform.settings).items() if k not in _TERMINAL_HINTS}
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def parsed(proc: subprocess.CompletedProcess[str]) -> Any:
    """stdout as JSON: the whole of it, nothing else printed there."""
    return json.loads(ok(proc))


def iso(value: Any) -> dt.datetime:
    assert isinstance(value, str), value
    return dt.datetime.fromisoformat(value)


def long_name(tag: str, n: int = 120) -> str:
    return (f"{tag}-a-rather-long-name-" + "x" * n)[:n]


@pytest.fixture(scope="module")
def dead(platform: Any, worker: Any) -> Iterator[dict[str, Any]]:
    """One dead-lettered job whose label is 120 characters long."""
    label = long_name(f"t{uuid.uuid4().hex[:12]}")
    handle = platform.submit("conveyor.demo.broken", {"n": 7}, label=label)
    assert handle.wait(60) == "dead"
    from tests.helpers import dead_letter_for

    entry = dead_letter_for(platform, handle.id)
    yield {"job": handle.id, "label": label, "entry": int(entry["id"])}


# -- jobs ---------------------------------------------------------------------------------


def test_jobs_list_json(platform: Any, dead: dict[str, Any]) -> None:
    rows = parsed(
        conveyor(platform, "jobs", "list", "--stage", "conveyor.demo.broken", "--limit", "1000", "--json")
    )
    assert isinstance(rows, list) and all(isinstance(r, dict) for r in rows)
    (row,) = [r for r in rows if r["id"] == dead["job"]]
    assert row["label"] == dead["label"] and row["status"] == "dead"
    assert iso(row["created_at"]).tzinfo is not None


def test_jobs_show_json(platform: Any, dead: dict[str, Any]) -> None:
    job = parsed(conveyor(platform, "jobs", "show", dead["job"], "--json"))
    assert isinstance(job, dict)
    assert job["id"] == dead["job"] and job["label"] == dead["label"] and job["status"] == "dead"
    iso(job["created_at"])
    assert "job.submitted" in [e["topic"] for e in job["events"]]


def test_jobs_list_piped_keeps_a_long_label_whole(platform: Any, dead: dict[str, Any]) -> None:
    out = ok(conveyor(platform, "jobs", "list", "--stage", "conveyor.demo.broken", "--limit", "1000"))
    line = next(line for line in out.splitlines() if dead["job"] in line)
    assert dead["label"] in line


def test_jobs_show_piped_keeps_a_long_label_whole(platform: Any, dead: dict[str, Any]) -> None:
    out = ok(conveyor(platform, "jobs", "show", dead["job"]))
    assert any(dead["label"] in line for line in out.splitlines()), out


# -- dlq ----------------------------------------------------------------------------------


def test_dlq_list_json(platform: Any, dead: dict[str, Any]) -> None:
    rows = parsed(
        conveyor(platform, "dlq", "list", "--stage", "conveyor.demo.broken", "--per-page", "1000", "--json")
    )
    assert isinstance(rows, list)
    (entry,) = [r for r in rows if r["id"] == dead["entry"]]
    assert entry["job_id"] == dead["job"] and entry["label"] == dead["label"]
    assert "known bad" in entry["message"]
    iso(entry["created_at"])


def test_dlq_show_json(platform: Any, dead: dict[str, Any]) -> None:
    entry = parsed(conveyor(platform, "dlq", "show", str(dead["entry"]), "--json"))
    assert isinstance(entry, dict)
    assert entry["id"] == dead["entry"] and entry["job_id"] == dead["job"]
    assert entry["error_type"] and entry["traceback"]
    iso(entry["created_at"])


def test_dlq_list_piped_keeps_a_long_label_whole(platform: Any, dead: dict[str, Any]) -> None:
    out = ok(conveyor(platform, "dlq", "list", "--stage", "conveyor.demo.broken", "--per-page", "1000"))
    assert len(dead["label"]) == 120
    lines = [line for line in out.splitlines() if dead["label"] in line]
    assert len(lines) == 1, out[-3000:]
    assert dead["job"] in lines[0]


def test_dlq_show_piped_keeps_a_long_label_whole(platform: Any, dead: dict[str, Any]) -> None:
    out = ok(conveyor(platform, "dlq", "show", str(dead["entry"])))
    assert any(dead["label"] in line for line in out.splitlines()), out


def test_missing_records_are_an_error_not_json(platform: Any) -> None:
    proc = conveyor(platform, "dlq", "show", "987654321", "--json")
    assert proc.returncode == 1 and proc.stdout == "" and "987654321" in proc.stderr


# -- files --------------------------------------------------------------------------------


def test_files_status_json_and_piped(platform: Any, tag: str) -> None:
    long = long_name(tag) + ".txt"
    batch_id = pf.process_batch(platform, tag, [*docs(1, tag), pf.Upload(long, TOPICS["chess"].encode())])
    status = parsed(conveyor(platform, "files", "status", batch_id, "--json"))
    assert isinstance(status, dict)
    assert status["batch"]["total"] == 2 and status["batch"]["id"] == batch_id
    assert sorted(f["name"] for f in status["files"]) == sorted([f"{tag}-000-beekeeping.txt", long])
    out = ok(conveyor(platform, "files", "status", batch_id))
    assert any(long in line for line in out.splitlines()), out


def test_files_status_of_an_unknown_batch(platform: Any) -> None:
    proc = conveyor(platform, "files", "status", str(uuid.uuid4()), "--json")
    assert proc.returncode == 1 and proc.stdout == "" and "not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_files_search_json(platform: Any, worker: Any, tag: str) -> None:
    batch_id = pf.process_batch(platform, tag, docs(3, tag))
    completed(platform, batch_id, timeout=120)
    hits = parsed(conveyor(platform, "files", "search", "queen brood frames varroa", "--user", tag, "--json"))
    assert isinstance(hits, list) and hits
    assert hits[0]["name"] == f"{tag}-000-beekeeping.txt"
    assert {"file_id", "name", "ordinal", "score", "text"} <= set(hits[0])
    assert parsed(conveyor(platform, "files", "search", "queen", "--user", f"{tag}-nobody", "--json")) == []
    # Piped, the plain output keeps every cell whole: the chunk's text too.
    piped = ok(conveyor(platform, "files", "search", "queen brood frames varroa", "--user", tag))
    header, first = piped.splitlines()[:2]
    assert header.split("\t") == ["score", "file", "chunk", "text"]
    cells = first.split("\t")
    assert cells[1] == hits[0]["name"] and cells[3] == " ".join(hits[0]["text"].split())


@needs_seal
def test_files_seal_an_open_batch(platform: Any, worker: Any, tag: str) -> None:
    batch_id = pf.new_batch(platform, tag)
    file_id = pf.upload(platform, tag, docs(1, tag)[0], batch_id=batch_id)
    assert pf.confirm(platform, file_id)
    # Scoped to another owner: no such batch.
    other = conveyor(platform, "files", "seal", batch_id, "--user", f"{tag}-other")
    assert other.returncode == 1 and "Traceback" not in other.stderr
    batch = parsed(conveyor(platform, "files", "seal", batch_id, "--user", tag, "--json"))
    assert isinstance(batch, dict) and batch["sealed"] and batch["total"] == 1
    assert completed(platform, batch_id, timeout=120)["ready"] == 1
    again = ok(conveyor(platform, "files", "seal", batch_id))  # any owner; already sealed
    assert batch_id in again


@needs_from_path
def test_files_submit_streams_each_path(
    platform: Any, worker: Any, tag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from pipelines.files.cli import app

    path = tmp_path / f"{tag}-sourdough.txt"
    path.write_text(TOPICS["sourdough"])

    def whole(self: Path) -> bytes:
        raise AssertionError(f"read whole into memory: {self}")

    monkeypatch.setattr(Path, "read_bytes", whole)
    result = CliRunner().invoke(app, ["submit", str(path), "--user", tag, "--timeout", "120"])
    assert result.exit_code == 0, result.output
    assert "ready=1" in result.output


# -- tokens -------------------------------------------------------------------------------


def test_tokens_list_json_and_piped_keep_a_long_owner_and_name_whole(platform: Any, tag: str) -> None:
    owner, name = long_name(f"{tag}-owner", 64), long_name(f"{tag}-name", 150)
    made = conveyor(platform, "tokens", "create", "--owner", owner, "--scope", "read", "--name", name)
    assert made.returncode == 0, made.stderr
    listed = parsed(conveyor(platform, "tokens", "list", "--owner", owner, "--json"))
    assert [(t["owner"], t["name"]) for t in listed] == [(owner, name)]
    out = ok(conveyor(platform, "tokens", "list", "--owner", owner))
    lines = [line for line in out.splitlines() if owner in line]
    assert len(lines) == 1 and name in lines[0], out
