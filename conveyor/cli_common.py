"""What every ``conveyor`` command shares: the command groups, the deployment's platform,
and running a command body (errors as one line, waiting for a busy database)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from conveyor import cli_output as out
from conveyor import registry
from conveyor.deployment import import_object, load_app_module
from conveyor.errors import NotRunning

cli = typer.Typer(help="Conveyor: Celery jobs that are always accounted for.", no_args_is_help=True)
jobs_cli = typer.Typer(help="Inspect and cancel jobs.", no_args_is_help=True)
dlq_cli = typer.Typer(help="The dead-letter queue.", no_args_is_help=True)
db_cli = typer.Typer(help="Database schema.", no_args_is_help=True)
cli.add_typer(jobs_cli, name="jobs")
cli.add_typer(dlq_cli, name="dlq")
cli.add_typer(db_cli, name="db")


def import_path(path: str) -> Any:
    """``module:attr`` (or a bare module) of the deployment, imported from its directory:
    the app, a command group, the migrations."""
    return import_object(path)


def load_platform(*, require_services: bool = True) -> Any:
    """Import the deployment's app module and return its platform (its engine set up for
    the running command's ``--wait``)."""
    platform = load_app_module().platform
    if require_services and not (platform.settings.redis_url and platform.settings.database_url):
        raise NotRunning(
            "nothing to attach to: start `conveyor up` (same CONVEYOR_HOME) or set "
            "CONVEYOR_REDIS_URL and CONVEYOR_DATABASE_URL"
        )
    waiter = out.active()
    if waiter is not None and platform.settings.database_url:
        waiter.attach(platform.engine, platform.settings.database_url)
    return platform


def migrate(platform: Any) -> None:
    """Upgrade the schema: the deployment's migrations (its app module's ``MIGRATIONS``)
    if it names them, else the platform's own; then register its stages."""
    path = getattr(load_app_module(), "MIGRATIONS", None)
    if path:
        upgrade: Callable[[Any], None] = import_path(path)
    else:
        from conveyor.db.migrate import upgrade as upgrade
    upgrade(platform.engine)
    platform.app.loader.import_default_modules()
    registry.write(platform.engine, platform.stages.values())


def run_command(
    fn: Callable[[], int | None], *, wait: float | None = None, repeat: bool = True, read_only: bool = False
) -> None:
    """Run a command body: ConveyorErrors become a clear message and exit code 2.

    With ``wait`` (the command's ``--wait``), a locked or unreachable database is waited
    for that long, running ``fn`` again (only if ``repeat``: it must be safe to run twice;
    otherwise call :func:`conveyor.cli_output.wait_until_writable` before the first write)
    with a status line on stderr, then reported in one line (exit 2). ``read_only``: the
    command only reads, so on SQLite it never queues behind the writer.
    """
    raise typer.Exit(out.run_waiting(fn, wait=wait, repeat=repeat, read_only=read_only))


__all__ = ["cli", "db_cli", "dlq_cli", "import_path", "jobs_cli", "load_platform", "migrate", "run_command"]
