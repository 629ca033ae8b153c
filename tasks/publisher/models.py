"""The publisher family's payloads: ids and references, never the caption (the body reads
the record when it runs, so an edit is never published stale)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

STAGE = "conveyor.publisher.publish"
FIRST_COMMENT_STAGE = "conveyor.publisher.first_comment"
QUEUE = "publisher"
# The channel and account ride along (they never change) for the platform's per-channel
# concurrency key and per-account lease; the brand for the blackout windows.
LEASE_KEY = "publisher:{channel}:{account}"
CONCURRENCY_KEY = "channel:{channel}"

_ID = Field(min_length=1, max_length=36)
_NAME = Field(min_length=1, max_length=100)


class PublishPayload(BaseModel):
    """``conveyor.publisher.publish``: one post's record."""

    model_config = ConfigDict(extra="forbid")

    post_id: str = _ID
    brand: str = _NAME
    channel: Literal["facebook", "instagram"]
    account: str = _NAME


class FirstCommentPayload(BaseModel):
    """``conveyor.publisher.first_comment``: the comment's record, the media it goes under
    and the hash of its normalised text (its dedup identity with ``media_id``)."""

    model_config = ConfigDict(extra="forbid")

    post_id: str = _ID
    media_id: str = Field(min_length=1, max_length=100)
    comment_hash: str = Field(min_length=64, max_length=64, pattern="^[0-9a-f]{64}$")


__all__ = [
    "CONCURRENCY_KEY",
    "FIRST_COMMENT_STAGE",
    "LEASE_KEY",
    "QUEUE",
    "STAGE",
    "FirstCommentPayload",
    "PublishPayload",
]
