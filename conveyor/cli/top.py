"""``conveyor top``: a terminal view of queues, running jobs and throughput, refreshed in
place (Rich), for people without the console open. A caller's command: it reads the
database and the broker, never the deployment's code (queues come from the stage registry
and the jobs themselves)."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import TYPE_CHECKING, Any

import typer

from conveyor.cli import output as out
from conveyor.cli.common import cli, run_command
from conveyor.cli.output import console, json_option
from conveyor.settings import ConveyorSettings

if TYPE_CHECKING:
    from rich.console import Group

    from conveyor.upkeep.gauges import State

PARKED = ("waiting_lease", "waiting_dedup", "throttled")


def _queues(client: Any) -> list[str]:
    """The queues the registry's stages use (empty before a worker registered them)."""
    from conveyor.client import registry
    from conveyor.errors import ConfigurationError

    try:
        return sorted({stage.queue for stage in registry.load(client.connections.engine).values()})
    except ConfigurationError:
        return []


def render(state: State, *, now: dt.datetime | None = None) -> Group:
    """Three tables: queues, throughput and health, running jobs."""
    from rich.console import Group
    from rich.table import Table

    queues = Table(title="queues", title_justify="left", expand=False)
    for name in ("queue", "waiting (broker)", "queued", "running", "retrying", "parked"):
        queues.add_column(name, justify="left" if name == "queue" else "right")
    for q in state.queues():
        parked = sum(state.live.get((q, st), 0) for st in PARKED)
        waiting = str(state.queue_lengths.get(q, 0)) if state.broker_up else "?"
        queues.add_row(
            q,
            waiting,
            *(str(state.live.get((q, st), 0)) for st in ("queued", "running", "retrying")),
            str(parked),
        )
    per_minute = 60.0 / state.window
    health = Table(title=f"last {state.window:g} s", title_justify="left", show_header=False)
    health.add_column("what")
    health.add_column("value", justify="right")
    for status in ("succeeded", "dead", "cancelled", "expired"):
        n = state.finished.get(status, 0)
        health.add_row(f"{status} / min", f"{n * per_minute:g}")
    health.add_row("dead letters open", str(state.dead_letters))
    health.add_row("publish lag", f"{state.publish_lag:.1f} s")
    health.add_row("outbox lag", f"{state.outbox_lag:.1f} s")
    health.add_row("broker", "up" if state.broker_up else "[red]not answering[/red]")
    running = Table(title=f"running ({len(state.running)} longest)", title_justify="left")
    for name in ("job", "stage", "label", "attempt", "worker", "for", "progress"):
        running.add_column(name, overflow="fold")
    now = now or dt.datetime.now(dt.UTC)
    for row in state.running:
        started = row["started_at"]
        if started is not None and started.tzinfo is None:
            started = started.replace(tzinfo=dt.UTC)
        took = f"{(now - started).total_seconds():.0f} s" if started else ""
        running.add_row(
            str(row["id"])[:8],
            row["stage"],
            row["label"] or "",
            str(row["attempts"]),
            row["lease_owner"] or "",
            took,
            json.dumps(row["progress"], default=out.to_json) if row["progress"] is not None else "",
        )
    return Group(queues, health, running)


def _record(state: State) -> dict[str, Any]:
    from conveyor.upkeep.gauges import LIVE

    return {
        "queues": {
            q: {"waiting": state.queue_lengths.get(q), **{st: state.live.get((q, st), 0) for st in LIVE}}
            for q in state.queues()
        },
        "finished": state.finished,
        "window_seconds": state.window,
        "dead_letters": state.dead_letters,
        "publish_lag_seconds": state.publish_lag,
        "outbox_lag_seconds": state.outbox_lag,
        "broker_up": state.broker_up,
        "running": out.records(state.running),
    }


@cli.command("top")
def top(
    interval: float = typer.Option(2.0, min=0.2, help="seconds between readings"),
    rows: int = typer.Option(15, min=1, help="running jobs shown (the longest-running first)"),
    window: float = typer.Option(60.0, min=1, help="throughput over the last this many seconds"),
    once: bool = typer.Option(False, "--once", help="print one reading and exit"),
    as_json: bool = json_option(),
) -> None:
    """Queues, running jobs and throughput, refreshed in place (Ctrl-C to quit)."""

    def main() -> int:
        from rich.live import Live

        from conveyor.client.by_name import Client
        from conveyor.delivery.services import attach_or_fail
        from conveyor.upkeep.gauges import read_state

        settings = ConveyorSettings()
        found = attach_or_fail(settings)
        client = Client(settings.with_urls(found.redis_url, found.database_url))
        try:
            queues = _queues(client)

            def reading() -> State:
                return read_state(client.connections, queues, running=rows, window=window)

            if as_json:
                out.print_json(_record(reading()))
                return 0
            if once or not console.is_terminal:
                console.print(render(reading()))
                return 0
            with Live(render(reading()), console=console, auto_refresh=False) as live:
                try:
                    while True:
                        time.sleep(interval)
                        live.update(render(reading()), refresh=True)
                except KeyboardInterrupt:
                    return 0
        finally:
            client.close()

    run_command(main, read_only=True)


__all__ = ["render", "top"]
