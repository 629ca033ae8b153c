"""HMAC-SHA256 request signing between the trading stages and the AI coach (pure, stdlib).

The signed string is ``METHOD\\npath_with_query\\ntimestamp\\nnonce\\nsha256_hex(body)``; the
signature is its HMAC-SHA256 under the key id's secret, in hex. Four headers carry it:
``X-KeyId``, ``X-Timestamp`` (unix seconds), ``X-Nonce`` (uuid4 hex) and ``X-Signature``.

A :class:`Verifier` refuses a timestamp more than ``skew_s`` away from its clock and a nonce
it has already accepted within ``nonce_ttl_s``; since every try is signed afresh (new nonce,
new timestamp), a client that tries again after a failure is never taken for a replay.
Reasons name the header or check that failed, never a secret or a signature.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
import uuid
from collections.abc import Mapping

__all__ = [
    "HEADER_KEY_ID",
    "HEADER_NONCE",
    "HEADER_SIGNATURE",
    "HEADER_TIMESTAMP",
    "Verifier",
    "canonical",
    "sign",
]

HEADER_KEY_ID = "X-KeyId"
HEADER_TIMESTAMP = "X-Timestamp"
HEADER_NONCE = "X-Nonce"
HEADER_SIGNATURE = "X-Signature"
_HEADERS = (HEADER_KEY_ID, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE)
# A nonce is a uuid4's 32 hex digits; anything much longer only fills the replay memory.
_MAX_NONCE = 128


def canonical(method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    """The string both sides sign: method (upper case), path with its query, timestamp,
    nonce and the body's SHA-256 hex, one per line."""
    digest = hashlib.sha256(body).hexdigest()
    return f"{method.upper()}\n{path}\n{timestamp}\n{nonce}\n{digest}"


def _signature(secret: str, message: str) -> str:
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def sign(
    key_id: str,
    secret: str,
    method: str,
    path: str,
    body: bytes,
    *,
    now: float | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """The four signature headers for one request (``path`` with its query string, exactly
    as sent). ``now`` (unix seconds) and ``nonce`` default to the clock and a fresh uuid4."""
    timestamp = str(int(time.time() if now is None else now))
    nonce = uuid.uuid4().hex if nonce is None else nonce
    return {
        HEADER_KEY_ID: key_id,
        HEADER_TIMESTAMP: timestamp,
        HEADER_NONCE: nonce,
        HEADER_SIGNATURE: _signature(secret, canonical(method, path, timestamp, nonce, body)),
    }


class Verifier:
    """Checks signed requests against ``secrets`` (key id → secret). Thread-safe: the
    accepted nonces are shared by every request thread of a server."""

    def __init__(self, secrets: Mapping[str, str], *, skew_s: float = 300, nonce_ttl_s: float = 600) -> None:
        self._secrets = dict(secrets)
        self.skew_s = skew_s
        # A nonce must be remembered at least as long as its timestamp stays acceptable.
        self.nonce_ttl_s = max(nonce_ttl_s, 2 * skew_s)
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], float] = {}  # (key id, nonce) → forget after

    def __repr__(self) -> str:
        return f"Verifier(keys={sorted(self._secrets)}, skew_s={self.skew_s})"

    def check(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        now: float | None = None,
    ) -> str | None:
        """``None`` when the request is validly signed and its nonce is new (the nonce is
        then remembered), else the reason: ``missing header X-…``, ``unknown key id``,
        ``bad timestamp``, ``bad nonce``, ``clock skew``, ``bad signature`` or ``replayed
        nonce``. ``headers`` may be any mapping; names are matched case-insensitively."""
        now = time.time() if now is None else now
        lowered = {str(k).lower(): str(v) for k, v in headers.items()}
        values: dict[str, str] = {}
        for name in _HEADERS:
            value = lowered.get(name.lower(), "").strip()
            if not value:
                return f"missing header {name}"
            values[name] = value
        key_id, timestamp = values[HEADER_KEY_ID], values[HEADER_TIMESTAMP]
        nonce, signature = values[HEADER_NONCE], values[HEADER_SIGNATURE]
        secret = self._secrets.get(key_id)
        if secret is None:
            return "unknown key id"
        if not timestamp.isascii() or not timestamp.lstrip("-").isdigit() or len(timestamp) > 12:
            return "bad timestamp"
        if len(nonce) > _MAX_NONCE:
            return "bad nonce"
        if abs(now - int(timestamp)) > self.skew_s:
            return "clock skew"
        expected = _signature(secret, canonical(method, path, timestamp, nonce, body))
        if not hmac.compare_digest(expected.encode(), signature.encode()):
            return "bad signature"
        # Only a valid request records its nonce: forged ones cannot fill or poison the memory.
        with self._lock:
            self._prune(now)
            if (key_id, nonce) in self._seen:
                return "replayed nonce"
            self._seen[(key_id, nonce)] = now + self.nonce_ttl_s
        return None

    def remembered(self) -> int:
        """How many nonces are remembered now (for tests and stats)."""
        with self._lock:
            return len(self._seen)

    def _prune(self, now: float) -> None:
        """Forget nonces past their TTL (insertion order is expiry order for a steady clock;
        a scan stops at the first live one, so an out-of-order entry waits a little)."""
        expired = []
        for entry, until in self._seen.items():
            if until > now:
                break
            expired.append(entry)
        for entry in expired:
            del self._seen[entry]
