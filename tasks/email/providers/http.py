"""The HTTP provider: ``POST {url}/emails`` with ``Idempotency-Key: <outboxId>``, so sending
again after an unknown outcome returns the first send's id instead of a second message.
stdlib ``http.client``: neither httpx nor requests is a runtime dependency."""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from tasks.email.errors import DeliveryUncertain, ProviderRefused, ProviderUnavailable
from tasks.email.providers import Delivery, OutgoingEmail
from tasks.email.settings import HttpSettings


class HttpProvider:
    """Sends through an HTTP email API (:class:`HttpSettings`). 2xx: ``{"id": ...}``; 429 and
    5xx: :class:`ProviderUnavailable` (a 5xx after acceptance is possible in theory, but a
    resend with the same key is safe); other 4xx: :class:`ProviderRefused`; no response
    after the request went out: :class:`DeliveryUncertain`."""

    name = "http"

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        parts = urlsplit(settings.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._path = parts.path.rstrip("/") + "/emails"

    def _connection(self) -> http.client.HTTPConnection:
        timeout = self.settings.timeout
        if self._https:
            context = ssl.create_default_context()
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=context)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def send(self, email: OutgoingEmail, *, before_commit_point: Callable[[], None]) -> Delivery:
        """Send ``email``; see :mod:`tasks.email.providers` for the contract."""
        body = json.dumps(_body(email)).encode("utf-8")
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Idempotency-Key": email.outbox_id,
        }
        if self.settings.token is not None:
            headers["Authorization"] = f"Bearer {self.settings.token.get_secret_value()}"
        conn = self._connection()
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise ProviderUnavailable("the email API did not accept a connection in time") from None
            except OSError as exc:
                raise ProviderUnavailable(
                    f"the email API could not be reached ({type(exc).__name__}); nothing was sent"
                ) from None
            before_commit_point()
            try:
                conn.request("POST", self._path, body=body, headers=headers)
                response = conn.getresponse()
                status = response.status
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:
                raise DeliveryUncertain(
                    f"no response from the email API ({type(exc).__name__}); "
                    "the message may have been accepted"
                ) from None
            return Delivery(self.name, _accepted_id(status, raw), ())
        finally:
            conn.close()


def _body(email: OutgoingEmail) -> dict[str, Any]:
    return {
        "from": email.from_address,
        "to": email.to,
        "cc": list(email.cc),
        "bcc": list(email.bcc),
        "reply_to": email.reply_to,
        "subject": email.subject,
        "html": email.html,
        "headers": {**email.headers, "Message-ID": email.message_id},
        "tags": list(email.tags),
    }


def _accepted_id(status: int, raw: bytes) -> str:
    """The message id of a 2xx answer, or the error its status means (the body, which may
    quote addresses, is never copied into a message)."""
    if status == 429 or 500 <= status < 600:
        raise ProviderUnavailable(f"the email API answered {status}; nothing was accepted", code=status)
    if not 200 <= status < 300:
        raise ProviderRefused(f"the email API refused the message ({status})", code=status)
    try:
        answer = json.loads(raw)
        message_id = answer["id"] if isinstance(answer, dict) else None
    except (ValueError, KeyError):
        message_id = None
    if not isinstance(message_id, (str, int)) or isinstance(message_id, bool) or message_id == "":
        # Accepted without telling us its id: the resend with the same key will.
        raise DeliveryUncertain(f"the email API answered {status} without a message id")
    return str(message_id)
