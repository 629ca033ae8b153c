"""What every ``conveyor`` command shares: the command groups, the deployment's platform,
and running a command body (errors as one line, waiting for a busy database).

Start-up imports only what the command named needs: the modules that register commands
import their implementation inside the command function, the deployment's command groups
(``CLI_EXTENSIONS``) are imported when one is named or the commands are listed, and its
app module (Celery, the platform) only by a command that needs the platform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperGroup

from conveyor.cli import output as out
from conveyor.deployment import import_object, load_app_module
from conveyor.errors import NotRunning
from conveyor.settings import ConveyorSettings

if TYPE_CHECKING:
    from sqlalchemy import Engine


class _Commands(TyperGroup):
    """``conveyor``'s top-level group: the deployment's command groups join it the first
    time a command it lacks is named, or the commands are listed (``--help``).

    (Contexts and commands are typed ``Any``: typer's own copy of click is private.)
    """

    _extended = False

    def list_commands(self, ctx: Any) -> list[str]:
        self._extend()
        return super().list_commands(ctx)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        found = super().get_command(ctx, cmd_name)
        if found is None and not self._extended:
            self._extend()
            found = super().get_command(ctx, cmd_name)
        return found

    def _extend(self) -> None:
        if self._extended:
            return
        self._extended = True
        for name, group in _deployment_commands().items():
            # A built-in command keeps its name: it was found without the deployment.
            self.commands.setdefault(name, _as_click(group, name))


def _deployment_commands() -> dict[str, Any]:
    """The command groups the deployment adds (``CLI_EXTENSIONS``: name → ``module:attr``
    of a Typer app), imported; none when the deployment cannot be imported (the platform's
    commands must work even then). A group that fails to import says so.

    ``CLI_EXTENSIONS`` is read from the app module's package when that declares it (as
    ``config/__init__.py`` does: listing the commands then imports no Celery app), else
    from the app module itself.
    """
    try:
        settings = ConveyorSettings()
        package = settings.app.partition(":")[0].rpartition(".")[0]
        declared = getattr(import_object(package, settings), "CLI_EXTENSIONS", None) if package else None
        if declared is None:
            declared = getattr(load_app_module(settings), "CLI_EXTENSIONS", {})
    except Exception:  # a broken deployment: its commands are missing, and say nothing more
        return {}
    return {name: import_path(path) for name, path in declared.items()}


def _as_click(group: Any, name: str) -> Any:
    """A deployment's Typer app as a sub-command, made by ``add_typer`` as before."""
    if not isinstance(group, typer.Typer):
        return group  # already a command
    holder = typer.Typer(rich_markup_mode=cli.rich_markup_mode)
    holder.add_typer(group, name=name)
    return typer.main.get_command(holder).commands[name]  # type: ignore[attr-defined]


cli = typer.Typer(
    help="Conveyor: Celery jobs that are always accounted for.", no_args_is_help=True, cls=_Commands
)
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


def attached_settings() -> ConveyorSettings:
    """The services to use: ``CONVEYOR_*`` URLs, else those of a running ``conveyor up``."""
    from conveyor.delivery.services import attach_or_fail

    settings = ConveyorSettings()
    found = attach_or_fail(settings)
    return settings.with_urls(found.redis_url, found.database_url)


def attached_engine() -> Engine:
    """An engine on Conveyor's database for a command that needs nothing else of the
    platform (no deployment imported; waited for with ``--wait``). Dispose of it after."""
    from conveyor.store.db.engine import make_engine

    settings = attached_settings()
    assert settings.database_url
    engine = make_engine(
        settings.database_url,
        pool_size=1,
        connect_timeout=settings.db_connect_timeout,
        schema=settings.db_schema,
    )
    waiter = out.active()
    if waiter is not None:
        waiter.attach(engine, settings.database_url)
    return engine


def migrate(platform: Any) -> None:
    """Upgrade the schema: the deployment's migrations (its app module's ``MIGRATIONS``)
    if it names them, else the platform's own; then register its stages."""
    from conveyor.client import registry

    path = getattr(load_app_module(), "MIGRATIONS", None)
    if path:
        upgrade: Callable[[Any], None] = import_path(path)
    else:
        from conveyor.store.db.migrate import upgrade as upgrade
    upgrade(platform.engine)
    platform.app.loader.import_default_modules()
    registry.write(platform.engine, platform.stages.values())


def run_command(
    fn: Callable[[], int | None], *, wait: float | None = None, repeat: bool = True, read_only: bool = False
) -> None:
    """Run a command body: ConveyorErrors become a clear message and exit code 2.

    With ``wait`` (the command's ``--wait``), a locked or unreachable database is waited
    for that long, running ``fn`` again (only if ``repeat``: it must be safe to run twice;
    otherwise call :func:`conveyor.cli.output.wait_until_writable` before the first write)
    with a status line on stderr, then reported in one line (exit 2). ``read_only``: the
    command only reads, so on SQLite it never queues behind the writer.
    """
    raise typer.Exit(out.run_waiting(fn, wait=wait, repeat=repeat, read_only=read_only))


__all__ = [
    "attached_engine",
    "attached_settings",
    "cli",
    "db_cli",
    "dlq_cli",
    "import_path",
    "jobs_cli",
    "load_platform",
    "migrate",
    "run_command",
]
