"""A publishing plan, checked and normalised: the rendered caption, the media, the UTC
time, and the seed's idempotency key. Pure functions, shared by the caller's side and the
stage.

``key = sha256(brand + channel + scheduled_at UTC + media_hash + caption_hash)``: the same
plan scheduled again (from any time zone) gets the same key, so it is one post.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import string
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.errors import PayloadInvalid
from tasks.publisher.settings import CHANNELS

MAX_CAPTION = 2200  # Instagram's limit; Facebook allows more, but one bound serves both
MAX_MEDIA = 10
MAX_COMMENT = 2200
EDGE = dt.timedelta(days=1)  # room for a day's arithmetic either side (windows, checks)
_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,100}")


class PlanInvalid(PayloadInvalid):
    """A plan the family refuses; ``field`` names what to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Normalized:
    """A plan as the family stores and posts it."""

    brand: str
    channel: str
    account: str
    caption: str  # rendered: the template's placeholders filled
    media: tuple[str, ...]
    scheduled_at: dt.datetime  # aware, UTC
    first_comment: str | None
    idempotency_key: str
    derived_key: bool  # False: the caller's key

    def preview(self) -> dict[str, Any]:
        """The normalised result a UI shows before anything is recorded or posted."""
        return {
            "preview": True,
            "brand": self.brand,
            "channel": self.channel,
            "account": self.account,
            "caption": self.caption,
            "media": list(self.media),
            "scheduled_at": iso(self.scheduled_at),
            "first_comment": self.first_comment,
            "idempotency_key": self.idempotency_key,
        }


def iso(when: dt.datetime) -> str:
    """``when`` in UTC, ISO 8601 with ``Z``."""
    return when.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def parse_time(value: Any, *, field: str = "scheduled_at") -> dt.datetime:
    """An aware datetime (or ISO 8601 text with an offset) in UTC; a naive one is refused
    (whose time zone would it be?)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        except ValueError:
            raise PlanInvalid(field, f"{value!r} is not an ISO 8601 time") from None
    if not isinstance(value, dt.datetime):
        raise PlanInvalid(
            field, "a time is required (ISO 8601 with an offset, e.g. 2026-03-01T09:00:00+01:00)"
        )
    if value.tzinfo is None or value.utcoffset() is None:
        raise PlanInvalid(field, "the time has no offset: give one (e.g. +01:00 or Z)")
    try:
        utc = value.astimezone(dt.UTC)
        _ = utc - EDGE, utc + EDGE
    except OverflowError:
        raise PlanInvalid(field, "out of range (years 1 to 9999)") from None
    return utc


def render(template: str, placeholders: Mapping[str, Any] | None) -> str:
    """The caption: ``{name}`` placeholders filled (``{{`` and ``}}`` are braces). A
    placeholder the plan does not give is refused, naming it."""
    values = {str(k): v for k, v in (placeholders or {}).items()}
    out: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise PlanInvalid("caption", f"unbalanced braces ({exc})") from None
    for literal, name, spec, conversion in parsed:
        out.append(literal)
        if name is None:
            continue
        if name not in values:
            raise PlanInvalid("placeholders", f"the caption uses {{{name}}} but no value is given for it")
        if spec or conversion:
            raise PlanInvalid("caption", f"placeholder {{{name}}}: formats and conversions are not allowed")
        out.append(str(values[name]))
    return "".join(out)


def normalize_comment(text: str) -> str:
    """A comment as compared: NFC, whitespace runs collapsed, trimmed."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def comment_hash(media_id: str, text: str) -> str:
    """The seed's ``sha256(media_id + normalised comment)``."""
    return _sha256(media_id + normalize_comment(text))


def media_hash(media: Sequence[str]) -> str:
    """A digest of the media references, in order."""
    return _sha256("\n".join(media))


def idempotency_key(
    brand: str, channel: str, account: str, scheduled_at: dt.datetime, media: Sequence[str], caption: str
) -> str:
    """The seed's key, with the account: ``sha256(brand, channel, account, scheduled_at UTC,
    media_hash, caption_hash)`` joined by line breaks (the same copy on two pages at once is two posts)."""
    parts = (brand, channel, account, iso(scheduled_at), media_hash(media), _sha256(caption))
    return _sha256("\n".join(parts))  # names never hold a line break: no two plans join alike


def normalize(
    *,
    brand: str,
    channel: str,
    account: str,
    caption: str,
    scheduled_at: Any,
    media: Sequence[str] = (),
    placeholders: Mapping[str, Any] | None = None,
    first_comment: str | None = None,
    idempotency_key_given: str | None = None,
    has_plan: bool = True,
) -> Normalized:
    """Check a plan and normalise it; :class:`PlanInvalid` names the first field to fix.
    ``has_plan=False`` (a maintenance job): the caller's key, else a fresh UUID."""
    for field, value in (("brand", brand), ("account", account)):
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise PlanInvalid(field, "1-100 letters, digits or _.:@- are required")
    if channel not in CHANNELS:
        raise PlanInvalid("channel", f"unknown channel {channel!r} (one of: {', '.join(CHANNELS)})")
    if not isinstance(caption, str):
        raise PlanInvalid("caption", "text is required")
    text = render(caption, placeholders).strip()
    if len(text) > MAX_CAPTION:
        raise PlanInvalid("caption", f"{len(text)} characters, over the limit of {MAX_CAPTION}")
    items = tuple(str(m).strip() for m in media)
    if len(items) > MAX_MEDIA:
        raise PlanInvalid("media", f"at most {MAX_MEDIA} items")
    for i, url in enumerate(items):
        if not url.startswith(("https://", "http://")) or len(url) > 2000:
            raise PlanInvalid(f"media[{i}]", "an http(s) URL of at most 2000 characters is required")
    if channel == "facebook" and not text:
        raise PlanInvalid("caption", "a Facebook post needs a caption")
    if channel == "instagram" and not items:
        raise PlanInvalid("media", "an Instagram post needs an image (media)")
    when = parse_time(scheduled_at)
    for field, value in (
        ("caption", text),
        *((f"media[{i}]", u) for i, u in enumerate(items)),
        ("first_comment", first_comment or ""),
    ):
        if "\x00" in value:
            raise PlanInvalid(field, "a NUL character cannot be stored")
    comment = None
    if first_comment is not None:
        # Stored as written (line breaks kept); only its hash uses the normalised text.
        comment = first_comment.strip()
        if channel != "instagram":
            raise PlanInvalid("first_comment", "a first comment is for Instagram posts")
        if not normalize_comment(comment) or len(comment) > MAX_COMMENT:
            raise PlanInvalid("first_comment", f"1-{MAX_COMMENT} characters are required")
    given = idempotency_key_given
    if given is not None and (not isinstance(given, str) or not 1 <= len(given) <= 128):
        raise PlanInvalid("idempotency_key", "1-128 characters")
    if given is not None:
        key, derived = given, False
    elif has_plan:
        key, derived = idempotency_key(brand, channel, account, when, items, text), True
    else:
        import uuid

        key, derived = str(uuid.uuid4()), False
    return Normalized(brand, channel, account, text, items, when, comment, key, derived)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


__all__ = [
    "Normalized",
    "PlanInvalid",
    "comment_hash",
    "idempotency_key",
    "iso",
    "media_hash",
    "normalize",
    "normalize_comment",
    "parse_time",
    "render",
]
