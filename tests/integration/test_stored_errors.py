"""Error messages are stored (DLQ, ``last_error``, events) scrubbed of secrets, as logs are:
people read them in the CLI and the console."""

from __future__ import annotations

from typing import Any

from conveyor.store.db import schema as s
from tests.helpers import dead_letter_for


def test_dead_letter_message_and_traceback_are_scrubbed(platform: Any, tag: str) -> None:
    handle = platform.submit("conveyor.demo.noop", {"n": 1}, delay=3600)
    secret = "hunter2-" + tag
    message = f"login failed: password={secret} for postgresql://app:{secret}@db/x, mail bob@example.com"
    with platform.engine.begin() as conn:
        row = platform.store.get(conn, handle.id)
        assert platform.store.dead_letter(
            conn,
            row,
            error_type="PermanentError",
            message=message,
            tb_text=f"Traceback ...\nValueError: token={secret}",
            from_status=(s.QUEUED,),
        )
    letter = dead_letter_for(platform, handle.id)
    stored = [letter["message"], letter["traceback"], handle.row()["last_error"]]
    stored += [str(e.body) for e in handle.events()[0]]
    for text in stored:
        assert secret not in text and "bob@" not in text
    assert "login failed" in letter["message"] and "@example.com" in letter["message"]


def test_a_database_error_is_described_without_its_sql(platform: Any, tag: str) -> None:
    """What a person reads for a refused write (the files' NUL-byte DataError) is the
    driver's words, never the statement or its parameters."""
    import pytest
    from sqlalchemy import insert
    from sqlalchemy.exc import DBAPIError

    from conveyor.errors import describe
    from tasks.files.models import files

    with pytest.raises(DBAPIError) as caught, platform.engine.begin() as conn:
        conn.execute(
            insert(files).values(
                id=tag, owner=tag, name="nul\x00.txt", size=0, content_ref="", checksum="", status="uploaded",
                created_at=None, updated_at=None,
            )
        )  # fmt: skip
    text = describe(caught.value)
    assert text.startswith("database error (") and "NUL" in text
    assert "INSERT" not in text and "[SQL" not in text and "nul\x00" not in text


def test_a_database_error_never_carries_its_parameters(platform: Any, tag: str) -> None:
    """The whole exception (what Celery logs and a dead letter's traceback keeps) shows the
    statement but never its parameters: a payload's values may be personal data."""
    import pytest
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    email = f"ada-{tag}@example.com"
    with pytest.raises(DBAPIError) as caught, platform.engine.begin() as conn:
        conn.execute(text("SELECT CAST(:email AS text), 1 / 0"), {"email": email})
    whole = f"{caught.value}\n{caught.value!r}"
    assert "division by zero" in whole and "SELECT CAST" in whole
    assert email not in whole
