"""``conveyor files …``: submit a batch, watch it, cancel it, search it."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from sqlalchemy import func, select

from conveyor.cli import console, err, load_platform, run_command
from tasks.files.models import CHUNKING, EMBEDDING, EXTRACTING, FAILED, READY, TERMINAL, files

app = typer.Typer(help="The files pipeline: extract → chunk → embed, batch completion.", no_args_is_help=True)

STAGES = [
    ("extracted", (CHUNKING, EMBEDDING, READY)),
    ("chunked", (EMBEDDING, READY)),
    ("embedded", (READY,)),
]


def _counts(platform: object, batch_id: str) -> dict[str, int]:
    with platform.engine.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(
            select(files.c.status, func.count()).where(files.c.batch_id == batch_id).group_by(files.c.status)
        ).all()
    return {str(s): int(n) for s, n in rows}


@app.command()
def submit(
    paths: list[Path] = typer.Argument(..., exists=True, readable=True, help="files to process"),
    user: str = typer.Option("demo", help="owner of the files"),
    timeout: float = typer.Option(600.0, help="seconds to wait for the batch"),
) -> None:
    """Create a batch, confirm every file, show progress per stage, then the summary."""

    def main() -> int:
        from pipelines.files import Upload, batch_status, process_batch

        platform = load_platform()
        items = [Upload(p.name, p.read_bytes()) for p in paths]
        batch_id = process_batch(platform, user, items)
        console.print(f"batch [bold]{batch_id}[/bold]: {len(items)} file(s)")
        total = len(items)
        deadline = time.monotonic() + timeout
        with Progress(
            TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), console=console
        ) as bar:
            tasks = {name: bar.add_task(name, total=total) for name, _ in STAGES}
            failed_task = bar.add_task("failed", total=total)
            while True:
                counts = _counts(platform, batch_id)
                for name, states in STAGES:
                    bar.update(tasks[name], completed=sum(counts.get(s, 0) for s in states))
                bar.update(failed_task, completed=counts.get(FAILED, 0))
                if sum(counts.get(s, 0) for s in TERMINAL) >= total or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        status = batch_status(platform, batch_id)
        table = Table("file", "status", "error")
        for f in status["files"]:
            table.add_row(f["name"], f["status"], (f["error"] or "")[:80])
        console.print(table)
        b = status["batch"]
        console.print(f"total={b['total']} ready={b['ready']} failed={b['failed']}")
        return 0 if b["terminal"] >= b["total"] else 1

    run_command(main)


@app.command()
def status(batch_id: str) -> None:
    """A batch's counters and each file's state."""

    def main() -> int:
        from pipelines.files import batch_status

        s = batch_status(load_platform(), batch_id)
        b = s["batch"]
        console.print(
            f"batch {batch_id}: {b['status']} total={b['total']} ready={b['ready']} failed={b['failed']} "
            f"cancelled={b['cancelled']}"
        )
        for f in s["files"]:
            console.print(f"  {f['status']:<10} {f['name']}  {f['error'] or ''}")
        return 0

    run_command(main)


@app.command()
def cancel(batch_id: str) -> None:
    """Cancel the batch's non-terminal files (cancelled counts as terminal)."""

    def main() -> int:
        from pipelines.files import cancel_batch

        n = cancel_batch(load_platform(), batch_id, by="cli")
        console.print(f"cancelled {n} file(s)")
        return 0

    run_command(main)


@app.command()
def retry(batch_id: str) -> None:
    """Retry the batch's failed files from the DLQ, each from the stage it failed in."""

    def main() -> int:
        from pipelines.files import retry_failed

        ids = retry_failed(load_platform(), batch_id, by="cli")
        console.print(f"retried {len(ids)} file(s)")
        return 0

    run_command(main)


@app.command()
def search(query: str, user: str = typer.Option("demo"), limit: int = typer.Option(5)) -> None:
    """The best chunks for QUERY among USER's files."""

    def main() -> int:
        from pipelines.files import search as run_search

        hits = run_search(load_platform(), query, owner=user, limit=limit)
        if not hits:
            err.print("no results")
        for h in hits:
            console.print(f"{h.score:.3f}  {h.name}  #{h.ordinal}: {h.text[:100]!r}")
        return 0

    run_command(main)


__all__ = ["EXTRACTING", "app"]
