"""Bearer tokens of the HTTP API: created and revoked with ``conveyor tokens``, checked on
every request by :mod:`conveyor.web`.

A token is ``cvy_<id>_<secret>``: the id finds its row, the secret (32 random bytes from
:func:`secrets.token_urlsafe`) is shown once at creation and never stored: the row keeps
its SHA-256, compared in constant time. A fast hash is enough for a secret of 256 random
bits (nobody can guess one to match a leaked hash), where a password would need a slow one.

Scopes: ``read`` (show jobs), ``submit`` (submit and cancel), ``admin`` (everything, on
every owner's jobs). A token acts for its owner: it sees only that owner's jobs unless it
is ``admin``.

Client side: imports nothing of the worker.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Engine, insert, select, update

from conveyor.client.owners import checked_owner
from conveyor.errors import DatabaseBusy, ScopeInvalid
from conveyor.store.db.dialect import db_now
from conveyor.store.db.engine import brief_write, reading
from conveyor.store.db.schema import Row, tokens

READ = "read"
SUBMIT = "submit"
ADMIN = "admin"
SCOPES = (READ, SUBMIT, ADMIN)
PREFIX = "cvy_"
ID_BYTES = 8  # 16 hex characters
SECRET_BYTES = 32
_TOKEN = re.compile(rf"{PREFIX}([0-9a-f]{{{2 * ID_BYTES}}})_([A-Za-z0-9_-]{{20,100}})")
# last_used_at is written at most this often per token: not one write per request.
TOUCH_EVERY = dt.timedelta(seconds=60)
TOUCH_WAIT = 0.05  # SQLite: a busy writer means the touch is skipped, never waited for


@dataclass(frozen=True)
class Token:
    """A token's row, without its secret (only ever shown at creation)."""

    id: str
    owner: str
    name: str | None
    scopes: frozenset[str]
    created_at: dt.datetime
    revoked_at: dt.datetime | None = None
    last_used_at: dt.datetime | None = None

    @property
    def admin(self) -> bool:
        """An ``admin`` token: every scope, every owner's jobs."""
        return ADMIN in self.scopes

    def allows(self, scope: str) -> bool:
        """Whether this token may do what ``scope`` covers (``admin`` covers all)."""
        return self.admin or scope in self.scopes

    @classmethod
    def from_row(cls, row: Row) -> Token:
        """The token of a ``tokens`` row."""
        return cls(
            id=row["id"],
            owner=row["owner"],
            name=row["name"],
            scopes=frozenset(str(row["scopes"]).split()),
            created_at=row["created_at"],
            revoked_at=row["revoked_at"],
            last_used_at=row["last_used_at"],
        )


@dataclass(frozen=True)
class Created:
    """A new token and its bearer string (``secret``), which nothing can show again."""

    token: Token
    secret: str


def checked_scopes(scopes: Iterable[str]) -> frozenset[str]:
    """The scopes, checked: at least one, each one of :data:`SCOPES`."""
    given = frozenset(s.strip().lower() for s in scopes)
    unknown = sorted(given - set(SCOPES))
    if unknown or not given:
        what = f"unknown scope {', '.join(map(repr, unknown))}" if unknown else "no scope"
        raise ScopeInvalid(f"{what}: a token's scopes are {', '.join(SCOPES)}")
    return given


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create(engine: Engine, *, owner: str, scopes: Iterable[str], name: str | None = None) -> Created:
    """Create a token for ``owner`` with ``scopes``; the returned ``secret`` is the only copy."""
    owner = checked_owner(owner)
    granted = checked_scopes(scopes)
    token_id = secrets.token_hex(ID_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    with engine.begin() as conn:
        conn.execute(
            insert(tokens).values(
                id=token_id,
                owner=owner,
                name=name[:200] if name else None,
                scopes=" ".join(s for s in SCOPES if s in granted),
                secret_hash=_digest(secret),
                created_at=db_now(),
            )
        )
        row = conn.execute(select(tokens).where(tokens.c.id == token_id)).mappings().one()
    return Created(Token.from_row(row), f"{PREFIX}{token_id}_{secret}")


def listed(engine: Engine, *, owner: str | None = None, include_revoked: bool = False) -> list[Token]:
    """Tokens, oldest first (never their secrets)."""
    q = select(tokens).order_by(tokens.c.created_at, tokens.c.id)
    if owner is not None:
        q = q.where(tokens.c.owner == owner)
    if not include_revoked:
        q = q.where(tokens.c.revoked_at.is_(None))
    with reading(engine) as conn:
        return [Token.from_row(r) for r in conn.execute(q).mappings()]


def revoke(engine: Engine, token_id: str) -> Token:
    """Revoke token ``token_id`` (idempotent: a revoked token keeps its first revocation
    time); ``LookupError`` if there is no such token."""
    with engine.begin() as conn:
        conn.execute(
            update(tokens)
            .where(tokens.c.id == token_id, tokens.c.revoked_at.is_(None))
            .values(revoked_at=db_now())
        )
        row = conn.execute(select(tokens).where(tokens.c.id == token_id)).mappings().one_or_none()
    if row is None:
        raise LookupError(f"no token {token_id}")
    return Token.from_row(row)


def verify(engine: Engine, bearer: str) -> Token | None:
    """The live token whose bearer string is ``bearer``; None for a malformed, unknown,
    revoked or wrong one (the caller cannot tell which, and neither do logs)."""
    found = _TOKEN.fullmatch(bearer)
    if found is None:
        return None
    token_id, secret = found.groups()
    with reading(engine) as conn:
        row = conn.execute(select(tokens).where(tokens.c.id == token_id)).mappings().one_or_none()
    if row is None or row["revoked_at"] is not None:
        return None
    if not hmac.compare_digest(_digest(secret), str(row["secret_hash"])):
        return None
    token = Token.from_row(row)
    _touch(engine, token)
    return token


def _touch(engine: Engine, token: Token) -> None:
    """Note that ``token`` was used, at most every :data:`TOUCH_EVERY`; best effort."""
    now = dt.datetime.now(dt.UTC)
    if token.last_used_at is not None and now - token.last_used_at < TOUCH_EVERY:
        return
    try:
        with brief_write(engine, TOUCH_WAIT) as conn:
            conn.execute(update(tokens).where(tokens.c.id == token.id).values(last_used_at=db_now()))
    except DatabaseBusy:
        pass  # SQLite's writer is held: the next request notes it


__all__ = [
    "ADMIN",
    "READ",
    "SCOPES",
    "SUBMIT",
    "Created",
    "Token",
    "checked_scopes",
    "create",
    "listed",
    "revoke",
    "verify",
]
