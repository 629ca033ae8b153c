"""``conveyor``: run the platform, inspect jobs, work the DLQ, run the self-check.

The commands that run processes (``up``, ``worker``, ``beat``, ``flower``, ``demo``) are
in :mod:`conveyor.cli.run`; the rest (``db``, ``jobs``, ``dlq``) are here.
"""

from __future__ import annotations

import json
import socket

import typer

from conveyor.cli import output as out
from conveyor.cli import (
    probe,  # noqa: F401  (registers probe)
    run,  # noqa: F401  (registers up, worker, beat, flower and demo)
    top,  # noqa: F401  (registers top)
    web,  # noqa: F401  (registers serve, openapi, tokens and stages)
)
from conveyor.cli.common import (
    attached_engine,
    cli,
    db_cli,
    dlq_cli,
    jobs_cli,
    load_platform,
    migrate,
    run_command,
)
from conveyor.cli.output import console, err, json_option, wait_option
from conveyor.errors import RetryRefused
from conveyor.logs import configure_logging_on_first_record
from conveyor.settings import ConveyorSettings

__all__ = ["cli", "console", "err", "json_option", "load_platform", "main", "run_command", "wait_option"]


@db_cli.command("upgrade")
def db_upgrade(wait: float = wait_option()) -> None:
    """Create or upgrade the platform's and the families' tables."""

    def main() -> int:
        migrate(load_platform())
        console.print("migrated: the database is up to date")
        return 0

    run_command(main, wait=wait)


# -- jobs ---------------------------------------------------------------------------------


@jobs_cli.command("list")
def jobs_list(
    status: str = typer.Option(None),
    stage: str = typer.Option(None),
    limit: int = typer.Option(50),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """Newest jobs first."""
    from conveyor.store.db.schema import STATUSES

    if status and status not in STATUSES:
        known = ", ".join(STATUSES)
        raise typer.BadParameter(f"{status!r} is no job status; one of: {known}", param_hint="--status")

    def main() -> int:
        from sqlalchemy import select

        from conveyor.store.db.engine import reading
        from conveyor.store.db.schema import jobs

        # Rows alone: no platform, so neither the deployment nor Celery is imported.
        engine = attached_engine()
        q = select(jobs).order_by(jobs.c.created_at.desc()).limit(limit)
        if status:
            q = q.where(jobs.c.status == status)
        if stage:
            q = q.where(jobs.c.stage == stage)
        try:
            with reading(engine) as conn:
                rows = list(conn.execute(q).mappings())
        finally:
            engine.dispose()
        if as_json:
            out.print_json(out.records(rows))
            return 0
        out.print_table(out.JOB_COLUMNS, map(out.job_cells, rows))
        return 0

    run_command(main, wait=wait, read_only=True)


@jobs_cli.command("show")
def jobs_show(job_id: str, as_json: bool = json_option(), wait: float = wait_option()) -> None:
    """One job, with its events."""

    def main() -> int:
        platform = load_platform()
        handle = platform.job(job_id)
        try:
            row = dict(handle.row())
        except LookupError as exc:
            err.print(str(exc))
            return 1
        events, _ = handle.events()
        if as_json:
            out.print_json({**row, "events": out.records(events)})
            return 0
        console.print_json(json.dumps(row, default=out.to_json))
        console.print(f"attempts: {out.attempts(row)}", markup=False)
        out.print_lines(
            f"  {e.position:>16}  {e.topic:<20} {json.dumps(e.body, default=out.to_json)}" for e in events
        )
        return 0

    run_command(main, wait=wait, read_only=True)


@jobs_cli.command("cancel")
def jobs_cancel(
    job_id: str,
    reason: str = typer.Option(None, help="why (recorded with the job)"),
    wait: float = wait_option(),
) -> None:
    """Cancel a queued, delayed, parked or running job; prints the resulting status."""

    def main() -> int:
        try:
            status = load_platform().cancel(job_id, by=f"cli@{socket.gethostname()}", reason=reason)
        except LookupError as exc:
            err.print(str(exc))
            return 1
        console.print(f"job {job_id}: {status}", markup=False)
        return 0

    run_command(main, wait=wait)


# -- dlq ----------------------------------------------------------------------------------


@dlq_cli.command("list")
def dlq_list(
    stage: str = typer.Option(None),
    queue: str = typer.Option(None),
    page: int = typer.Option(1),
    per_page: int = typer.Option(50),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """Open dead letters, newest first, with each job's label."""

    def main() -> int:
        result = load_platform().dlq.list(stage=stage, queue=queue, page=page, per_page=per_page)
        if as_json:
            out.print_json(out.records(result.items))
            return 0
        out.print_table(
            out.DEAD_LETTER_COLUMNS,
            map(out.dead_letter_cells, result.items),
            title=f"dead letters (page {result.page}, {result.total} open)",
            short={5: 80},
        )
        return 0

    run_command(main, wait=wait, read_only=True)


@dlq_cli.command("show")
def dlq_show(entry_id: int, as_json: bool = json_option(), wait: float = wait_option()) -> None:
    """One dead letter, with traceback and headers."""

    def main() -> int:
        entry = load_platform().dlq.show(entry_id)
        if entry is None:
            err.print(f"no dead letter {entry_id}")
            return 1
        if as_json:
            out.print_json(dict(entry))
        else:
            console.print_json(json.dumps(dict(entry), default=out.to_json))
        return 0

    run_command(main, wait=wait, read_only=True)


@dlq_cli.command("retry")
def dlq_retry(entry_id: int, wait: float = wait_option()) -> None:
    """Retry one entry's job with a fresh attempt budget."""

    def main() -> int:
        job = load_platform().dlq.retry(entry_id, by=f"cli@{socket.gethostname()}")
        if job is None:
            err.print(f"dead letter {entry_id} is not retryable (already retried, or no job)")
            return 1
        console.print(f"retrying job {job}")
        return 0

    run_command(main, wait=wait)


@dlq_cli.command("retry-all")
def dlq_retry_all(
    stage: str = typer.Option(None), queue: str = typer.Option(None), wait: float = wait_option()
) -> None:
    """Retry every open entry matching the filters."""

    def main() -> int:
        refused: list[RetryRefused] = []
        ids = load_platform().dlq.retry_all(stage=stage, queue=queue, refused=refused)
        console.print(f"retried {len(ids)} job(s)")
        for exc in refused:
            err.print(str(exc), markup=False)
        return 1 if refused else 0

    run_command(main, wait=wait)


@dlq_cli.command("purge")
def dlq_purge(
    older_than_days: float = typer.Option(None, help="default: the retention setting"),
    wait: float = wait_option(),
) -> None:
    """Delete dead letters past retention."""

    def main() -> int:
        n = load_platform().dlq.purge(older_than_days=older_than_days)
        console.print(f"purged {n} dead letter(s)")
        return 0

    run_command(main, wait=wait)


def _configure_logs() -> None:
    """Structured logs on stderr for the command itself (a worker or beat sets them up again
    when Celery starts, with its ``-l``), set up when it first logs."""
    try:
        settings = ConveyorSettings()
    except ValueError:  # invalid settings: the command itself reports them
        return
    configure_logging_on_first_record(settings)


def main() -> None:
    """Console entry point."""
    _configure_logs()
    cli()


if __name__ == "__main__":
    main()
