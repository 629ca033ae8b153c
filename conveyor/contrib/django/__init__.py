"""Conveyor in a Django project: ``INSTALLED_APPS += ["conveyor.contrib.django"]``.

``submit()`` writes the job's row through Django's own connection, in the transaction of
the ``atomic()`` block it is called in (or in one of its own), and publishes it with
``transaction.on_commit(..., robust=True)``: a rollback leaves no job, and a crash between
the commit and the publish leaves it to the workers' relay. Settings come from
``settings.CONVEYOR`` (see :mod:`conveyor.contrib.django.conf`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from conveyor.errors import SubmitFailed

if TYPE_CHECKING:
    from conveyor.client.by_name import Client
    from conveyor.client.handle import JobHandle
    from conveyor.contrib.django.lend import Lender

_lock = threading.Lock()
_clients: dict[tuple[str, str], tuple[Client, Lender]] = {}


class _Atomic:
    """Django's current transaction on one database, as Conveyor's submit joins it."""

    def __init__(self, conn: Connection, alias: str) -> None:
        self._conn = conn
        self._alias = alias

    def connection(self) -> Connection:
        return self._conn

    def after_commit(self, fn: Callable[[], None], job_id: str) -> None:
        from django.db import transaction

        # robust: a publish that fails is logged by Django and left to the relay; it never
        # turns the caller's committed request into an error.
        transaction.on_commit(fn, using=self._alias, robust=True)


def _pair(using: str | None) -> tuple[Client, Lender]:
    from conveyor.client.by_name import Client
    from conveyor.contrib.django import conf
    from conveyor.contrib.django.lend import Lender

    alias = conf.alias(using)
    key = (alias, conf.database_url(alias))  # follows Django to its test database
    with _lock:
        found = _clients.get(key)
        if found is None:
            client = Client(conf.conveyor_settings(alias))
            found = _clients[key] = (client, Lender(client.connections.engine, alias))
        return found


def close() -> None:
    """Close every client (their database connections and Redis); the next call opens
    them again. Tests call it before Django drops the test database."""
    with _lock:
        pairs = list(_clients.values())
        _clients.clear()
    for the_client, lender in pairs:
        lender.engine.dispose()
        the_client.close()


def client(using: str | None = None) -> Client:
    """The :class:`conveyor.Client` on Django's database ``using`` (default: the one
    ``settings.CONVEYOR["DATABASE"]`` names): ``job(id)``, ``cancel``, ``dlq``, ``stages``."""
    return _pair(using)[0]


def job(job_id: str, using: str | None = None) -> JobHandle:
    """A handle on job ``job_id``: ``status()``, ``wait()``, ``result``, ``events()``."""
    return client(using).job(job_id)


def submit(
    stage: str, payload: Mapping[str, Any] | None = None, *, using: str | None = None, **options: Any
) -> JobHandle:
    """Submit a job of ``stage`` (by name) in Django's transaction on ``using``: inside
    ``transaction.atomic()`` it commits or rolls back with your rows (a rolled-back inner
    ``atomic()`` drops it); outside one it commits at once. Published after the commit.
    ``options`` are :meth:`conveyor.Client.submit`'s (``idempotency_key``, ``delay``, ...)."""
    from django.db import connections, transaction

    the_client, lender = _pair(using)
    if not connections[lender.alias].in_atomic_block:
        with transaction.atomic(using=lender.alias), lender.connection() as conn:
            return the_client.submit(stage, payload, session=_Atomic(conn, lender.alias), **options)
    # No savepoint of our own: a payload refused before any SQL leaves the caller's
    # transaction as it was; a failed statement marks it for rollback, as Django's do.
    with lender.connection() as conn:
        try:
            return the_client.submit(stage, payload, session=_Atomic(conn, lender.alias), **options)
        except (DBAPIError, SubmitFailed):
            transaction.set_rollback(True, using=lender.alias)
            raise


__all__ = ["client", "close", "job", "submit"]
