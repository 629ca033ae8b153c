"""The trading family, caller's side: connect a broker, submit imports and scores, and
read a user's standing. What apps, the CLI and the HTTP router call.

Submits go through the platform (``session=`` joins the caller's transaction): the
payload is checked against the stage's model (:class:`conveyor.errors.PayloadInvalid`
naming the field, nothing recorded), and the seed's deterministic ids are the stages'
dedup keys, so a repeat while the job is pending returns it (``deduplicated``).
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from conveyor.client.enlist import Enlistment
from conveyor.errors import ConveyorError, PayloadInvalid
from conveyor.platform import Platform
from conveyor.store.db.namespace import use_schema
from conveyor.store.db.schema import job_events
from tasks.trading import tables as t
from tasks.trading.imports import day_of
from tasks.trading.models import (
    DIGEST_STAGE,
    FANOUT_STAGE,
    IMPORT_STAGE,
    SCORE_STAGE,
    SIM_STAGE,
    USER_ID_PATTERN,
)
from tasks.trading.settings import BROKERS, trading_settings_of
from tasks.trading.tokens import claim_user, fernet, owner_of, store_token

_USER = re.compile(USER_ID_PATTERN)


class UserOfAnotherOwner(ConveyorError, LookupError):
    """The user was connected by another API owner: not this caller's (HTTP 404, as if
    unknown: a caller learns nothing of another owner's users)."""


def user_owner(platform: Platform, user_id: str) -> tuple[bool, str | None]:
    """Whether the user was ever connected, and the owner who first connected them."""
    with platform.engine.connect() as raw:
        return owner_of(use_schema(raw, platform.settings.db_schema), user_id)


def ensure_owner(platform: Platform, user_id: str, owner: str | None) -> None:
    """Refuse (:class:`UserOfAnotherOwner`) a caller of ``owner`` for a user another owner
    connected. ``owner`` None: the deployment itself (the CLI, an admin), which may act for
    any user; a user nobody connected is anyone's to connect. The stages check the same
    (a job of another owner's user does nothing), whatever path submitted it."""
    if owner is None:
        return
    known, holder = user_owner(platform, check_user(user_id))
    if known and holder != owner:
        raise UserOfAnotherOwner(f"no trading user {user_id}")


def check_user(user_id: str) -> str:
    """``user_id`` if it is a plain user id, else :class:`PayloadInvalid` naming the rule."""
    if not isinstance(user_id, str) or not _USER.match(user_id):
        raise PayloadInvalid(
            "userId: must be 1-64 letters, digits, '.', '_' or '-', and not '.' or '..' "
            "(a user's id, never an e-mail address)"
        )
    return user_id


def connect_broker(
    platform: Platform, user_id: str, broker: str, token: str, *, owner: str | None = None
) -> None:
    """Keep the user's broker token, encrypted (``CONVEYOR_TRADING.token_key``); a caller's
    ``owner`` connects only its own users (see :func:`ensure_owner`): the first connection
    claims the user, atomically, and a concurrent one of another owner is refused."""
    check_user(user_id)
    if broker not in BROKERS:
        raise PayloadInvalid(f"broker: must be one of {', '.join(BROKERS)}")
    token = token.strip()
    if not token or len(token) > 4096 or any(c.isspace() for c in token):
        raise PayloadInvalid("token: must be one line of 1-4096 characters without spaces")
    box = fernet(trading_settings_of(platform.settings), platform.settings.resolved_home())
    with platform.engine.begin() as raw:
        conn = use_schema(raw, platform.settings.db_schema)
        holder = claim_user(conn, user_id, owner)
        if owner is not None and holder != owner:
            raise UserOfAnotherOwner(f"no trading user {user_id}")  # rolls the claim back too
        store_token(conn, box, user_id, broker, token)


def submit_import(
    platform: Platform,
    user_id: str,
    *,
    since: dt.date | str | None = None,
    broker: str | None = None,
    session: Session | Enlistment | None = None,
    owner: str | None = None,
) -> Any:
    """Submit ``conveyor.trading.import_trades``; returns the job's handle."""
    payload: dict[str, Any] = {"userId": user_id}
    if since is not None:
        payload["sinceIso"] = since.isoformat() if isinstance(since, dt.date) else _day_given(since)
    if broker is not None:
        payload["broker"] = broker
    return platform.submit(IMPORT_STAGE, payload, session=session, owner=owner)


def submit_score(
    platform: Platform,
    user_id: str,
    *,
    since: dt.date | str | None = None,
    session: Session | Enlistment | None = None,
    owner: str | None = None,
) -> Any:
    """Submit ``conveyor.trading.score_bias``; returns the job's handle."""
    payload: dict[str, Any] = {"userId": user_id}
    if since is not None:
        payload["sinceIso"] = since.isoformat() if isinstance(since, dt.date) else _day_given(since)
    return platform.submit(SCORE_STAGE, payload, session=session, owner=owner)


def _day_given(value: str) -> str:
    """``value`` unchanged once it is known to be a real day (the model checks its form)."""
    if isinstance(value, str) and len(value) == 10:
        day_of(value)  # 2025-02-30 is refused here, not dead-lettered when the job runs
    return value


