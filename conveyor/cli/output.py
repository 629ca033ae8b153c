"""What the ``conveyor`` commands print, and how they wait for a busy or unreachable database.

Output: ``--json`` prints JSON alone on stdout (datetimes in ISO 8601). Without it, a
terminal gets rich tables; a pipe gets one tab-separated line per record with every cell
whole, so ``conveyor dlq list | grep NAME`` finds a long name.

Waiting: a command runs under a :class:`Waiter` (``--wait SECONDS``). The CLI's engine
gets a short SQLite busy timeout, and a command that fails because the database is locked
or unreachable is run again, with a status line on stderr, until the wait is over; then it
exits 2 with one line saying what it waited for. A command that is not safe to repeat
(``files submit``) waits *before* its first write (:func:`wait_until_writable`) and then
gives each statement the rest of the wait, never running again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import decimal
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from conveyor.errors import ConveyorError, DatabaseBusy, is_connection_loss
from conveyor.logs import redact_text

if TYPE_CHECKING:
    from sqlalchemy import Engine

# SQLAlchemy and rich's tables are imported where they are used: every command imports
# this module, ``conveyor --help`` too.

T = TypeVar("T")

console = Console()
err = Console(stderr=True)

DEFAULT_WAIT = 30.0
POLL = 0.5  # seconds between tries, and SQLite's busy timeout while a command may repeat


def wait_option() -> Any:
    """``--wait SECONDS``: how long a command waits for a busy or unreachable database."""
    return typer.Option(
        DEFAULT_WAIT,
        "--wait",
        min=0,
        metavar="SECONDS",
        help="wait this long for a locked or unreachable database, then give up (exit 2)",
    )


def json_option() -> Any:
    """``--json``: machine-readable output on stdout."""
    return typer.Option(False, "--json", help="print JSON on stdout (ISO 8601 datetimes), nothing else")


# -- output -----------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """``json.dumps`` default: datetimes in ISO 8601, rows and dataclasses as objects."""
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID | Path):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def print_json(data: Any) -> None:
    """``data`` as JSON, alone on stdout (rich never touches it: no wrapping, no markup)."""
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = dataclasses.asdict(data)
    out = console.file
    out.write(json.dumps(data, default=to_json, ensure_ascii=False, indent=2) + "\n")
    out.flush()


def records(rows: Iterable[Any]) -> list[dict[str, Any]]:
    """Rows (mappings or dataclasses) as plain dicts."""
    return [_record(r) for r in rows]


def _record(row: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    return dict(row)


def _cell(value: Any) -> str:
    return " ".join(str(value).split()) if value is not None else ""


def print_lines(lines: Iterable[str]) -> None:
    """Plain lines on stdout: never wrapped, never read as rich markup."""
    out = console.file
    for line in lines:
        out.write(line + "\n")
    out.flush()


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    title: str | None = None,
    short: Mapping[int, int] | None = None,
) -> None:
    """A rich table on a terminal (column ``i`` cut to ``short[i]`` characters); on a
    pipe a header and one tab-separated line per row, every cell whole (whitespace inside
    a cell becomes one space), the title on stderr."""
    if console.is_terminal:
        from rich.table import Table

        table = Table(*columns, title=title)
        for row in rows:
            cells = [_cell(v) for v in row]
            for i, width in (short or {}).items():
                cells[i] = cells[i][:width]
            table.add_row(*(Text(c) for c in cells))
        console.print(table)
        return
    if title:
        status(title)
    print_lines(["\t".join(columns), *("\t".join(_cell(v) for v in row) for row in rows)])


JOB_COLUMNS = ["id", "stage", "label", "status", "attempts", "created"]
DEAD_LETTER_COLUMNS = ["id", "job", "stage", "label", "error", "message", "attempts", "when"]


def attempts(row: Any) -> str:
    """Counted attempts of the budget, and the uncounted ones (outages, shutdowns,
    preemption), which never use the budget."""
    uncounted = int(row["uncounted"] or 0)
    text = f"{int(row['attempts']) - uncounted}/{row['max_attempts']}"
    if uncounted:
        text += f" +{uncounted} uncounted ({row['requeues']} requeued by outages or shutdowns)"
    return text


def job_cells(r: Any) -> list[Any]:
    """A job row's cells under :data:`JOB_COLUMNS`."""
    created = f"{r['created_at']:%Y-%m-%d %H:%M:%S}"
    return [r["id"], r["stage"], r["label"] or "", r["status"], attempts(r), created]


def dead_letter_cells(e: Any) -> list[Any]:
    """A dead letter's cells under :data:`DEAD_LETTER_COLUMNS`."""
    where = [e["job_id"] or "-", e["stage"] or "-", e["label"] or "-"]
    return [
        e["id"],
        *where,
        e["error_type"],
        e["message"],
        e["attempts"],
        f"{e['created_at']:%m-%d %H:%M:%S}",
    ]


