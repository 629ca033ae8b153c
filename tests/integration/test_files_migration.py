"""Migration f003 on a database that already holds embedded chunks (f002's layout): the
vectors move to one ``file_vectors`` row per file, the lexical index covers the old
chunks, and search works without a re-embed."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Engine, inspect, text

from config.migrations import FAMILY_MIGRATIONS, upgrade
from conveyor.store.db.engine import make_engine, sqlite_url
from conveyor.store.db.migrate import alembic_config
from conveyor.store.db.namespace import physical_name
from pipelines.files import search
from tasks.files.embedding import load_embedder, pack
from tasks.files.models import chunks, file_vectors
from tests.helpers import bound_to, scratch_database

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["postgres", "sqlite"])
def old_engine(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Engine]:
    """An empty database of its own, migrated only as far as f002."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = sqlite_url(tmp_path)
        else:
            url = stack.enter_context(scratch_database("conveyor_mig"))
        engine = make_engine(url)
        stack.callback(engine.dispose)
        command.upgrade(alembic_config(engine, FAMILY_MIGRATIONS), "f002")
        yield engine


def test_f003_moves_vectors_and_indexes_old_chunks(old_engine: Engine, platform: Any) -> None:
    model = load_embedder("wordllama-256")
    texts = ["lighthouse keepers trim the lamp", "the Fresnel lens bends light"]
    vectors = [pack(v) for v in model.embed(texts)]
    now = datetime.now(UTC)
    with old_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO files (id, owner, name, size, content_ref, checksum, status,"
                " created_at, updated_at)"
                " VALUES ('f1', 'alice', 'light.txt', 1, '-', '-', 'ready', :now, :now)"
            ),
            {"now": now},
        )
        for ordinal, (t, v) in enumerate(zip(texts, vectors, strict=True)):
            conn.execute(
                text(
                    "INSERT INTO file_chunks (file_id, owner, ordinal, text, embedding, model)"
                    " VALUES ('f1', 'alice', :o, :t, :v, 'wordllama-256')"
                ),
                {"o": ordinal, "t": t, "v": v},
            )
        ids = [r.id for r in conn.execute(text("SELECT id FROM file_chunks ORDER BY ordinal"))]
    upgrade(old_engine)
    with old_engine.connect() as conn:
        row = conn.execute(file_vectors.select()).one()
        schema, name = physical_name(conn, chunks)
        columns = {c["name"] for c in inspect(conn).get_columns(name, schema=schema)}
    assert (row.file_id, row.owner, row.model) == ("f1", "alice", "wordllama-256")
    assert struct.unpack("<2q", row.chunk_ids) == tuple(ids) and row.vectors == b"".join(vectors)
    assert not {"embedding", "model"} & columns
    with bound_to(platform, old_engine.url.render_as_string(hide_password=False)):
        for ranking in ("lexical", "vector", "fused"):
            hits = search(platform, "Fresnel lens", owner="alice", ranking=ranking)  # type: ignore[arg-type]
            assert [(h.name, h.ordinal) for h in hits] == [("light.txt", 1)], ranking
