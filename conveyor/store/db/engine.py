"""Engines: psycopg 3 for Postgres, the stdlib driver for the embedded SQLite file."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, make_url
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.pool import ConnectionPoolEntry, NullPool, QueuePool

from conveyor.errors import mark_own
from conveyor.store.db.dialect import READ_ONLY, WRITE_WAIT, LockingConnection, configure_engine
from conveyor.store.db.namespace import SCHEMA, checked_schema, namespace_dialect, translate_map


def normalize_url(url: str) -> str:
    """Point plain ``postgresql://`` URLs at psycopg 3."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def sqlite_url(home: Path) -> str:
    """The embedded default database inside ``home``."""
    return f"sqlite:///{(home / 'conveyor.db').resolve()}"


def keepalive_args(idle: int = 30, interval: int = 10, count: int = 3) -> dict[str, int]:
    """libpq connect arguments that find a silent server (its host or the link to it gone):
    TCP keepalives after ``idle`` s, every ``interval`` s, ``count`` times; and the same
    bound while sent data is unacknowledged (``tcp_user_timeout``, ms), where keepalives
    do not apply. Without them a query on a dead link waits for the kernel's ~15 min of
    retransmissions."""
    return {
        "keepalives": 1,
        "keepalives_idle": idle,
        "keepalives_interval": interval,
        "keepalives_count": count,
        "tcp_user_timeout": (idle + interval * count) * 1000,
    }


def make_engine(
    url: str,
    *,
    pool_size: int = 5,
    connect_timeout: int = 10,
    schema: str = SCHEMA,
    keepalives: dict[str, int] | None = None,
) -> Engine:
    """Create an engine with bounded pools and dialect setup applied. A Postgres that
    accepts connections and never answers fails a connect after ``connect_timeout`` s, and
    one that goes silent later is found by ``keepalives`` (default :func:`keepalive_args`).
    Conveyor's tables are in ``schema`` (on SQLite: prefixed with it).

    The engine is Conveyor's own: every error it (or its pool) raises is marked so
    (:func:`conveyor.errors.is_own_outage`), and only such a lost connection requeues a
    running job uncounted; a stage body's own engine is made elsewhere."""
    url = normalize_url(url)
    schema = checked_schema(schema)
    if url.startswith("sqlite"):
        # One connection per checkout: SQLite connections are cheap and must not cross threads.
        engine = create_engine(
            url,
            hide_parameters=True,
            poolclass=NullPool,
            connect_args={"check_same_thread": False, "factory": LockingConnection, "timeout": 30},
        )
    else:
        pooling: dict[str, Any] = (
            {
                "poolclass": _OwnQueuePool,
                "pool_size": pool_size,
                "max_overflow": 0,
                "pool_timeout": 30,
                "pool_recycle": 1800,
            }
            if pool_size > 0
            else {"poolclass": NullPool}  # nothing left open between uses (tests)
        )
        engine = create_engine(
            url,
            hide_parameters=True,
            pool_pre_ping=False,
            **pooling,
            connect_args={
                "connect_timeout": max(2, connect_timeout),
                **(keepalive_args() if keepalives is None else keepalives),
                # Raw SQL of migrations, functions and the deployment finds the tables
                # unqualified; a caller's own options in the URL are kept.
                "options": _options(url, schema),
            },
            execution_options={"schema_translate_map": translate_map(schema)},
        )
    namespace_dialect(engine.dialect, schema)
    configure_engine(engine)
    event.listen(engine, "handle_error", _mark_own)
    return engine


def _mark_own(context: ExceptionContext) -> None:
    # Every DBAPI error of this engine, connects included (SQLAlchemy 2 calls the hook for
    # them too); whether it is a lost connection is judged from the error itself.
    mark_own(context.original_exception)
    if context.sqlalchemy_exception is not None:
        mark_own(context.sqlalchemy_exception)


class _OwnQueuePool(QueuePool):
    """The pool of Conveyor's own engine: its checkout timeout is marked as ours too."""

    # SQLAlchemy names a pool's logger after its class: keep QueuePool's (and its level).
    _sqla_logger_namespace = "sqlalchemy.pool.impl.QueuePool"

    def _do_get(self) -> ConnectionPoolEntry:
        try:
            return super()._do_get()
        except PoolTimeout as exc:
            mark_own(exc)
            raise


def _options(url: str, schema: str) -> str:
    given = make_url(url).query.get("options")
    mine = f"-c search_path={schema},public"
    return " ".join([*([given] if isinstance(given, str) else list(given or ())), mine])


def reading(engine: Engine) -> Connection:
    """A connection for reads only. On SQLite it neither takes nor waits for the single
    writer, so a stage body holding it for long never stalls status reads or stop polls."""
    return engine.connect().execution_options(**{READ_ONLY: True})


def brief_write(engine: Engine, wait: float) -> AbstractContextManager[Connection]:
    """A write transaction for a caller that must not queue behind a long one (heartbeats,
    the relay): on SQLite it waits at most ``wait`` seconds for the writer, then raises
    :class:`~conveyor.errors.DatabaseBusy`. On Postgres, an ordinary transaction."""
    return engine.execution_options(**{WRITE_WAIT: wait}).begin()
