"""Conveyor's HTTP API (the ``web`` extra: FastAPI, uvicorn): jobs by stage name behind
bearer tokens, errors as RFC 9457 problem details. ``conveyor serve`` runs it; an ASGI app
can mount :func:`create_app`'s application, a WSGI app (Flask, Django) mounts it with
:mod:`conveyor.web.wsgi`. Client side only: it builds on
:class:`conveyor.Client` and never imports the worker."""

from __future__ import annotations

from conveyor.web.app import create_app

__all__ = ["create_app"]