def status(message: str) -> None:
    """One line on stderr, never wrapped, never read as markup."""
    err.print(Text(message), soft_wrap=True, highlight=False)


# -- waiting for the database ------------------------------------------------------------------


class GaveUp(ConveyorError):
    """The database stayed locked or unreachable for the whole ``--wait``."""


LOCKED = "locked by another writer"
UNREACHABLE = "unreachable"
_SQLITE_LOCKED = ("database is locked", "database table is locked", "database schema is locked")
_SQLITE_UNREACHABLE = ("unable to open database file", "disk i/o error", "readonly database")


def database_problem(exc: BaseException) -> tuple[str, str] | None:
    """``(what, detail)`` when ``exc`` means the database is locked or unreachable."""
    if isinstance(exc, DatabaseBusy):
        return LOCKED, ""
    if "sqlalchemy" not in sys.modules:  # then no SQLAlchemy error can exist
        return None
    import sqlalchemy.exc

    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        detail = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else ""
        lowered = detail.lower()
        if any(p in lowered for p in _SQLITE_LOCKED):
            return LOCKED, ""
        if any(p in lowered for p in _SQLITE_UNREACHABLE) or is_connection_loss(exc):
            return UNREACHABLE, redact_text(detail)
        return None
    if isinstance(exc, sqlalchemy.exc.TimeoutError):
        return UNREACHABLE, "no connection came free in the pool"
    return None


def shown_url(url: str | None) -> str:
    """``url`` without its password (or any other secret)."""
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    if not url:
        return "no database configured"
    with contextlib.suppress(sqlalchemy.exc.ArgumentError):
        url = make_url(url).render_as_string(hide_password=True)
    return redact_text(url)


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


class Waiter:
    """How long one command waits for the database (``None``: it never waits, but still
    reports a locked or unreachable database in one line)."""

    def __init__(self, budget: float | None) -> None:
        self.budget = budget
        self.url: str | None = None
        self.read_only = False
        self.thread = threading.get_ident()  # the connections it tunes: the command's own
        self.busy_timeout = POLL  # SQLite's, for connections made from now on
        self._engines: list[Engine] = []
        self._shown = 0.0  # when the last status line went out on a pipe
        self._line = False  # a status line waits on a terminal to be overwritten

    # -- the engine ---------------------------------------------------------------------------

    def attach(self, engine: Engine, url: str | None) -> None:
        """Use this waiter's timeouts on ``engine``'s new connections (in this thread); for
        a read-only command, make the engine's transactions read-only (on SQLite they never
        take the writer) until :meth:`detach`: the CLI's process runs nothing else."""
        from sqlalchemy import event

        from conveyor.store.db.dialect import READ_ONLY

        self.url = url
        if not event.contains(engine, "do_connect", _on_do_connect):
            event.listen(engine, "do_connect", _on_do_connect)
            event.listen(engine, "connect", _on_connect)
        if self.read_only:
            engine.update_execution_options(**{READ_ONLY: True})
        self._engines.append(engine)

    def detach(self) -> None:
        """Undo :meth:`attach` (the engine may outlive the command: tests run it in-process)."""
        from conveyor.store.db.dialect import READ_ONLY

        for engine in self._engines:
            if self.read_only:
                engine.update_execution_options(**{READ_ONLY: False})
        self._engines.clear()

    # -- running ------------------------------------------------------------------------------

    def call(self, op: Callable[[], T], *, repeat: bool = True) -> T:
        """Run ``op``; while the database is locked or unreachable and the wait is not over,
        run it again (only when ``repeat``: ``op`` must be safe to run twice)."""
        started = time.monotonic()
        try:
            while True:
                try:
                    return op()
                except Exception as exc:
                    problem = database_problem(exc)
                    if problem is None:
                        raise
                    waited = time.monotonic() - started
                    budget = self.budget or 0.0
                    if not repeat or waited + POLL / 2 >= budget:
                        raise self.gave_up(problem, waited, repeated=repeat) from exc
                    self.show(problem[0], waited)
                    time.sleep(min(POLL, max(0.0, budget - waited)))
        finally:
            self.clear()

    def until_writable(self, engine: Engine) -> None:
        """Wait until a write transaction can begin (without writing), then let each
        statement wait for the rest of the budget: for a command that must not repeat."""
        from sqlalchemy import text

        started = time.monotonic()

        def probe() -> None:
            with engine.connect() as conn, conn.begin():  # BEGIN IMMEDIATE on SQLite
                conn.execute(text("SELECT 1"))

        self.call(probe)
        if self.budget is not None:
            self.busy_timeout = max(POLL, self.budget - (time.monotonic() - started))

    def gave_up(self, problem: tuple[str, str], waited: float, *, repeated: bool) -> GaveUp:
        what, detail = problem
        where = f"({shown_url(self.url)})" + (f": {detail}" if detail else "")
        if self.budget is None:  # a command that does not wait (``up``, ``worker``, …)
            return GaveUp(f"the database is {what} {where}")
        if repeated and self.budget:
            return GaveUp(f"gave up after {_seconds(self.budget)} s: the database stayed {what} {where}")
        if repeated:
            return GaveUp(f"gave up at once (--wait 0): the database is {what} {where}")
        return GaveUp(
            f"gave up after {_seconds(waited)} s: the database is {what} {where} "
            "(not retried: the command is not safe to repeat; check what it left behind)"
        )

    # -- the status line ----------------------------------------------------------------------

    def show(self, what: str, waited: float) -> None:
        line = f"waiting for the database ({what})… {waited:.0f} s / {_seconds(self.budget or 0.0)} s"
        if err.is_terminal:
            err.file.write(f"\r\x1b[2K{line}")
            err.file.flush()
            self._line = True
        elif not self._shown or time.monotonic() - self._shown >= 5:
            status(line)
            self._shown = time.monotonic()

    def clear(self) -> None:
        if self._line:
            err.file.write("\r\x1b[2K")
            err.file.flush()
            self._line = False
        self._shown = 0.0


