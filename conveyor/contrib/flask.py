"""Conveyor in a Flask app: an extension configured from ``app.config``.

::

    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy
    from conveyor.contrib.flask import Conveyor

    db = SQLAlchemy()
    jobs = Conveyor()

    def create_app() -> Flask:
        app = Flask(__name__)
        app.config.from_object("config")  # CONVEYOR_DATABASE_URL, CONVEYOR_REDIS_URL, ...
        db.init_app(app)
        jobs.init_app(app)
        return app

    @app.post("/orders")
    def create_order():
        order = Order(item="lamp")
        db.session.add(order)
        db.session.flush()
        jobs.submit("shop.invoice", {"order_id": order.id}, session=db.session)
        db.session.commit()  # the order and its job commit together; published only now

Settings are the ``CONVEYOR_*`` variables of :class:`conveyor.settings.ConveyorSettings`
under the same names in ``app.config``; a key set there wins over the environment, one
set to ``None`` leaves the environment's. Each app gets its own
:class:`conveyor.Client` (``app.extensions["conveyor"].client``), made on first use and
closed when the process exits. ``db.session`` (a ``scoped_session``) is resolved to the
request's session before the job joins its transaction.

The HTTP API (:mod:`conveyor.web`) can be served by the app itself, under a prefix, on
the same client: ``mount_api(app, "/conveyor")`` (the ``flask`` extra brings FastAPI and
``a2wsgi``, which runs it inside the WSGI app).
"""

from __future__ import annotations

import atexit
import datetime as dt
import difflib
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from flask import Flask, current_app, has_app_context
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session, scoped_session

from conveyor.client.by_name import Client, DeadLetters
from conveyor.client.handle import JobHandle
from conveyor.dedup import Reuse
from conveyor.errors import ConfigurationError
from conveyor.settings import ConveyorSettings

if TYPE_CHECKING:
    from conveyor.web.wsgi import Mounted

EXTENSION = "conveyor"
PREFIX = "CONVEYOR_"


def settings_from_config(config: Mapping[str, Any]) -> ConveyorSettings:
    """The settings a Flask app's ``config`` names: each ``CONVEYOR_<NAME>`` key is the
    field ``<name>``; the environment fills in the rest. An unknown ``CONVEYOR_`` key is
    refused (with the close names), as a typo would otherwise fall back to the default."""
    fields = ConveyorSettings.model_fields
    given: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX) :].lower()
        if name not in fields:
            known = [PREFIX + f.upper() for f in fields]
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigurationError(f"app.config[{key!r}] is not a Conveyor setting{hint}")
        if value is not None:
            given[name] = value
    try:
        return ConveyorSettings(**given)
    except ValidationError as exc:
        # Never the input: a URL in it may carry a password.
        problems = "; ".join(
            f"{_key(e['loc'])}: {e['msg']}" for e in exc.errors(include_input=False, include_url=False)
        )
        raise ConfigurationError(f"invalid Conveyor settings: {problems}") from None


def _key(loc: tuple[int | str, ...]) -> str:
    if not loc:
        return "settings"
    return ".".join([PREFIX + str(loc[0]).upper(), *(str(p) for p in loc[1:])])


class ConveyorState:
    """What :meth:`Conveyor.init_app` keeps in ``app.extensions["conveyor"]``: the app's
    settings and its client, made on first use."""

    def __init__(self, settings: ConveyorSettings) -> None:
        self.settings = settings
        self._client: Client | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Client:
        """This app's :class:`conveyor.Client` (one per app, shared by its threads)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = Client(self.settings)
        return self._client

    def close(self) -> None:
        """Close the client's connections, if it was ever made."""
        if self._client is not None:
            self._client.close()


_states: weakref.WeakSet[ConveyorState] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for state in list(_states):
        state.close()


