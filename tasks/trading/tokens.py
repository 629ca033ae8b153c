"""Broker tokens at rest: Fernet-encrypted in ``trading_connections``, decrypted only in
the import's body, never logged (the seed's "never log accessEnc/refreshEnc")."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy import Connection, select

from conveyor.errors import ConfigurationError
from conveyor.store.db.dialect import db_now, upsert
from tasks.trading import tables as t
from tasks.trading.errors import BrokerUnauthorized, NotYourUser
from tasks.trading.settings import SETTING, TradingSettings


def fernet(settings: TradingSettings, home: Path) -> Fernet:
    """The Fernet of ``token_key``; unset, of the key kept in ``home/trading/token.key``
    (made on first use, mode 0600)."""
    if settings.token_key is not None:
        try:
            return Fernet(settings.token_key.get_secret_value().encode())
        except ValueError:
            raise ConfigurationError(
                f"{SETTING}.token_key is not a Fernet key (32 url-safe base64-encoded bytes)"
            ) from None
    path = home / "trading" / "token.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first: read theirs
        else:
            with os.fdopen(fd, "wb") as out:
                out.write(Fernet.generate_key())
    return Fernet(path.read_bytes().strip())


def claim_user(conn: Connection, user_id: str, owner: str | None) -> str | None:
    """Record ``owner`` as the user's on first sight (insert or ignore, atomic under
    concurrent claims: the primary key decides); return the owner on record."""
    conn.execute(
        upsert(conn, t.users)
        .values(user_id=user_id, owner=owner, created_at=db_now())
        .on_conflict_do_nothing(index_elements=["user_id"])
    )
    found = conn.execute(select(t.users.c.owner).where(t.users.c.user_id == user_id)).scalar_one()
    return None if found is None else str(found)


def owner_of(conn: Connection, user_id: str) -> tuple[bool, str | None]:
    """Whether the user is known (connected once), and their owner."""
    row = conn.execute(select(t.users.c.owner).where(t.users.c.user_id == user_id)).first()
    return (row is not None, None if row is None or row[0] is None else str(row[0]))


def check_job_owner(conn: Connection, user_id: str, job_owner: str | None) -> None:
    """Refuse (:class:`NotYourUser`) a job of an API owner for a user another owner (or the
    deployment) connected; the deployment's own jobs (no owner) act for any user."""
    if job_owner is None:
        return
    known, holder = owner_of(conn, user_id)
    if known and holder != job_owner:
        raise NotYourUser(f"no trading user {user_id} for this job's owner: nothing was done")


def store_token(conn: Connection, box: Fernet, user_id: str, broker: str, token: str) -> None:
    """Keep (or replace) the user's token for ``broker``, encrypted."""
    sealed = box.encrypt(token.encode()).decode()
    stmt = upsert(conn, t.connections).values(
        user_id=user_id, broker=broker, token_enc=sealed, created_at=db_now(), updated_at=db_now()
    )
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["user_id", "broker"], set_={"token_enc": sealed, "updated_at": db_now()}
        )
    )


def connected_broker(conn: Connection, user_id: str, broker: str | None) -> str:
    """``broker``, or the user's most recently connected one; :class:`BrokerUnauthorized`
    when the user has no connection (to that broker)."""
    query = select(t.connections.c.broker).where(t.connections.c.user_id == user_id)
    if broker is not None:
        query = query.where(t.connections.c.broker == broker)
    found = conn.execute(query.order_by(t.connections.c.updated_at.desc()).limit(1)).scalar_one_or_none()
    if found is None:
        which = f" to {broker}" if broker else ""
        raise BrokerUnauthorized(
            f"user {user_id} has no broker connection{which}: connect one first "
            "(conveyor trading connect --user ... --broker ... --token-stdin)"
        )
    return str(found)


def read_token(conn: Connection, box: Fernet, user_id: str, broker: str) -> str:
    """The user's decrypted token for ``broker``."""
    sealed = conn.execute(
        select(t.connections.c.token_enc).where(
            t.connections.c.user_id == user_id, t.connections.c.broker == broker
        )
    ).scalar_one_or_none()
    if sealed is None:
        raise BrokerUnauthorized(f"user {user_id} has no {broker} connection")
    try:
        return box.decrypt(str(sealed).encode()).decode()
    except InvalidToken:
        raise BrokerUnauthorized(
            f"the stored {broker} token of user {user_id} cannot be decrypted with this token_key: "
            "connect again"
        ) from None


__all__ = [
    "check_job_owner",
    "claim_user",
    "connected_broker",
    "fernet",
    "owner_of",
    "read_token",
    "store_token",
]
