"""The trading family's errors, on the platform's hierarchy (``conveyor.errors``): the
class decides retry or dead letter. Messages name the user, broker or endpoint, never a
token, a secret or a raw broker row."""

from __future__ import annotations

from conveyor.errors import PermanentError, TransientError


class RateLimited(Exception):
    """A peer asked us to wait ``retry_after`` seconds (a 429's ``Retry-After``, or a rate
    limit window exhausted until its reset). Not a failure: the stage turns it into
    :class:`conveyor.errors.Deferred`."""

    def __init__(self, retry_after: float, *, source: str) -> None:
        super().__init__(f"{source} rate limit: retry after {retry_after:.3f}s")
        self.retry_after = max(0.0, retry_after)
        self.source = source


class BrokerUnauthorized(PermanentError):
    """The broker refused the stored token (401/403), or the user has no connection."""


class NotYourUser(PermanentError):
    """The job's owner (an API token's) is not the owner of the trading user it names: the
    job does nothing (and says nothing of whose the user is)."""


class UnreadablePage(TransientError):
    """A broker page that is not the JSON we expect (its number in the message)."""


class PeerUnavailable(TransientError):
    """A broker, market-data or AI endpoint answered 5xx, timed out or could not be reached."""


class CoachUnauthorized(PermanentError):
    """The AI coach refused our signature (401): a wrong key id or secret, or a clock skew."""
