"""``conveyor probe``: exit 0 or 1 for a container's liveness and readiness probes.

``conveyor probe worker`` fails when no worker of ``$CONVEYOR_HOME`` runs a consumer, or
when one's event loop has not ticked for ``--max-age`` seconds (see
:mod:`conveyor.loop_probe`); it reads files only, never the services, so a broker or
database outage does not by itself make every worker fail at once.
"""

from __future__ import annotations

import typer

from conveyor.cli_common import cli
from conveyor.loop_probe import check
from conveyor.settings import ConveyorSettings

probe_cli = typer.Typer(help="Health probes for containers (exit 0: healthy, 1: not).", no_args_is_help=True)
cli.add_typer(probe_cli, name="probe")


@probe_cli.command("worker")
def probe_worker(
    max_age: float = typer.Option(
        30.0, min=1.0, help="fail when a worker's consumer loop has not ticked for this many seconds"
    ),
) -> None:
    """Whether this host's (container's) workers are consuming: their loops tick."""
    ok, reason = check(ConveyorSettings().resolved_home(), max_age)
    typer.echo(reason, err=not ok)
    raise typer.Exit(0 if ok else 1)
