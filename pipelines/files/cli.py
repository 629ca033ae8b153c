"""``conveyor files …``: submit a batch, watch it, seal it, cancel it, search it.

Every command takes ``--wait SECONDS`` (a locked or unreachable database is waited for,
then reported in one line, exit 2); ``status``, ``seal`` and ``search`` take ``--json``.
``--user`` scopes ``status``, ``seal``, ``cancel`` and ``retry`` to one owner's batches
(default: any owner: this is the operator's CLI).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from conveyor.cli.main import console, err, json_option, load_platform, run_command, wait_option
from conveyor.cli.output import print_json, print_lines, print_table, records, retrying, wait_until_writable

# The models, SQLAlchemy and the pipeline are imported inside the commands: `conveyor
# --help` imports this module to list the group.
app = typer.Typer(help="The files pipeline: extract → chunk → embed, batch completion.", no_args_is_help=True)


def _stages() -> list[tuple[str, tuple[str, ...]]]:
    """Each progress bar of ``submit``, and the file statuses that count as past it."""
    from tasks.files.models import CHUNKING, EMBEDDING, READY

    return [
        ("extracted", (CHUNKING, EMBEDDING, READY)),
        ("chunked", (EMBEDDING, READY)),
        ("embedded", (READY,)),
    ]


def _owner_option() -> Any:
    return typer.Option(None, "--user", help="only this owner's batch (default: any owner)")


def _owner(user: str | None) -> dict[str, Any]:
    """``owner=`` for the pipeline's functions, only when given."""
    return {"owner": user} if user else {}


def _counts(platform: Any, batch_id: str) -> dict[str, int]:
    from sqlalchemy import func, select

    from conveyor.store.db.engine import reading
    from tasks.files.models import files

    with reading(platform.engine) as conn:
        rows = conn.execute(
            select(files.c.status, func.count()).where(files.c.batch_id == batch_id).group_by(files.c.status)
        ).all()
    return {str(s): int(n) for s, n in rows}


def _summary(batch_id: str, b: Any) -> str:
    return (
        f"batch {batch_id}: {b['status']} total={b['total']} ready={b['ready']} failed={b['failed']} "
        f"cancelled={b['cancelled']}"
    )


@app.command()
def submit(
    paths: list[Path] = typer.Argument(
        ..., exists=True, readable=True, dir_okay=False, help="files to process"
    ),
    user: str = typer.Option("demo", help="owner of the files"),
    timeout: float = typer.Option(600.0, help="seconds to wait for the batch"),
    wait: float = wait_option(),
) -> None:
    """Create a batch, confirm every file, show progress per stage, then the summary.

    Each file is streamed to storage from its path. The command waits for a busy
    database before it writes anything, never after: a batch is never submitted twice.
    """

    def main() -> int:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        from pipelines.files import Upload, batch_status, process_batch
        from tasks.files.models import FAILED, TERMINAL

        stages = _stages()
        platform = load_platform()
        items = [Upload.from_path(p) for p in paths]
        wait_until_writable(platform.engine)
        batch_id = process_batch(platform, user, items)
        console.print(f"batch [bold]{batch_id}[/bold]: {len(items)} file(s)")
        total = len(items)
        deadline = time.monotonic() + timeout
        with Progress(
            TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), console=console
        ) as bar:
            tasks = {name: bar.add_task(name, total=total) for name, _ in stages}
            failed_task = bar.add_task("failed", total=total)
            while True:
                counts = retrying(lambda: _counts(platform, batch_id))
                for name, states in stages:
                    bar.update(tasks[name], completed=sum(counts.get(s, 0) for s in states))
                bar.update(failed_task, completed=counts.get(FAILED, 0))
                if sum(counts.get(s, 0) for s in TERMINAL) >= total or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        status = retrying(lambda: batch_status(platform, batch_id))
        print_table(
            ["file", "status", "error"],
            ((f["name"], f["status"], f["error"] or "") for f in status["files"]),
            short={2: 80},
        )
        b = status["batch"]
        console.print(f"total={b['total']} ready={b['ready']} failed={b['failed']}")
        return 0 if b["terminal"] >= b["total"] else 1

    # Not repeatable (it creates a batch): it waits before its first write instead.
    run_command(main, wait=wait, repeat=False)


