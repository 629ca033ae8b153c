"""Errors of the email family, each mapped onto the platform's retry policy.

No message names an address or a secret: servers quote addresses in their replies, so a
reply's text is never copied in, only its code and enhanced status code (``5.1.1``).
"""

from __future__ import annotations

from conveyor.errors import PermanentError, TransientError


class EmailRejected(PermanentError):
    """The server refused every recipient (5xx) or the message itself as undeliverable: the
    seed's ``INVALID_EMAIL``. Dead-lettered after one attempt. ``code``: the reply code."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class HtmlNotFound(PermanentError):
    """``htmlRef`` resolves to no stored HTML."""


class DeliveryUnknown(PermanentError):
    """A previous attempt reached the point of no return and its outcome never came back;
    ``on_unknown="hold"`` stops here rather than risk a second copy."""

    def __init__(self, message_id: str) -> None:
        super().__init__(f"delivery state unknown for {message_id}")
        self.message_id = message_id


class ProviderUnavailable(TransientError):
    """Nothing was accepted: a network error, a timeout before the point of no return, a 4xx
    SMTP reply, HTTP 429/5xx, SES throttling. Retried per the schedule; the outbox row goes
    back to ``PENDING``. ``code``: the reply or status code, when there was one."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class ProviderRefused(PermanentError):
    """A permanent refusal that is not about the recipients: a 5xx to the sender, the data or
    the login; HTTP 4xx other than 429; SES ``InvalidParameterValue`` and the like."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class DeliveryUncertain(TransientError):
    """The send passed the point of no return (DATA transmitted, the HTTP request sent) and no
    reply came back: the message may have been delivered. The outbox row stays ``SENDING``;
    the next attempt decides by ``on_unknown`` (or resends with the same idempotency key)."""