def _day(value: dt.date | str) -> str:
    return value.isoformat() if isinstance(value, dt.date) else value


def submit_sim(
    platform: Platform,
    user_id: str,
    trade_id: str,
    horizon_days: int,
    *,
    session: Session | Enlistment | None = None,
    owner: str | None = None,
) -> Any:
    """Submit ``conveyor.trading.simulate_simple`` (the seed's SimJob); the job's handle."""
    payload = {"userId": user_id, "tradeId": trade_id, "horizonDays": horizon_days}
    return platform.submit(SIM_STAGE, payload, session=session, owner=owner)


def submit_digest(
    platform: Platform,
    user_id: str,
    start: dt.date | str,
    end: dt.date | str,
    *,
    recompute: bool = False,
    session: Session | Enlistment | None = None,
    owner: str | None = None,
) -> Any:
    """Submit ``conveyor.trading.digest_weekly`` for ``[start, end)``: the same period is one
    job for the retention period unless ``recompute``."""
    payload = {"userId": user_id, "periodStart": _day(start), "periodEnd": _day(end)}
    options: dict[str, Any] = {"reuse": "always"} if recompute else {}
    return platform.submit(DIGEST_STAGE, payload, session=session, owner=owner, **options)


def submit_fanout(platform: Platform, week: dt.date | str | None = None) -> Any:
    """Submit the weekly fan-out (the beat's ``trading-weekly-digests``) for the ISO week
    holding ``week`` (None: last week)."""
    return platform.submit(FANOUT_STAGE, {"week": None if week is None else _day(week)})


def user_status(platform: Platform, user_id: str) -> dict[str, Any]:
    """``{"trades", "rejected", "tags", "reflect_events", "brokers"}`` for the user:
    ``rejected`` is the rows the latest import of each broker refused (an import again
    sees the same bad rows again; they are not added up)."""
    check_user(user_id)

    def count(query: Any) -> int:
        return int(conn.execute(query).scalar_one())

    with platform.engine.connect() as raw:
        conn = use_schema(raw, platform.settings.db_schema)
        scores = select(t.scores.c.job_id).where(t.scores.c.user_id == user_id)
        brokers = conn.execute(
            select(t.connections.c.broker)
            .where(t.connections.c.user_id == user_id)
            .order_by(t.connections.c.broker)
        ).scalars()
        return {
            "userId": user_id,
            "brokers": list(brokers),
            "trades": count(select(func.count()).select_from(t.trades).where(t.trades.c.user_id == user_id)),
            "rejected": _latest_rejected(conn, user_id),
            "tags": count(select(func.count()).select_from(t.tags).where(t.tags.c.user_id == user_id)),
            "reflect_events": count(
                select(func.count())
                .select_from(job_events)
                .where(job_events.c.topic == "coach.reflect", job_events.c.job_id.in_(scores))
            ),
        }


def _latest_rejected(conn: Any, user_id: str) -> int:
    rows = conn.execute(
        select(t.imports.c.broker, t.imports.c.rejected)
        .where(t.imports.c.user_id == user_id)
        .order_by(t.imports.c.updated_at.desc())
    )
    latest: dict[str, int] = {}
    for broker, rejected in rows:
        latest.setdefault(str(broker), int(rejected))
    return sum(latest.values())


def list_trades(platform: Platform, user_id: str, *, limit: int = 50) -> list[dict[str, Any]]:
    """The user's newest stored trades (``tradeId`` first), with their bias labels."""
    check_user(user_id)
    with platform.engine.connect() as raw:
        conn = use_schema(raw, platform.settings.db_schema)
        rows = (
            conn.execute(
                select(t.trades)
                .where(t.trades.c.user_id == user_id)
                .order_by(t.trades.c.ts.desc(), t.trades.c.id)
                .limit(max(1, min(limit, 1000)))
            )
            .mappings()
            .all()
        )
        labels: dict[str, list[str]] = {}
        if rows:
            tagged = conn.execute(
                select(t.tags.c.trade_id, t.tags.c.label)
                .where(t.tags.c.trade_id.in_([r["id"] for r in rows]))
                .order_by(t.tags.c.confidence.desc())
            )
            for trade_id, label in tagged:
                labels.setdefault(str(trade_id), []).append(str(label))
    return [
        {
            "tradeId": r["id"],
            "broker": r["broker"],
            "symbol": r["symbol"],
            "side": r["side"],
            "qty": str(r["qty"].normalize()) if hasattr(r["qty"], "normalize") else str(r["qty"]),
            "price": str(r["price"].normalize()) if hasattr(r["price"], "normalize") else str(r["price"]),
            "ts": r["ts"].isoformat().replace("+00:00", "Z"),
            "labels": labels.get(r["id"], []),
        }
        for r in rows
    ]


__all__ = [
    "UserOfAnotherOwner",
    "check_user",
    "connect_broker",
    "ensure_owner",
    "list_trades",
    "submit_digest",
    "submit_fanout",
    "submit_import",
    "submit_score",
    "submit_sim",
    "user_owner",
    "user_status",
]
