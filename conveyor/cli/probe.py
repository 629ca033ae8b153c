"""``conveyor probe``: exit 0 or 1 for a container's liveness and readiness probes.

``conveyor probe worker`` fails when no worker of ``$CONVEYOR_HOME`` runs, or when one
does not consume now: its consumer's event loop has not ticked for ``--max-age`` seconds,
or it waits for a service (readiness). With ``--live`` (liveness) it fails only when a
worker's main loop is stuck: a worker waiting for its broker, Redis or Postgres ticks
too, so an outage, however long, restarts no worker (see :mod:`conveyor.worker.loop_probe`).
It reads files only, never the services.

``conveyor probe beat`` passes when some beat holds the beat lock (this one, or another
while this one stands by: see :mod:`conveyor.upkeep.beat_lock`), so that the schedule fires.
"""

from __future__ import annotations

import typer

from conveyor.cli.common import cli
from conveyor.settings import ConveyorSettings

probe_cli = typer.Typer(help="Health probes for containers (exit 0: healthy, 1: not).", no_args_is_help=True)
cli.add_typer(probe_cli, name="probe")


@probe_cli.command("worker")
def probe_worker(
    max_age: float = typer.Option(
        30.0, min=1.0, help="fail when a worker's consumer loop has not ticked for this many seconds"
    ),
    live: bool = typer.Option(
        False,
        "--live",
        help="liveness: pass while a worker's main loop ticks, also while it waits for the broker, "
        "Redis or Postgres (an outage alone never fails it); without it, readiness: consuming now",
    ),
) -> None:
    """Whether this host's (container's) workers are consuming (with --live: alive)."""
    from conveyor.worker.loop_probe import check

    ok, reason = check(ConveyorSettings().resolved_home(), max_age, live=live)
    typer.echo(reason, err=not ok)
    raise typer.Exit(0 if ok else 1)


@probe_cli.command("beat")
def probe_beat() -> None:
    """Whether a beat holds the beat lock, so the schedule fires (this beat or another)."""
    from conveyor.upkeep.beat_lock import BeatLock

    try:
        held = BeatLock(ConveyorSettings()).held_anywhere()
    except Exception as exc:
        typer.echo(f"could not read the beat lock: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo("ok: a beat holds the beat lock" if held else "no beat holds the beat lock", err=not held)
    raise typer.Exit(0 if held else 1)