@app.command()
def status(
    batch_id: str, user: str = _owner_option(), as_json: bool = json_option(), wait: float = wait_option()
) -> None:
    """A batch's counters and each file's state."""

    def main() -> int:
        from pipelines.files import batch_status

        try:
            s = batch_status(load_platform(), batch_id, **_owner(user))
        except LookupError as exc:
            err.print(str(exc), markup=False)
            return 1
        if as_json:
            print_json({"batch": dict(s["batch"]), "files": records(s["files"])})
            return 0
        print_lines(
            [
                _summary(batch_id, s["batch"]),
                *(
                    f"  {f['status']:<10} {f['name']}  {' '.join((f['error'] or '').split())}"
                    for f in s["files"]
                ),
            ]
        )
        return 0

    run_command(main, wait=wait, read_only=True)


@app.command()
def seal(
    batch_id: str, user: str = _owner_option(), as_json: bool = json_option(), wait: float = wait_option()
) -> None:
    """No more files for the batch: it completes once every file in it is terminal."""

    def main() -> int:
        from pipelines.files import seal_batch

        try:
            b = seal_batch(load_platform(), batch_id, **_owner(user))
        except LookupError as exc:
            err.print(str(exc), markup=False)
            return 1
        if as_json:
            print_json(dict(b))
        else:
            print_lines([f"{_summary(batch_id, b)} sealed={bool(b['sealed'])} terminal={b['terminal']}"])
        return 0

    run_command(main, wait=wait)  # sealing twice is sealing once


@app.command()
def cancel(batch_id: str, user: str = _owner_option(), wait: float = wait_option()) -> None:
    """Cancel the batch's non-terminal files (cancelled counts as terminal)."""

    def main() -> int:
        from pipelines.files import cancel_batch

        try:
            n = cancel_batch(load_platform(), batch_id, by="cli", **_owner(user))
        except LookupError as exc:
            err.print(str(exc), markup=False)
            return 1
        console.print(f"cancelled {n} file(s)")
        return 0

    run_command(main, wait=wait)


@app.command()
def retry(batch_id: str, user: str = _owner_option(), wait: float = wait_option()) -> None:
    """Retry the batch's failed files from the DLQ, each from the stage it failed in."""

    def main() -> int:
        from pipelines.files import retry_failed

        try:
            ids = retry_failed(load_platform(), batch_id, by="cli", **_owner(user))
        except LookupError as exc:
            err.print(str(exc), markup=False)
            return 1
        console.print(f"retried {len(ids)} file(s)")
        return 0

    run_command(main, wait=wait)


@app.command()
def search(
    query: str,
    user: str = typer.Option("demo"),
    limit: int = typer.Option(5, min=1, help="files to show"),
    ranking: str = typer.Option(
        "default", help="default (fused with a model, else lexical) | fused | lexical | vector"
    ),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """USER's ready files that best match QUERY, one line per file (its best chunk)."""
    from pipelines.files import RANKINGS

    if ranking not in RANKINGS:
        raise typer.BadParameter(f"one of {', '.join(RANKINGS)}", param_hint="--ranking")
    if not query.strip():
        raise typer.BadParameter("the query is empty", param_hint="QUERY")

    def main() -> int:
        from pipelines.files import search as run_search

        hits = run_search(load_platform(), query, owner=user, limit=limit, ranking=ranking)  # type: ignore[arg-type]
        if as_json:
            print_json(records(hits))
            return 0
        if not hits:
            err.print("no results")
        rows = [(f"{h.score:.3f}", h.name, h.ordinal, h.text) for h in hits]
        print_table(["score", "file", "chunk", "text"], rows, short={3: 100})
        return 0

    run_command(main, wait=wait, read_only=True)


@app.command()
def reembed(
    user: str = typer.Option(..., "--user", help="whose chunks"), wait: float = wait_option()
) -> None:
    """Re-embed USER's chunks with the configured model (after changing the embedder)."""

    def main() -> int:
        from pipelines.files import reembed as run_reembed

        console.print(f"re-embedded {run_reembed(load_platform(), user)} chunk(s)")
        return 0

    run_command(main, wait=wait)


__all__ = ["app"]