class Conveyor:
    """The Flask extension: ``Conveyor(app)``, or ``Conveyor()`` then ``init_app(app)`` for
    each app of an app factory. Its methods act for ``current_app`` (or, outside an app
    context, for the app it was created with)."""

    def __init__(self, app: Flask | None = None) -> None:
        self.app = app
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Read ``app``'s ``CONVEYOR_*`` settings and give it a client of its own.

        Raises :class:`conveyor.ConfigurationError` for an unknown or invalid setting.
        """
        if EXTENSION in app.extensions:
            raise RuntimeError(
                f"Conveyor is already set up on app {app.name!r}: use the instance that did it"
            )
        state = ConveyorState(settings_from_config(app.config))
        _states.add(state)
        app.extensions[EXTENSION] = state

    def state(self, app: Flask | None = None) -> ConveyorState:
        """The state of ``app`` (default: ``current_app``, else the app given at creation)."""
        if app is None:
            app = current_app if has_app_context() else self.app
        if app is None:
            raise RuntimeError(
                "no Flask app: use Conveyor inside an app context (a request, a CLI command, "
                "`with app.app_context():`) or create it as Conveyor(app)"
            )
        state = app.extensions.get(EXTENSION)
        if not isinstance(state, ConveyorState):
            raise RuntimeError(f"Conveyor is not set up on app {app.name!r}: call init_app(app) first")
        return state

    @property
    def client(self) -> Client:
        """The current app's :class:`conveyor.Client`."""
        return self.state().client

    @property
    def settings(self) -> ConveyorSettings:
        """The current app's Conveyor settings."""
        return self.state().settings

    @property
    def dlq(self) -> DeadLetters:
        """The dead-letter queue, read-only (``list``, ``show``)."""
        return self.client.dlq

    def submit(
        self,
        stage: str,
        payload: BaseModel | Mapping[str, Any] | None = None,
        *,
        session: Session | scoped_session[Any] | None = None,
        idempotency_key: str | None = None,
        delay: float = 0.0,
        run_at: dt.datetime | None = None,
        expires_in: float | None = None,
        priority: int | None = None,
        label: str | None = None,
        max_attempts: int | None = None,
        dedup: Literal[False] | None = None,
        reuse: Reuse = "never",
        owner: str | None = None,
    ) -> JobHandle:
        """Submit a job of stage ``stage`` (see :meth:`conveyor.Client.submit`). With
        ``session=db.session`` it joins the request's transaction and is published only
        when that commits."""
        return self.client.submit(
            stage,
            payload,
            session=session,
            idempotency_key=idempotency_key,
            delay=delay,
            run_at=run_at,
            expires_in=expires_in,
            priority=priority,
            label=label,
            max_attempts=max_attempts,
            dedup=dedup,
            reuse=reuse,
            owner=owner,
        )

    def job(self, job_id: str) -> JobHandle:
        """A handle on an existing job (``status()``, ``wait``, ``result``, ``events``)."""
        return self.client.job(job_id)

    def cancel(self, job_id: str, *, by: str = "api", reason: str | None = None) -> str:
        """Cancel a job in any state; returns the status it ends up in."""
        return self.client.cancel(job_id, by=by, reason=reason)


def mount_api(app: Flask, prefix: str = "/conveyor") -> Mounted:
    """Serve Conveyor's HTTP API (:mod:`conveyor.web`) under ``prefix`` of ``app``, on the
    extension's client for ``app``: ``app.wsgi_app`` becomes a dispatcher that sends the
    requests under the prefix to the API (WSGI, through ``a2wsgi``) and every other one to
    the app as before (its routes, hooks and error handlers see none of the API's).
    The API is built at its first request; call this before or after ``init_app``.
    Returns the dispatcher (``.api.application`` is the API's FastAPI app)."""
    from conveyor.web.wsgi import mount

    def client() -> Client:
        state = app.extensions.get(EXTENSION)
        if not isinstance(state, ConveyorState):
            raise RuntimeError(f"Conveyor is not set up on app {app.name!r}: call init_app(app) first")
        return state.client

    mounted = mount(app.wsgi_app, prefix, client)
    app.wsgi_app = mounted  # type: ignore[method-assign]
    return mounted


__all__ = ["Conveyor", "ConveyorState", "mount_api", "settings_from_config"]
