"""Hostile and ordinary-but-messy documents on Postgres: each ends ready, or failed with a
named permanent error on its first attempt (never a retry, never SQL shown to a person).
The same documents run on SQLite in tests/fault/test_files_sqlite.py."""

from __future__ import annotations

from typing import Any

import pytest

from pipelines.files import Upload, process_batch
from pipelines.files import batch_status as status
from tests.integration.files_support import MESSY, check_messy, completed

pytestmark = pytest.mark.timeout(300)


def test_messy_documents_get_a_clear_answer_on_postgres(platform: Any, worker: Any, tag: str) -> None:
    batch_id = process_batch(platform, tag, [Upload(name, data) for name, data, _ in MESSY])
    completed(platform, batch_id, timeout=120)
    ids = {f["name"]: f["id"] for f in status(platform, batch_id)["files"]}
    check_messy(platform, tag, ids)
