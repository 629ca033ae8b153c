"""``conveyor publisher …`` as a real process against the test services: schedule (the same
plan again is the same post), show, list, edit, cancel, a preview and the seed's test that
insert nothing, and bad input answered in one line naming the field, exit 1, no traceback."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from typing import Any

import pytest
from sqlalchemy import func, select

from conveyor.delivery.procs import service_env
from tasks.publisher import tables as t

pytestmark = pytest.mark.timeout(180)
LATER = "2031-03-01T09:00:00+01:00"  # far ahead: no worker of another module publishes it


def conveyor(
    platform: Any, *args: str, publisher: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    env = service_env(platform.settings)
    settings = {"graph_url": "http://127.0.0.1:9", "tokens": {"*": "graph-test-token"}, **(publisher or {})}
    env["CONVEYOR_PUBLISHER"] = json.dumps(settings)
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "publisher", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _plan(tag: str, *extra: str) -> list[str]:
    return [
        "schedule",
        "--brand", f"brand-{tag}",
        "--channel", "facebook",
        "--account", f"acct-{tag}",
        "--caption", "Hello {who}",
        "--placeholder", "who=you",
        "--at", LATER,
        *extra,
    ]  # fmt: skip


def count(platform: Any, brand: str) -> int:
    with platform.engine.connect() as conn:
        query = select(func.count()).select_from(t.posts).where(t.posts.c.brand == brand)
        return int(conn.execute(query).scalar_one())


def refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 1 with one line on stderr holding ``words``, and no traceback."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    assert "Traceback" not in result.stderr


def test_schedule_show_list_edit_and_cancel(platform: Any, tag: str) -> None:
    first = conveyor(platform, *_plan(tag, "--json"))
    assert first.returncode == 0, first.stderr
    done = json.loads(first.stdout)
    assert set(done) == {"id", "status", "idempotency_key", "job_id", "existing"}
    assert done["status"] == t.PENDING and done["existing"] is False and done["job_id"] == done["id"]
    again = conveyor(platform, *_plan(tag))
    assert again.returncode == 0 and again.stdout.strip() == done["id"]  # $(…) gets the id alone
    assert "existing" in again.stderr

    shown = conveyor(platform, "show", done["id"], "--json")
    assert shown.returncode == 0, shown.stderr
    row = json.loads(shown.stdout)
    assert row["caption"] == "Hello you" and row["job_id"] == done["id"] and row["status"] == t.PENDING
    assert row["scheduled_at"] == "2031-03-01T08:00:00Z"
    plain = conveyor(platform, "show", done["id"])
    assert f"id: {done['id']}" in plain.stdout.splitlines()
    listed = conveyor(platform, "list", "--status", "pending")  # piped: a header, one line each
    assert listed.stdout.splitlines()[0].split("\t")[:2] == ["id", "channel"]
    assert any(line.startswith(f"{done['id']}\t") for line in listed.stdout.splitlines())

    edited = conveyor(
        platform, "edit", done["id"], "--caption", "Edited for {who}", "--placeholder", "who=all"
    )
    assert edited.returncode == 0 and edited.stdout.strip() == f"{done['id']}: {t.PENDING}", edited.stderr
    assert json.loads(conveyor(platform, "show", done["id"], "--json").stdout)["caption"] == "Edited for all"

    cancelled = conveyor(platform, "cancel", done["id"])
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{done['id']}: {t.CANCELLED}"
    twice = conveyor(platform, "cancel", done["id"])  # cancelled already: the same answer
    assert twice.returncode == 0 and twice.stdout.strip() == f"{done['id']}: {t.CANCELLED}"
    refused(conveyor(platform, "edit", done["id"], "--caption", "late"), "post-not-pending")
    refused(conveyor(platform, "replay", done["id"]), "post-not-failed")
    assert count(platform, f"brand-{tag}") == 1


def test_bad_input_is_one_line_naming_the_field(platform: Any, tag: str) -> None:
    refused(conveyor(platform, *_plan(tag), "--channel", "tiktok"), "channel", "tiktok")
    naive = [a if a != LATER else "2031-03-01T09:00:00" for a in _plan(tag)]
    refused(conveyor(platform, *naive), "scheduled_at", "offset")
    refused(
        conveyor(platform, *[a if a != "facebook" else "instagram" for a in _plan(tag)]), "media", "Instagram"
    )
    refused(conveyor(platform, *_plan(tag), publisher={"tokens": {}}), "account", "token")
    early = [a if a != LATER else "0001-01-01T00:30:00+01:00" for a in _plan(tag)]
    refused(conveyor(platform, *early), "scheduled_at", "out of range")
    refused(conveyor(platform, "show", "no-such-post"), "no post no-such-post")
    refused(conveyor(platform, "list", "--status", "nope"), "status")
    assert count(platform, f"brand-{tag}") == 0


def test_preview_and_test_insert_nothing(platform: Any, tag: str) -> None:
    preview = conveyor(platform, *_plan(tag, "--preview", "--json"))
    assert preview.returncode == 0, preview.stderr
    doc = json.loads(preview.stdout)
    assert doc["preview"] is True and doc["caption"] == "Hello you" and len(doc["idempotency_key"]) == 64

    window = {
        "name": f"quiet-{tag}",
        "start": "11:00",
        "end": "13:00",
        "timezone": "UTC",
        "brands": [f"brand-{tag}"],
    }
    at = dt.datetime(2031, 1, 1, 12, 0, tzinfo=dt.UTC).isoformat()
    args = (
        "test",
        "--channel",
        "facebook",
        "--account",
        f"acct-{tag}",
        "--at",
        at,
        "--brand",
        f"brand-{tag}",
    )
    checked = conveyor(platform, *args, "--caption", "hi", "--json", publisher={"blackout_windows": [window]})
    assert checked.returncode == 0, checked.stderr
    out = json.loads(checked.stdout)
    assert out["blackout"] == {"window": f"quiet-{tag}", "until": "2031-01-01T13:00:00Z"}
    assert out["would_run"] is False and out["channel_busy"] is False and out["account_busy"] is False
    assert len(out["idempotency_key"]) == 64
    plain = conveyor(platform, *args)
    assert plain.returncode == 0 and "would_run: yes" in plain.stdout.splitlines()
    refused(conveyor(platform, *args[:-2], "--channel", "myspace"), "channel")
    assert count(platform, f"brand-{tag}") == 0
