"""Who a job belongs to: owner names, and the idempotency keys an owner's submits use.

An owner is a plain name (an HTTP token's owner, or ``owner=`` given to ``submit``). A
job's ``idempotency_key`` is global; with an owner it is scoped to that owner, stored as
``owner:key``, so two owners using the same key never meet (one cannot take or read the
other's job by guessing its key). An owner name holds no ``:``, so ``owner:key`` is never
another owner's key.
"""

from __future__ import annotations

import re

from conveyor.errors import OwnerInvalid

OWNER_LENGTH = 64
_OWNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")


def checked_owner(owner: str) -> str:
    """``owner`` if it is a valid owner name, else :class:`OwnerInvalid` (never echoing it)."""
    if not isinstance(owner, str) or not _OWNER.fullmatch(owner):
        raise OwnerInvalid(
            f"an owner is 1-{OWNER_LENGTH} letters, digits and '._@+-', starting with a letter or digit"
        )
    return owner


def owned_key(owner: str | None, key: str | None) -> str | None:
    """The idempotency key as stored: ``owner:key`` for an owner's submit, else ``key``.
    A given ``owner`` is checked (:class:`OwnerInvalid`), with a key or without."""
    if owner is None:
        return key
    checked_owner(owner)
    return None if key is None else f"{owner}:{key}"


def callers_key(owner: str | None, stored: str | None) -> str | None:
    """The key the owner gave, from the stored one (the inverse of :func:`owned_key`)."""
    if owner is None or stored is None:
        return stored
    prefix = f"{owner}:"
    return stored[len(prefix) :] if stored.startswith(prefix) else stored


__all__ = ["OWNER_LENGTH", "callers_key", "checked_owner", "owned_key"]
