"""Bounds a submit and the CLI keep: a delay or expiry no reader could read back is refused
before anything is written; the relay never publishes a job that is no longer due (one held
back since it was read); settings that cannot be read are one line naming the setting,
never its value."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.delivery.procs import service_env
from conveyor.store.db import schema as s

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("option", ["delay", "expires_in"])
def test_a_delay_or_expiry_past_ten_years_is_refused_and_nothing_is_recorded(
    platform: Any, tag: str, option: str
) -> None:
    job_id = str(uuid.uuid4())
    with pytest.raises(ValueError, match=option):
        platform.submit("conveyor.demo.effect", {"note": tag}, job_id=job_id, **{option: 1e12})
    with platform.engine.connect() as conn:
        assert conn.execute(select(s.jobs.c.id).where(s.jobs.c.id == job_id)).first() is None


def test_the_relay_does_not_publish_a_job_read_due_that_is_held_back_since(platform: Any, tag: str) -> None:
    """The other timing: the relay reads a job due and unpublished, then its submitter holds it
    back until its token time; the relay's compare-and-set must not publish it now (its claim
    would drop it as not due, and nothing would publish it again)."""
    job = platform.submit("conveyor.demo.effect", {"note": tag}, delay=3600)
    with platform.engine.begin() as conn:
        row = platform.store.get(conn, job.id)
        assert row["published_at"] is None
        read_as_due = {**row, "run_at": None}  # what the relay saw before the hold-back
        assert platform.store.mark_for_publish(conn, read_as_due, epoch=None) is None
    platform.cancel(job.id)


def test_unreadable_settings_are_one_line_naming_the_setting_never_its_value(platform: Any) -> None:
    env = service_env(platform.settings)
    env["CONVEYOR_EMAIL"] = json.dumps({"provider": "carrier-pigeon", "smtp": {"password": {"v": "HUNTER2"}}})
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "email", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "CONVEYOR_EMAIL provider" in done.stderr and "smtp.password" in done.stderr
    assert "HUNTER2" not in done.stderr + done.stdout and "Traceback" not in done.stderr
    env["CONVEYOR_EMAIL"] = "{not json"
    broken = subprocess.run(
        [sys.executable, "-m", "conveyor", "email", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert broken.returncode == 2 and "valid JSON" in broken.stderr and "Traceback" not in broken.stderr
