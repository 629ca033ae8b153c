"""The chunk stage cuts chunks for a model with a token budget (issue #11: minilm's chunks
are cut by its own tokenizer so none exceeds its 256-wordpiece input). The reembed path is
tested in ``test_files_search.py``; this is the upload path, through a real worker."""

from __future__ import annotations

from typing import Any

import pytest

from pipelines.files import Upload, batch_status, process_batch, search
from tasks.files import flow
from tests.integration.files_support import completed, embedded_chunks
from tests.integration.test_files_search import TinyBudget

pytestmark = pytest.mark.timeout(120)


def test_the_chunk_stage_cuts_chunks_to_the_models_token_budget(
    platform: Any, worker: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert TinyBudget.max_tokens == 12
    text = " ".join(f"word{i}" for i in range(300)) + " lighthouse keeper"
    monkeypatch.setattr(platform.settings.files, "embedder", "tests.integration.test_files_search:TinyBudget")
    batch_id = process_batch(platform, tag, [Upload("long.txt", text.encode())])
    batch = completed(platform, batch_id, timeout=60)
    (file,) = batch_status(platform, batch_id)["files"]
    assert (batch["ready"], file["status"]) == (1, "ready"), file
    with platform.engine.connect() as conn:
        pieces = flow.chunk_texts(conn, file["id"])
    counts = TinyBudget().count_tokens([t for _, t in pieces])
    assert len(pieces) > 1 and max(counts) <= TinyBudget.max_tokens, counts
    covered = set()
    for _, piece in pieces:
        covered.update(piece.split())
    assert covered == set(text.split())  # cut, not truncated: every word is in some chunk
    assert embedded_chunks(platform, [file["id"]]) == len(pieces)
    hits = search(platform, "lighthouse", owner=tag, ranking="vector")
    assert [h.name for h in hits] == ["long.txt"]