_active: list[Waiter] = []


def active() -> Waiter | None:
    """The waiter of the command running now, if any."""
    return _active[-1] if _active else None


def _tuning() -> Waiter | None:
    """The waiter whose timeouts apply to a connection being made in this thread."""
    waiter = active()
    if waiter is None or waiter.budget is None or waiter.thread != threading.get_ident():
        return None
    return waiter


def _on_do_connect(dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
    waiter = _tuning()
    if waiter is None or waiter.budget is None:
        return
    if dialect.name == "sqlite":
        cparams["timeout"] = waiter.busy_timeout
    elif dialect.name == "postgresql":
        # libpq rounds up to 2 s; a black-holed host must not hang the command for minutes.
        wanted = max(2, min(10, math.ceil(waiter.budget)))
        cparams["connect_timeout"] = min(int(cparams.get("connect_timeout") or wanted), wanted)


def _on_connect(dbapi_conn: Any, _record: Any) -> None:
    waiter = _tuning()
    if waiter is None or not _is_sqlite(dbapi_conn):
        return
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={max(1, int(waiter.busy_timeout * 1000))}")
    cur.close()


def _is_sqlite(dbapi_conn: Any) -> bool:
    import sqlite3

    return isinstance(dbapi_conn, sqlite3.Connection)


def run_waiting(fn: Callable[[], int | None], *, wait: float | None, repeat: bool, read_only: bool) -> int:
    """Run a command body under a :class:`Waiter`: locked or unreachable databases are
    waited for, then reported in one line (exit 2); other ConveyorErrors too."""
    waiter = Waiter(wait)
    waiter.read_only = read_only
    _active.append(waiter)
    try:
        return waiter.call(fn, repeat=repeat) or 0
    except ConveyorError as exc:
        err.print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True, highlight=False)
        return 2
    except Exception as exc:
        message = settings_problem(exc)
        if message is None and _missing_table(exc):
            message = "the database has no Conveyor tables (or not all of them): run `conveyor db upgrade`"
        if message is None:
            raise
        err.print(Text.assemble(("error: ", "red"), message), soft_wrap=True, highlight=False)
        return 2
    finally:
        _active.remove(waiter)
        waiter.detach()


def settings_problem(exc: BaseException) -> str | None:
    """One line for settings that cannot be read (``CONVEYOR_*``): the setting and what is
    wrong, never the value (it may be a password); None for any other error."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    if isinstance(exc, SettingsError):
        return f"invalid settings: {exc} (CONVEYOR_* settings in JSON must be valid JSON)"
    if not isinstance(exc, ValidationError) or not exc.title.endswith("Settings"):
        return None
    parts = []
    for e in exc.errors(include_input=False, include_url=False, include_context=False):
        loc = [str(p) for p in e["loc"]]
        name = f"CONVEYOR_{loc[0].upper()}" if loc else "settings"
        parts.append(f"{name}{(' ' + '.'.join(loc[1:])) if loc[1:] else ''}: {e['msg']}")
    return "invalid settings: " + "; ".join(parts)


def _missing_table(exc: Exception) -> bool:
    """A DBAPI error that is Postgres' undefined_table or undefined_function (a migration's
    function), or SQLite's "no such table"."""
    if "sqlalchemy" not in sys.modules:  # then no SQLAlchemy error can exist
        return False
    from sqlalchemy.exc import DBAPIError

    if not isinstance(exc, DBAPIError):
        return False
    return getattr(exc.orig, "sqlstate", None) in ("42P01", "42883") or "no such table" in str(exc.orig)


def wait_until_writable(engine: Engine) -> None:
    """Before a command's first write: wait (with a status line) until it can begin."""
    waiter = active()
    if waiter is not None:
        waiter.until_writable(engine)


def retrying(op: Callable[[], T]) -> T:
    """Run a read ``op`` with the command's wait (each call gets the whole of it)."""
    waiter = active()
    return op() if waiter is None else waiter.call(op)
