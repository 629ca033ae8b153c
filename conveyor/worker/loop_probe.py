"""Whether a worker's main loop is alive, and whether it consumes: it touches a file every second.

A process that is merely running says nothing: a worker whose consumer is wedged (its
main thread blocked, the process stopped) still answers on its metrics port, which a
thread of its own serves. So the worker's main thread writes the time and what it does
into ``$CONVEYOR_HOME/probe/worker-<pid>``: the consumer's own timer, fired only by the
event loop between polls of the broker, writes ``consuming``; while the worker waits
for a service instead (Redis or Postgres at start, the broker at start or after losing
it: kombu's retry loop), that wait writes ``waiting for …`` about every second.
:func:`check` (``conveyor probe worker``) reads every live worker's file: readiness fails
when one is not consuming now; liveness (``--live``) only when one's main thread has not
ticked within the allowed age, so an outage, however long, restarts no worker.

The timer is the consumer's (kombu's hub timer under the prefork pool): it fires while the
pool children run jobs. Under ``-P solo`` a running job blocks the loop, so the allowed
age must then exceed the longest job.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import bootsteps

TICK_INTERVAL = 1.0
PREFIX = "worker-"
CONSUMING = "consuming"


def probe_dir(home: Path) -> Path:
    """Where the workers of ``home`` write their ticks."""
    return home / "probe"


def tick_path(home: Path, pid: int | None = None) -> Path:
    """The tick file of worker process ``pid`` (default: this process)."""
    return probe_dir(home) / f"{PREFIX}{pid or os.getpid()}"


def write_tick(path: Path, state: str = CONSUMING) -> None:
    """Record now (wall clock, as the probe reads it) and what the worker does (``state``)
    in ``path``, atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{time.time()!r} {state}")
    os.replace(tmp, path)


def ticker(app: Any) -> Callable[[str], None] | None:
    """What writes this worker's tick with a state while it waits for a service, when its
    app runs :class:`LoopTicks` (``conveyor worker``); else None."""
    if LoopTicks not in app.steps["consumer"]:
        return None
    path = tick_path(app.conveyor.settings.resolved_home())

    def tick(state: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tick(path, state)

    return tick


@dataclass(frozen=True)
class Worker:
    """One worker process found in the probe directory, its last tick's age and what it
    was doing then."""

    pid: int
    age: float
    state: str = CONSUMING


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def workers(home: Path, now: float | None = None) -> list[Worker]:
    """The live workers of ``home`` with the age of their last tick; files of processes
    that no longer run are removed (a restarted container reuses the directory)."""
    now = time.time() if now is None else now
    found = []
    directory = probe_dir(home)
    if not directory.is_dir():
        return []
    for path in sorted(directory.glob(f"{PREFIX}*")):
        pid_text = path.name.removeprefix(PREFIX)
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if not _alive(pid):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        try:
            stamp, _, state = path.read_text().partition(" ")
            age = max(0.0, now - float(stamp))
        except (OSError, ValueError):
            continue  # being replaced right now: the next probe reads it
        found.append(Worker(pid, age, state.strip() or CONSUMING))
    return found


def check(home: Path, max_age: float, *, live: bool = False) -> tuple[bool, str]:
    """``(ok, reason)``: ok when at least one worker of ``home`` runs and every one ticked
    within ``max_age`` seconds, consuming; with ``live``, also while waiting for a service
    (its main thread still runs)."""
    found = workers(home)
    if not found:
        return False, f"no running worker has ticked in {probe_dir(home)} (not started, or exited)"
    stale = [w for w in found if w.age > max_age]
    if stale:
        listed = ", ".join(f"pid {w.pid} {w.age:.1f}s ago ({w.state})" for w in stale)
        loop = "main loop" if live else "consumer event loop"
        return False, f"{loop} stuck: last tick {listed} (allowed {max_age:g}s)"
    waiting = [w for w in found if w.state != CONSUMING]
    if waiting and not live:
        listed = ", ".join(f"pid {w.pid} {w.state}" for w in waiting)
        return False, f"not consuming: {listed}"
    listed = ", ".join(f"pid {w.pid} {w.age:.1f}s ago ({w.state})" for w in found)
    return True, f"ok: last tick {listed}"


class LoopTicks(bootsteps.StartStopStep):  # type: ignore[misc]
    """A consumer step: once the consumer consumes, its timer writes the tick file every
    :data:`TICK_INTERVAL`; the file goes when the worker stops cleanly. A reconnect
    stops and starts the consumer's steps again: while kombu retries the broker, its
    retry loop ticks ``waiting for the broker`` instead (the consumer's ``while_waiting``,
    :class:`conveyor.worker.consumer.Consumer`)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self._entry: Any = None
        self._path: Path | None = None
        hooks = getattr(parent, "while_waiting", None)
        if isinstance(hooks, list):
            hooks.append(self._waiting)

    def _waiting(self, consumer: Any) -> None:
        if self._path is None:
            self._path = tick_path(consumer.app.conveyor.settings.resolved_home())
            self._path.parent.mkdir(parents=True, exist_ok=True)
        write_tick(self._path, "waiting for the broker")

    def start(self, parent: Any) -> None:
        home = parent.app.conveyor.settings.resolved_home()
        self._path = tick_path(home)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        path = self._path
        self._entry = parent.timer.call_repeatedly(TICK_INTERVAL, write_tick, (path,))

    def stop(self, parent: Any) -> None:
        if self._entry is not None:
            self._entry.cancel()
            self._entry = None

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)
        if self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()


__all__ = [
    "CONSUMING",
    "LoopTicks",
    "Worker",
    "check",
    "probe_dir",
    "tick_path",
    "ticker",
    "workers",
    "write_tick",
]
