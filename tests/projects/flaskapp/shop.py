"""A small Flask shop that calls Conveyor: an order and its job commit in one transaction.

Run from this directory: ``flask --app shop run`` (``SHOP_DATABASE_URL``, ``SHOP_REDIS_URL``).
Conveyor's HTTP API is mounted under ``/conveyor``.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Flask, abort, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import config
from conveyor.contrib.flask import Conveyor, mount_api


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
jobs = Conveyor()
bp = Blueprint("shop", __name__)


class Order(db.Model):
    """The shop's own table, in its own schema (public)."""

    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    n: Mapped[int]
    job_id: Mapped[str | None]


class Rollback(Exception):
    pass


@bp.get("/health")
def health() -> dict[str, Any]:
    return {"config": config.SHOP_CONFIG}


@bp.post("/orders")
def create_order() -> tuple[dict[str, Any], int]:
    """An order and the job that squares its number, in one transaction. ``fail`` rolls
    both back; ``delay`` postpones the job."""
    body = request.get_json()
    order = Order(n=int(body["n"]))
    db.session.add(order)
    db.session.flush()
    job = jobs.submit(
        "conveyor.demo.square",
        {"n": order.n},
        session=db.session,
        delay=float(body.get("delay", 0)),
        label=f"order {order.id}",
    )
    order.job_id = job.id
    if body.get("fail"):
        db.session.rollback()
        return {"order_id": order.id, "job_id": job.id}, 409
    db.session.commit()
    return {"order_id": order.id, "job_id": job.id}, 201


@bp.get("/orders/<int:order_id>")
def order_status(order_id: int) -> dict[str, Any]:
    order = db.get_or_404(Order, order_id)
    if order.job_id is None:
        abort(404)
    job = jobs.job(order.job_id)
    status = job.status()
    return {"order_id": order.id, "status": status, "result": job.result if status == "succeeded" else None}


@bp.post("/notes")
def notes() -> tuple[dict[str, Any], int]:
    """One note kept, and one submitted in a savepoint that rolls back: its job is dropped,
    the rest of the transaction commits."""
    body = request.get_json()
    kept = jobs.submit("conveyor.demo.effect", {"note": body["keep"]}, session=db.session)
    dropped = None
    try:
        with db.session.begin_nested():
            dropped = jobs.submit("conveyor.demo.effect", {"note": body["drop"]}, session=db.session)
            raise Rollback
    except Rollback:
        pass
    db.session.commit()
    assert dropped is not None
    return {"kept": kept.id, "dropped": dropped.id}, 201


def create_app() -> Flask:
    """The app factory ``flask --app shop`` finds."""
    app = Flask(__name__)
    app.config.from_object("config")
    db.init_app(app)
    jobs.init_app(app)
    mount_api(app, "/conveyor")  # the HTTP API on the extension's client, at /conveyor/jobs, ...
    app.register_blueprint(bp)
    with app.app_context():
        db.create_all()
    return app
