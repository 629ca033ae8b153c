"""What the files pipeline's integration tests share: documents and database probes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from conveyor.store.db.schema import job_events
from pipelines.files import Upload
from tasks.files import flow
from tasks.files.models import batches, files
from tests.helpers import eventually

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "files"

TOPICS = {
    "beekeeping": "Beekeepers inspect the brood frames every week, checking the queen, the honey stores and "
    "signs of varroa mites before the summer nectar flow.",
    "lighthouses": "The lighthouse keeper trimmed the wick, polished the Fresnel lens and logged passing "
    "schooners while the foghorn sounded across the rocky headland.",
    "sourdough": "A sourdough starter of rye flour and water ferments for days; wild yeast and lactobacilli "
    "leaven the dough, which is folded, proofed overnight and baked in a Dutch oven.",
    "volcanoes": "Basaltic lava fountains erupted from the fissure; seismometers recorded tremor while "
    "volcanologists sampled sulfur dioxide near the caldera rim.",
    "chess": "The grandmaster sacrificed a knight on f7, opened the king's diagonal and converted the "
    "endgame with two connected passed pawns against a lone rook.",
    "orchids": "Epiphytic orchids cling to rainforest branches with aerial roots coated in velamen, "
    "absorbing mist while pollinating euglossine bees visit the fragrant blossoms.",
}


def docs(n: int, tag: str) -> list[Upload]:
    """``n`` small text documents named after ``tag``, cycling through the topics."""
    names = list(TOPICS)
    return [
        Upload(
            f"{tag}-{i:03d}-{names[i % len(names)]}.txt",
            (TOPICS[names[i % len(names)]] + f" Note {i}.").encode(),
        )
        for i in range(n)
    ]


def batch_row(platform: Any, batch_id: str) -> Any:
    """The batch row."""
    with platform.engine.connect() as conn:
        return conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().one()


def completed(platform: Any, batch_id: str, timeout: float, interval: float = 0.1) -> Any:
    """Wait until the batch is ``completed``; returns its row."""
    return eventually(
        lambda: (b := batch_row(platform, batch_id))["status"] == "completed" and b,
        timeout=timeout,
        interval=interval,
    )


def file_row(platform: Any, file_id: str) -> Any:
    """The file row."""
    with platform.engine.connect() as conn:
        return conn.execute(select(files).where(files.c.id == file_id)).mappings().one()


def batch_events(platform: Any, topic: str, batch_id: str) -> list[dict[str, Any]]:
    """The bodies of the outbox events ``topic`` about ``batch_id``, in order."""
    with platform.engine.connect() as conn:
        rows = conn.execute(
            select(job_events.c.body).where(job_events.c.topic == topic).order_by(job_events.c.id)
        ).scalars()
        return [dict(body) for body in rows if body.get("batch_id") == batch_id]


def completed_events(platform: Any, batch_id: str) -> int:
    """How many times ``batch.completed`` was written for ``batch_id``."""
    return len(batch_events(platform, "batch.completed", batch_id))


def _empty_docx() -> bytes:
    import io

    import docx

    out = io.BytesIO()
    docx.Document().save(out)
    return out.getvalue()


SAVED_PAGE = (
    b"<!-- saved from url=(0022)http://example.org/ -->\n<div><script>var tracker = 'pixel';</script>"
    b"<p>The Fresnel lens of the lighthouse</p><style>p { color: red }</style>"
    b"<template><p>hidden template text</p></template></div>"
)

# Hostile or ordinary-but-messy documents: name, bytes, and either the error type the file
# must fail with on its first attempt, or None (it must reach ready).
MESSY: list[tuple[str, bytes, str | None]] = [
    ("nul.html", b"<html><body><p>Fresnel\x00 lens keeper</p></body></html>", None),
    ("nul.txt", b"The lighthouse keeper\x00 logged the schooners.", None),
    ("saved.html", SAVED_PAGE, None),
    ("latin1.txt", "Le gardien du phare a nettoy\xe9 la lentille \xe0 l'aube.".encode("latin-1"), None),
    ("utf16.txt", "Der Leuchtturmw\u00e4rter putzte die Linse.".encode("utf-16"), None),
    ("empty.pdf", b"", "EmptyDocument"),
    ("blank.txt", b"   \n\t \n  ", "EmptyDocument"),
    ("empty.docx", _empty_docx(), "EmptyDocument"),
]


def check_messy(platform: Any, owner: str, ids: dict[str, str]) -> None:
    """Each messy document ended as :data:`MESSY` says, failures on attempt 1 with a message."""

    from conveyor.store.db.schema import dead_letters, jobs

    for name, _, error in MESSY:
        row = file_row(platform, ids[name])
        if error is None:
            assert row["status"] == "ready", (name, row["error_type"], row["error"])
            assert "\x00" not in row["text"] and row["chunk_count"] >= 1
            assert (
                "tracker" not in row["text"]
                and "hidden template" not in row["text"]
                and "color" not in row["text"]
            )
            continue
        assert (row["status"], row["error_type"]) == ("failed", error), (name, row["error"])
        assert row["error"].startswith("no text found"), row["error"]
        with platform.engine.connect() as conn:
            job = (
                conn.execute(
                    select(jobs).where(
                        jobs.c.stage == "conveyor.files.extract",
                        jobs.c.payload["file_id"].as_string() == ids[name],
                    )
                )
                .mappings()
                .one()
            )
            letters = conn.execute(
                select(func.count()).select_from(dead_letters).where(dead_letters.c.job_id == job["id"])
            ).scalar_one()
        assert (job["status"], job["attempts"], letters) == ("dead", 1, 1), name
    encodings = {name: file_row(platform, ids[name])["encoding"] for name in ("latin1.txt", "utf16.txt")}
    assert encodings["utf16.txt"].startswith("utf_16") and encodings["latin1.txt"] in ("latin_1", "cp1252")


def embedded_chunks(platform: Any, file_ids: list[str]) -> int:
    """How many chunk vectors the files' ``file_vectors`` rows hold."""
    with platform.engine.connect() as conn:
        return flow.embedded_chunks(conn, file_ids)
